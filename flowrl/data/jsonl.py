"""Naming the bad lines of a JSON Lines file that ``datasets`` refused to read.

``datasets`` (through pyarrow) reads the file; when it fails, its message names a row at
best. This check re-reads the text and lists every line that is not a JSON object, with
its line number, so the user can fix them all at once.
"""

from __future__ import annotations

import json
from pathlib import Path

from flowrl.errors import DataError

MAX_REPORTED_LINES = 20
"""Bad lines listed in one DataError; the rest are counted."""

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
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"cannot read data file {display_name}: {error}") from error
    problems = []
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        why = _what(text)
        if why is not None:
            problems.append(f"{display_name}:{number}: expected a JSON object, found {why}")
    if not problems:
        return
    shown = problems[:MAX_REPORTED_LINES]
    more = len(problems) - len(shown)
    header = f"{len(problems)} bad line{'s' if len(problems) != 1 else ''} in {display_name} (one JSON object per line, e.g. {EXAMPLE_LINE}):"
    tail = [f"  ... and {more} more"] if more else []
    raise DataError("\n".join([header, *(f"  {line}" for line in shown), *tail]))
