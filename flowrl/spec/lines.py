"""Read YAML text safely and remember on which line every key sits.

The data comes from ``yaml.safe_load`` (no arbitrary objects). A second pass composes the
node tree with the same ``SafeLoader`` to map each dotted path (``nodes.rollout.n``) to the
1-based line of its key, and to catch duplicate keys, which YAML itself silently collapses
to the last one.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from flowrl.errors import SpecError, SpecIssue

LineMap = dict[str, int]
"""Dotted path -> 1-based line of the key (or of the list item)."""


def read_yaml_file(
    path: str | Path, kind: str, error: type[SpecError] = SpecError
) -> tuple[Any, LineMap, list[SpecIssue]]:
    """Read and parse the ``kind`` file (``pipeline``, ``scenario``...) at ``path``.

    A missing, unreadable or unparsable file raises ``error`` naming the file.
    """
    source = str(path)
    file = Path(path)
    if not file.is_file():
        if file.is_dir():
            what = f"is a directory, not {_article(kind)} {kind} file"
        else:
            what = f"no such file{_nearest_file(file)}; check the path"
        raise error([SpecIssue("", what, source)])
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as failure:
        raise error([SpecIssue("", f"cannot be read: {failure}", source)]) from None
    try:
        return parse_yaml(text, source)
    except SpecError as failure:
        raise error(failure.issues) from None


def nearest_beside(path: Path, folders: bool = False, cutoff: float = 0.75,
                   keep: Callable[[Path], bool] | None = None) -> Path | None:
    """The file (with ``folders``, the folder) beside ``path`` whose name is closest to its
    name, or None; ``keep``: only entries it is true of (``path`` itself never)."""
    try:
        names = [entry.name for entry in path.parent.iterdir()
                 if (entry.is_dir() if folders else entry.is_file()) and entry.name != path.name
                 and (keep is None or keep(entry))]
    except OSError:
        return None
    matches = difflib.get_close_matches(path.name, names, n=1, cutoff=cutoff)
    return path.parent / matches[0] if matches else None


def _nearest_file(file: Path) -> str:
    """`` (did you mean 'x'?)`` for the file beside ``file`` whose name is closest, or ''."""
    near = nearest_beside(file)
    if near is None:
        return ""
    return f" (did you mean '{near if str(file.parent) != '.' else near.name}'?)"


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


class ValueLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also reads ``1e-5``, ``3E8`` and ``1.0e5`` as numbers.

    YAML 1.1 (PyYAML) wants a dot and a signed exponent (``1.0e-5``) and leaves the rest as
    text; in a file as on a command line, everyone means the number (``lr: 1e-6``).
    """


class ValueDumper(yaml.SafeDumper):
    """``yaml.SafeDumper`` that quotes a string :class:`ValueLoader` would read as a number."""


for _reader in (ValueLoader, ValueDumper):
    _reader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"),
        list("-+.0123456789"),
    )


def parse_yaml(text: str, source_name: str) -> tuple[Any, LineMap, list[SpecIssue]]:
    """Parse ``text``; return the data, the line map and duplicate-key issues.

    A syntax error raises ``SpecError`` with the line where YAML gave up.
    """
    try:
        data = yaml.load(text, Loader=ValueLoader)  # noqa: S506 - a SafeLoader subclass
        root = yaml.compose(text, Loader=ValueLoader)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        line = mark.line + 1 if mark is not None else None
        problem = error.problem or "cannot be parsed"
        context = ""
        if error.context:
            start = error.context_mark
            started = (
                f" started at line {start.line + 1}"
                if start is not None and start.line + 1 != line
                else ""
            )
            context = f" ({error.context}{started})"
        syntax = isinstance(error, (yaml.scanner.ScannerError, yaml.parser.ParserError))
        message = f"YAML {'syntax ' if syntax else ''}error: {problem}{context}"
        hint = _syntax_hint(error, text.splitlines())
        if hint:
            message += f"; {hint}"
        raise SpecError([SpecIssue("", message, source_name, line)]) from None
    except yaml.YAMLError as error:
        raise SpecError([SpecIssue("", f"YAML error: {error}", source_name)]) from None
    line_map: LineMap = {}
    duplicates: list[SpecIssue] = []
    if root is not None:
        _walk(root, "", line_map, duplicates, source_name)
    return data, line_map, duplicates


