"""Load a pipeline from a YAML file or a plain dict, reporting every problem at once.

Validation runs in two passes over the same data: the schema (types, ranges, unknown
keys) and the graph rules (names that refer to each other, dataflow, roles). Entries that
fail the schema are left out of the graph pass and references to them are not reported
again, so each mistake gives exactly one message. Issues are listed in file order, then
those about command-line overrides (``trainer.steps=abc``) in the order they were given.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from flowrl.errors import DataError, FlowrlError, ModelLoadError, SpecError, SpecIssue, UnmatchedGroups
from flowrl.graph import PipelineGraph, find_graph_issues
from flowrl.spec.lines import LineMap, file_order, line_of, read_yaml_file
from flowrl.spec.messages import Issue, issues_from_validation, show
from flowrl.spec.overrides import (
    COMMAND_LINE,
    Origins,
    apply_overrides,
    origin_of,
    parse_overrides,
)
from flowrl.spec.schema import SECTION_CLASSES, DataSpec, NodeSpec, PipelineSpec

_NODE_ADAPTER: TypeAdapter[Any] = TypeAdapter(NodeSpec)


def load_pipeline(path: str | Path, overrides: Sequence[str] = ()) -> PipelineGraph:
    """Read the pipeline file at ``path``, apply ``overrides`` (``trainer.steps=50``), validate.

    The overrides change the data before validation, so the result is checked as if the
    file said it. Raises ``SpecError`` listing every problem as ``file:line: path: message``,
    or ``command line: KEY=VALUE: message`` for one an override brought in.
    """
    source_name = str(path)
    parsed = parse_overrides(overrides)
    data, line_map, duplicates = read_yaml_file(path, "pipeline")
    if data is None:  # an empty file, not the few fields overrides (--steps) would make of it
        return _validate(None, source_name, line_map, duplicates)
    data, line_map, origins, left_out = apply_overrides(data, line_map, parsed)
    return _validate(data, source_name, line_map, [*duplicates, *left_out], origins)


def pipeline_from_dict(
    data: Any, source_name: str | None = None, line_map: LineMap | None = None
) -> PipelineGraph:
    """Validate plain data (as ``yaml.safe_load`` gives it) into a ``PipelineGraph``.

    ``source_name`` and ``line_map`` (dotted path -> line) put ``file:line`` on issues.
    """
    return _validate(data, source_name, line_map or {}, [])


def _validate(
    data: Any,
    source_name: str | None,
    line_map: LineMap,
    early: list[SpecIssue],
    origins: Origins | None = None,
) -> PipelineGraph:
    first_line = 1 if source_name else None
    if data is None:
        message = "the file is empty; a pipeline needs name, models, nodes and data"
        raise SpecError([*early, SpecIssue("", message, source_name, first_line)])
    if not isinstance(data, dict):
        message = (
            "expected a mapping of pipeline sections (name, models, nodes, data, ...), "
            f"found {show(data)}"
        )
        raise SpecError([*early, SpecIssue("", message, source_name, first_line)])
    spec: PipelineSpec | None = None
    found: list[Issue] = []
    try:
        spec = PipelineSpec.model_validate(data)
        found.extend(find_graph_issues(spec))
    except ValidationError as error:
        found.extend(issues_from_validation(error))
        partial, unusable = _partial_spec(data, error)
        found.extend(find_graph_issues(partial, unusable))
    origins = origins or {}
    located = (_locate(path, message, source_name, line_map, origins) for path, message in found)
    issues = [*early, *located]
    if issues:
        if line_map or origins:
            issues.sort(key=_in_order(line_map, origins))
        raise SpecError(issues)
    assert spec is not None
    return PipelineGraph(spec)


Locate = Callable[[str, str], SpecIssue]
"""(dotted path, message) -> the issue at its place: a line of the file, or the override."""


def issue_locator(path: str | Path, overrides: Sequence[str] = ()) -> Locate:
    """Where issues found later (data, reward functions, models) about the pipeline that
    ``load_pipeline(path, overrides)`` read are: the file's line, or the override that set the field."""
    data, line_map, _ = read_yaml_file(path, "pipeline")
    _, line_map, origins, _ = apply_overrides(data, line_map, parse_overrides(overrides))
    return lambda where, message: _locate(where, message, str(path), line_map, origins)


def placed(error: FlowrlError, locate: Locate) -> FlowrlError:
    """``error`` found while a run of the pipeline started (its data, its reward functions,
    the devices its groups match), with its issues placed by ``locate`` at their line or
    override: a DataError or ModelLoadError that names its field, or device groups no devices
    satisfy, become a SpecError there; a pipeline's SpecError gets
    the places its issues lack. Anything else comes back as it was. The run names a field only
    for what it finds as it starts (the errors its steps raise name none), so an error of a
    step is never placed at a line of the file."""
    if isinstance(error, (DataError, ModelLoadError)) and error.field:
        return SpecError([locate(error.field, str(error))])
    if isinstance(error, UnmatchedGroups):
        return SpecError([locate(path, message) for path, message in error.problems])
    def unplaced(issue: SpecIssue) -> bool:
        return issue.file is None and issue.argument is None

    if type(error) is SpecError and any(map(unplaced, error.issues)):
        return SpecError([locate(issue.path, issue.message) if unplaced(issue) else issue for issue in error.issues])
    return error


