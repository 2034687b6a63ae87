"""Checking a JSON data file before ``datasets`` reads it.

``datasets`` (through pyarrow) reads the file; its errors name a row at best, and on some
malformed input pyarrow crashes the process. This check reads the text first and lists
every line that is not a JSON object, with its line number, so the user can fix them all
at once and the reader only ever sees well-formed objects.
"""

from __future__ import annotations

import json
from pathlib import Path

from flowrl.errors import DataError

MAX_REPORTED_LINES = 20
"""Bad lines (or rows) listed in one DataError; the rest are counted."""

EXAMPLE_LINE = '{"prompt": "2+2=", "answer": "4"}'


def _what(text: str) -> str | None:
    """Why a line is not a JSON object, or None when it is one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        return f"invalid JSON ({error.msg} at column {error.colno})"
    if isinstance(value, dict):
        return None
    kind = "an array" if isinstance(value, list) else type(value).__name__
    shown = text if len(text) <= 60 else text[:57] + "..."
    return f"{kind}: {shown}"


def check_json_lines(path: Path, display_name: str) -> None:
    """Raise DataError listing the lines of ``path`` that are not JSON objects (if any).

    ``display_name`` is how the file is named in the message (the path as the user wrote it).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"cannot read data file {display_name}: {error}") from error
    if text.lstrip().startswith("["):
        _check_array(text, display_name)
        return
    lines = text.splitlines()
    problems = []
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        why = _what(text)
        if why is not None:
            problems.append(f"{display_name}:{number}: expected a JSON object, found {why}")
    raise_listed(problems, "line", display_name, f"one JSON object per line, e.g. {EXAMPLE_LINE}")


def raise_listed(problems: list[str], unit: str, display_name: str, expected: str) -> None:
    """One DataError listing the first ``MAX_REPORTED_LINES`` problems (bad lines or rows) and
    counting the rest; nothing when there are none."""
    if not problems:
        return
    shown = problems[:MAX_REPORTED_LINES]
    more = len(problems) - len(shown)
    header = f"{len(problems)} bad {unit}{'s' if len(problems) != 1 else ''} in {display_name} ({expected}):"
    tail = [f"  ... and {more} more"] if more else []
    raise DataError("\n".join([header, *(f"  {line}" for line in shown), *tail]))


def _check_array(text: str, display_name: str) -> None:
    """A ``.json`` file holding one array: it must be an array of objects."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise DataError(f"{display_name}:{error.lineno}: invalid JSON ({error.msg} at column {error.colno})") from error
    if not isinstance(value, list):
        raise DataError(f"{display_name}: expected JSON objects, one per line, or one array of objects")
    bad = [index for index, item in enumerate(value) if not isinstance(item, dict)]
    if bad:
        raise DataError(
            f"{display_name}: item {bad[0]} of the array is not a JSON object "
            f"({len(bad)} of {len(value)} items are not); every example is an object such as {EXAMPLE_LINE}"
        )
