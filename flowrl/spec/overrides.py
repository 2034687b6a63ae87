"""Command-line overrides of a pipeline file: ``flowrl run p.yaml trainer.steps=50``.

Each ``KEY=VALUE`` argument sets one field, named by its dotted path, in the data read from
the file before that data is validated, so an overridden pipeline is checked by exactly the
code that checks a file and gets the same messages. Issues about an overridden field name
the argument (``command line: trainer.steps=abc: ...``) instead of a file line, since the
file is not where the mistake is.

A value is read as YAML (``50``, ``true``, ``null``, ``[a, b]``, ``{x: 1}``, quoted text),
except that ``1e-5`` is a number, as the user means it, not the text YAML 1.1 makes of it.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from flowrl.errors import SpecError, SpecIssue
from flowrl.spec.lines import LineMap, ValueLoader
from flowrl.spec.messages import did_you_mean, show

COMMAND_LINE = "command line"
"""What an issue about an override names instead of a file."""

Origins = dict[str, str]
"""Dotted path -> the override argument that set it (or created the mapping holding it)."""


@dataclass(frozen=True)
class Override:
    """One parsed ``KEY=VALUE`` argument."""

    text: str
    """The argument as given, for messages."""
    path: tuple[str, ...]
    """The dotted key split at its dots: ``("nodes", "train", "lr")``."""
    value: Any
    """The value read as YAML."""

    @property
    def key(self) -> str:
        return ".".join(self.path)


def parse_value(text: str) -> Any:
    """``text`` read as one YAML value; an empty text is null. Raises ``yaml.YAMLError``."""
    return yaml.load(text, Loader=ValueLoader)  # noqa: S506 - a SafeLoader subclass


def parse_override(text: str) -> Override:
    """Parse one ``KEY=VALUE`` argument; a malformed one raises ``SpecError`` naming it."""
    key, equals, value_text = text.partition("=")
    key = key.strip()
    if not equals:
        raise _error(text, "", "expected KEY=VALUE (such as trainer.steps=50), found no '='")
    if not key:
        raise _error(
            text, "", "expected a field name before '=' (such as trainer.steps=50), found none"
        )
    path = tuple(key.split("."))
    if "" in path:
        raise _error(
            text, "", f"expected a dotted field name such as nodes.train.lr, found '{key}' "
            "with an empty name between dots"
        )
    try:
        value = parse_value(value_text)
    except yaml.YAMLError as failure:
        problem = getattr(failure, "problem", None) or "cannot be parsed"
        raise _error(
            text, key, f"the value is not valid YAML ({problem}); to pass it as text, "
            f"quote it for YAML inside the shell's quotes: \"{key}='...'\""
        ) from None
    return Override(text, path, value)


def parse_overrides(texts: Sequence[str]) -> list[Override]:
    """Parse every argument; raise one ``SpecError`` listing all malformed ones."""
    parsed: list[Override] = []
    issues: list[SpecIssue] = []
    for text in texts:
        try:
            parsed.append(parse_override(text))
        except SpecError as failure:
            issues.extend(failure.issues)
    if issues:
        raise SpecError(issues)
    return parsed


def apply_overrides(
    data: Any, line_map: LineMap, overrides: Sequence[Override]
) -> tuple[Any, LineMap, Origins, list[SpecIssue]]:
    """``data`` with ``overrides`` applied in order, where each path now comes from, and the
    overrides that could not apply.

    Returns a copy of the data (the input is left alone), the line map without the paths
    whose file values were replaced, the origins of the overridden paths, and an issue for
    each override that was left out: a path through a value that is not a mapping, or a
    node the overrides made without a role (a misspelt node of the file, most likely). The
    caller reports them with what validation finds in the rest, all at once. Missing
    mappings on the way are created (an empty file becomes a mapping); data that is not a
    mapping is left for validation to reject.
    """
    if not overrides:
        return data, line_map, {}, []
    if data is None:
        data = {}
    if not isinstance(data, dict):
        return data, line_map, {}, []  # validation reports that the file is not a pipeline
    file_nodes = list(data.get("nodes") or {}) if isinstance(data.get("nodes"), dict) else []
    data = copy.deepcopy(data)
    lines = dict(line_map)
    origins: Origins = {}
    issues = [
        issue for override in overrides
        if (issue := _apply(data, override, lines, origins)) is not None
    ]
    roleless = _new_nodes_without_role(data, overrides, file_nodes)
    for issue in roleless:  # left out, so validation does not report the same node again
        del data["nodes"][issue.path.split(".")[1]]
        _forget(issue.path, lines, origins)
    return data, lines, origins, [*issues, *roleless]


def _apply(
    data: dict[str, Any], override: Override, lines: LineMap, origins: Origins
) -> SpecIssue | None:
    mapping = data
    for depth, part in enumerate(override.path[:-1]):
        here = ".".join(override.path[: depth + 1])
        child = mapping.get(part)
        if child is None:  # missing, or null in the file: a new mapping
            child = mapping[part] = {}
            _forget(here, lines, origins)
            origins[here] = override.text
        elif not isinstance(child, dict):
            return _not_a_mapping(override, here, child, override.path[depth + 1])
        mapping = child
    mapping[override.path[-1]] = copy.deepcopy(override.value)
    _forget(override.key, lines, origins)
    origins[override.key] = override.text
    return None


def _new_nodes_without_role(data: dict[str, Any], overrides: Sequence[Override], file_nodes: list[str]) -> list[SpecIssue]:
    """A node the overrides made without a role is most likely a misspelt one of the file's."""
    issues: list[SpecIssue] = []
    named: set[str] = set()
    nodes = data.get("nodes")
    for override in overrides:
        if len(override.path) < 2 or override.path[0] != "nodes" or not isinstance(nodes, dict):
            continue
        name = override.path[1]
        node = nodes.get(name)
        if name in file_nodes or name in named or not isinstance(node, dict) or "role" in node:
            continue
        named.add(name)
        issues.append(SpecIssue(
            f"nodes.{name}", f"no node '{name}' in the file{did_you_mean(name, file_nodes)}; a new node needs its "
            f"role too (nodes.{name}.role=...)", COMMAND_LINE, None, override.text))
    return issues


def _forget(path: str, lines: LineMap, origins: Origins) -> None:
    """Drop ``path`` and everything under it: its old value is gone."""
    below = f"{path}."
    for table in (lines, origins):
        for known in [known for known in table if known == path or known.startswith(below)]:
            del table[known]


def _not_a_mapping(override: Override, here: str, value: Any, field: str) -> SpecIssue:
    if isinstance(value, list):
        fix = f"set the whole list instead, such as {here}=[a, b]"
    else:
        fix = f"set '{here}' itself instead"
    message = f"'{here}' is {show(value)}, not a mapping, so it has no field '{field}'; {fix}"
    return SpecIssue(override.key, message, COMMAND_LINE, None, override.text)


def _error(text: str, path: str, message: str) -> SpecError:
    return SpecError([SpecIssue(path, message, COMMAND_LINE, None, text)])


def origin_of(path: str, origins: Origins, line_map: LineMap) -> str | None:
    """The override argument ``path`` comes from, or None when it comes from the file.

    The nearest enclosing path that either an override set or the file holds decides.
    """
    parts = path.split(".") if path else []
    while parts:
        candidate = ".".join(parts)
        if candidate in origins:
            return origins[candidate]
        if candidate in line_map:
            return None
        parts.pop()
    return None