@contextmanager
def placed_within(locate: Locate | None) -> Iterator[None]:
    """The flowrl errors raised inside, :func:`placed` by ``locate`` where it can place them
    (None: as they are)."""
    try:
        yield
    except FlowrlError as error:
        located = placed(error, locate) if locate is not None else error
        if located is error:
            raise
        raise located from None


def _locate(
    path: str, message: str, source_name: str | None, line_map: LineMap, origins: Origins
) -> SpecIssue:
    argument = _named_override(path, message, origins) or origin_of(path, origins, line_map)
    section, _, field = path.rpartition(".")
    if argument is None and field.endswith("_key") and path not in line_map and f"{section}.source" in origins:
        # a column the data lacks, under a key nobody set: the override that named the data
        argument = origins[f"{section}.source"]
    if argument is not None:
        return SpecIssue(path, message, COMMAND_LINE, None, argument)
    return SpecIssue(path, message, source_name, line_of(path, line_map) if source_name else None)


def _named_override(path: str, message: str, origins: Origins) -> str | None:
    """Of the overrides inside ``path``, the one that set a field the message names: a check of
    a whole section (``scheduler: min_gain is read only by policy: dynamic``) is about that
    field, not about the first override that touched the section."""
    for key, argument in origins.items():
        inner = key.removeprefix(f"{path}.") if path else key
        if inner != key and "." not in inner and re.search(rf"\b{re.escape(inner)}\b", message):
            return argument
    return None


def _in_order(line_map: LineMap, origins: Origins) -> Callable[[SpecIssue], tuple[int, ...]]:
    """Sort key: the file's issues in file order (by line, then by where the key sits on
    that line), then the command line's in the order of its arguments."""
    arguments = {argument: rank for rank, argument in enumerate(dict.fromkeys(origins.values()))}

    def key(issue: SpecIssue) -> tuple[int, ...]:
        if issue.argument is not None:
            return (1, arguments.get(issue.argument, len(arguments)))
        return (0, issue.line or 0, file_order(issue.path, line_map))

    return key


def _partial_spec(data: dict[str, Any], error: ValidationError) -> tuple[PipelineSpec, set[str]]:
    """The models, device groups, nodes and data usable by the graph checks, and what is not.

    An entry whose errors all sit in optional fields is kept with those fields dropped
    (back to defaults); the dropped fields are returned as unusable (``nodes.train.kl_coef``),
    so rules that read them are skipped. Any other failed entry is unusable as a whole.
    """
    bad_fields: dict[tuple[str, Any], set[str] | None] = {}
    unusable: set[str] = set()
    for detail in error.errors():
        loc = detail["loc"]
        if not loc or loc[0] not in ("models", "devices", "nodes"):
            continue
        if len(loc) == 1:
            unusable.add(str(loc[0]))
            continue
        entry = (str(loc[0]), loc[1])
        depth = 3 if loc[0] == "nodes" else 2  # nodes carry the role tag at loc[2]
        fields = bad_fields.setdefault(entry, set())
        if len(loc) > depth and fields is not None and "[key]" not in loc:
            fields.add(str(loc[depth]))
        else:
            bad_fields[entry] = None  # the entry itself is wrong (not a mapping, bad role, ...)

    def valid_entries(section: str) -> dict[str, Any]:
        raw = data.get(section)
        if raw is None and section == "devices":
            return {}  # optional section
        if section in unusable or not isinstance(raw, dict):
            unusable.add(section)  # missing or not a mapping: references into it cannot be judged
            return {}
        entries: dict[str, Any] = {}
        for name, value in raw.items():
            dropped = bad_fields.get((section, name), set())
            try:
                if dropped is None:
                    raise ValueError("not repairable")
                kept = {key: item for key, item in value.items() if key not in dropped}
                entries[name] = _validate_entry(section, kept)
                unusable.update(f"{section}.{name}.{field}" for field in dropped)
            except (ValueError, AttributeError):  # ValidationError is a ValueError
                unusable.add(f"{section}.{name}")
        return entries

    sections: dict[str, Any] = {}
    try:  # the data section is read by rules on nodes (a mini-batch against the rollout's size)
        if any(detail["loc"][:1] == ("data",) for detail in error.errors()):
            raise ValueError("data failed")
        sections["data"] = DataSpec.model_validate(data.get("data"))
    except ValueError:  # ValidationError is a ValueError
        unusable.add("data")
    spec = PipelineSpec.model_construct(
        models=valid_entries("models"),
        devices=valid_entries("devices"),
        nodes=valid_entries("nodes"),
        **sections,
    )
    return spec, unusable


def _validate_entry(section: str, value: dict[str, Any]) -> Any:
    if section == "nodes":
        return _NODE_ADAPTER.validate_python(value)
    return SECTION_CLASSES[section].model_validate(value)


def pipeline_file(path: str | None, base_dir: Path) -> str | None:
    """A file the pipeline names, as data files are found: in the pipeline's folder first,
    else as given (relative to the working directory)."""
    if path is None:
        return None
    given = Path(path).expanduser()
    nearby = base_dir / given
    return str(nearby) if not given.is_absolute() and nearby.is_file() else str(given)
