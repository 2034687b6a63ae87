"""Reading a prompt dataset from a JSON Lines file, with every bad line reported at once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flowrl.data.examples import PromptExample
from flowrl.errors import DataError

MAX_REPORTED_LINES = 20
"""Bad lines listed in one DataError; the rest are counted."""

_EXAMPLE_LINE = '{"prompt": "2+2=", "answer": "4"}'


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def _describe(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def _parse_line(
    text: str, number: int, prompt_field: str, answer_field: str
) -> tuple[PromptExample | None, str | None]:
    """One line -> (example, None) or (None, what was found instead)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        return None, f"invalid JSON ({error.msg} at column {error.colno})"
    if not isinstance(value, dict):
        return None, f"{_json_kind(value)}: {_describe(value)}"
    if prompt_field not in value:
        fields = ", ".join(repr(key) for key in value) or "none"
        return None, (
            f"an object without it (fields: {fields}; "
            "set data.prompt_field if the prompt is under another name)"
        )
    prompt = value[prompt_field]
    if not isinstance(prompt, str):
        return None, f"'{prompt_field}': {_describe(prompt)} ({_json_kind(prompt)})"
    if not prompt:
        return None, f"an empty '{prompt_field}'"
    answer = value.get(answer_field)
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float, type(None))):
        return None, (
            f"'{answer_field}': {_describe(answer)} (the answer must be a string, a number or null)"
        )
    extra = {key: item for key, item in value.items() if key not in (prompt_field, answer_field)}
    return PromptExample(
        prompt=prompt,
        answer=None if answer is None else str(answer),
        meta={"line": number, "fields": extra},
    ), None


def load_jsonl(
    path: Path, display_name: str, prompt_field: str = "prompt", answer_field: str = "answer"
) -> list[PromptExample]:
    """All examples of a ``.jsonl`` file, in file order; blank lines are skipped.

    ``display_name`` is how the file is named in errors (the path as the user wrote it).
    Raises DataError for a missing, unreadable or empty file, or listing every bad line.
    """
    if not path.exists():
        raise DataError(
            f"data file {display_name} not found (looked at {path}); relative paths are "
            "resolved against the pipeline file's folder. Give a .jsonl file or a built-in "
            "task such as builtin:digits"
        )
    if not path.is_file():
        raise DataError(f"data source {display_name} is a directory; give a .jsonl file inside it")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"cannot read data file {display_name}: {error}") from error

    examples: list[PromptExample] = []
    problems: list[str] = []
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        example, found = _parse_line(text, number, prompt_field, answer_field)
        if example is None:
            problems.append(
                f"{display_name}:{number}: expected a JSON object with a string field "
                f"'{prompt_field}', found {found}"
            )
            continue
        examples.append(example)

    if problems:
        shown = problems[:MAX_REPORTED_LINES]
        more = len(problems) - len(shown)
        header = f"{len(problems)} bad line{'s' if len(problems) != 1 else ''} in {display_name}:"
        tail = [f"  ... and {more} more"] if more else []
        raise DataError("\n".join([header, *(f"  {line}" for line in shown), *tail]))
    if not examples:
        raise DataError(
            f"data file {display_name} is empty; write one JSON object per line, "
            f"e.g. {_EXAMPLE_LINE}"
        )
    return examples