def _syntax_hint(error: yaml.MarkedYAMLError, lines: list[str]) -> str | None:
    """What the usual causes of a YAML syntax error look like in plain words: a tab, a line
    indented to no key's column, a value given twice."""
    problem, mark = error.problem or "", error.problem_mark
    if "'\\t'" in problem:
        return "YAML indents with spaces only: replace the tabs on this line with spaces"
    if mark is None or mark.line >= len(lines):
        return None
    line = lines[mark.line]
    indent = len(line) - len(line.lstrip())
    above = next((earlier for earlier in reversed(lines[: mark.line])
                  if earlier.strip() and not earlier.lstrip().startswith("#")), None)
    above_indent = len(above) - len(above.lstrip()) if above is not None else 0
    if line.lstrip().startswith("-") or (above is not None and above.lstrip().startswith("-")):
        return None  # a list item's keys start after its "- ": the columns above say too little
    if problem.startswith("expected <block end>") and error.context_mark is not None:
        start = error.context_mark
        if indent in (above_indent, start.column):
            return None
        return (f"this line is indented by {_spaces(indent)}, the line above it by {_spaces(above_indent)} and the "
                f"mapping that starts at line {start.line + 1} by {_spaces(start.column)}: the keys of one mapping "
                "start in one column")
    if problem.startswith("mapping values are not allowed"):
        if above is not None and indent > above_indent and ":" in above and above.split(":", 1)[1].split("#")[0].strip():
            return (f"this line is indented under '{above.strip()}', which already has its value: give that key no "
                    "value on its line, or indent this line like it")
        return "a ': ' inside an unquoted value: put the value in quotes"
    if problem == "expected ',' or '}', but got ':'":
        start = error.context_mark
        if start is not None and start.line != mark.line:
            return f"the '{{' on line {start.line + 1} is not closed on its line: close it with '}}'"
        return "a ':' inside an unquoted value of a {...} mapping: put the value in quotes"
    return None


def _spaces(count: int) -> str:
    return f"{count} space{'' if count == 1 else 's'}"


def _walk(
    node: yaml.Node, prefix: str, line_map: LineMap, duplicates: list[SpecIssue], source: str
) -> None:
    if isinstance(node, yaml.MappingNode):
        first_line: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value)
            path = f"{prefix}.{key}" if prefix else key
            line = key_node.start_mark.line + 1
            if key in first_line:
                first = first_line[key]
                where = f" (first at line {first})" if first != line else ""
                message = (
                    f"duplicate key '{key}'{where}; YAML would keep only the last one, "
                    "so remove one of them"
                )
                duplicates.append(SpecIssue(path, message, source, line))
            else:
                first_line[key] = line
            line_map[path] = line  # the last occurrence is the one whose value is kept
            _walk(value_node, path, line_map, duplicates, source)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            path = f"{prefix}.{index}" if prefix else str(index)
            line_map.setdefault(path, item.start_mark.line + 1)
            _walk(item, path, line_map, duplicates, source)


def line_of(path: str, line_map: LineMap) -> int | None:
    """Line of ``path``, or of its nearest enclosing key when it is not in the file."""
    found = _nearest(path, line_map)
    return line_map[found] if found is not None else None


def file_order(path: str, line_map: LineMap) -> int:
    """Rank of ``path`` (or its nearest enclosing key) in file order; -1 when not in the file."""
    found = _nearest(path, line_map)
    return list(line_map).index(found) if found is not None else -1


def _nearest(path: str, line_map: LineMap) -> str | None:
    parts = path.split(".") if path else []
    while parts:
        candidate = ".".join(parts)
        if candidate in line_map:
            return candidate
        parts.pop()
    return None
