"""Write a pipeline as a readable YAML file, in the layout of the shipped pipelines.

Each model, device group and node is one flow-style line, fields equal to their default
are left out (except the few that say what an entry is: role, type, estimator), and names
are aligned, so the output reads like a hand-written file. The
result loads back to an equal pipeline (tested).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel

from flowrl.spec.lines import ValueDumper, ValueLoader
from flowrl.spec.schema import PipelineSpec, TrainerSpec

if TYPE_CHECKING:
    from flowrl.graph import PipelineGraph

# Fields shown first in a node line, in this order, so every line starts with what it is.
_NODE_LEADING = ("role", "model", "fn", "estimator", "inputs")
# Fields that say what an entry is; shown even when they hold the default.
_ALWAYS_SHOWN = ("role", "type", "estimator")


def to_yaml(pipeline: PipelineGraph | PipelineSpec) -> str:
    """YAML text for ``pipeline`` (a graph or a spec)."""
    spec = pipeline if isinstance(pipeline, PipelineSpec) else pipeline.spec
    lines = [f"name: {_scalar(spec.name)}"]
    lines += _section("models", {name: _fields(model) for name, model in spec.models.items()})
    if spec.devices:
        lines += _section("devices", {name: _fields(group) for name, group in spec.devices.items()})
    nodes = {name: _fields(node, leading=_NODE_LEADING) for name, node in spec.nodes.items()}
    lines += _section("nodes", nodes)
    lines.append(f"data: {_flow(_fields(spec.data))}")
    if spec.eval is not None:
        lines.append(f"eval: {_flow(_fields(spec.eval))}")
    for section in ("trainer", "scheduler", "runtime", "profiler"):
        fields = _fields(getattr(spec, section))
        if fields:
            lines.append(f"{section}: {_flow(fields)}")
    return "\n".join(lines) + "\n"


def _section(title: str, entries: dict[str, dict[str, Any]]) -> list[str]:
    if not entries:
        return [f"{title}: {{}}"]
    width = max(len(name) for name in entries) + 1
    return [f"{title}:"] + [
        f"  {(name + ':').ljust(width)} {_flow(fields)}" for name, fields in entries.items()
    ]


def _fields(model: BaseModel, leading: tuple[str, ...] = ()) -> dict[str, Any]:
    """Fields that differ from their default (plus ``_ALWAYS_SHOWN``), leading ones first."""
    values = model.model_dump(mode="json")
    kept: dict[str, Any] = {}
    for name, field in type(model).model_fields.items():
        default = field.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            default = default.model_dump(mode="json")
        elif isinstance(default, tuple):
            default = list(default)
        if name in _ALWAYS_SHOWN or field.is_required() or values[name] != default:
            kept[name] = values[name]
    first = {name: kept.pop(name) for name in leading if name in kept}
    return {**first, **kept}


def _flow(value: Any) -> str:
    if isinstance(value, dict):
        return (
            "{" + ", ".join(f"{_scalar(key)}: {_flow(item)}" for key, item in value.items()) + "}"
        )
    if isinstance(value, list):
        return "[" + ", ".join(_flow(item) for item in value) + "]"
    return _scalar(value)


def _scalar(value: Any) -> str:
    """A scalar as YAML, plain when that reads back unchanged inside a flow mapping."""
    if isinstance(value, str):
        plain = value
        try:
            # read back as a pipeline file is read (``1e-5`` is a number there)
            if _load(f"{{k: {plain}}}") == {"k": value} and plain.strip() == plain:
                return plain
        except yaml.YAMLError:
            pass
        return _dump_one(value)
    return _dump_one(value)


def _dump_one(value: Any) -> str:
    text: str = yaml.dump([value], Dumper=ValueDumper, default_flow_style=True, width=1 << 30)
    return text.strip()[1:-1]


RESUME_MAY_CHANGE = {"trainer": ("steps", "output_dir", "torch_profile"), "runtime": ("scheduler_address",)}
"""Fields a resumed run may change freely, by section: it may run longer, its folder may move,
other steps may be profiled, and the Dask cluster it joins may be another (a scheduler lost
and started again at a new address)."""


def resumable_form(config_text: str) -> Any:
    """A written pipeline as data, less what a resume may change (``RESUME_MAY_CHANGE``):
    two runs' texts with equal forms are the same job."""
    data = _load(config_text)
    for section, names in RESUME_MAY_CHANGE.items():
        fields = data.get(section) if isinstance(data, dict) else None
        if isinstance(fields, dict):
            for name in names:
                fields.pop(name, None)
            if not fields:  # a section of only those is the same as none
                data.pop(section)
    return data


def field_changes(before: str, now: str) -> list[str] | None:
    """What differs between two written pipelines, a line per field with the defaults a file
    leaves out filled in (``data.batch_size: 4 -> 8``, where the newer file, at the default,
    no longer writes it), less what a resume may change. None where either text is not a
    valid pipeline here (a run written by another version): a text diff is all there is."""
    try:
        old, new = _everything(before), _everything(now)
        written = _load(before), _load(now)
    except (ValueError, yaml.YAMLError):  # pydantic's ValidationError is a ValueError
        return None
    lines: list[str] = []
    _compare("", (old, new), written, lines)
    return lines


def _everything(text: str) -> dict[str, Any]:
    """Every field of a written pipeline, defaults too, less ``RESUME_MAY_CHANGE``."""
    data = PipelineSpec.model_validate(_load(text)).model_dump(mode="json")
    for section, names in RESUME_MAY_CHANGE.items():
        for name in names:
            data[section].pop(name, None)
    return data


def _compare(where: str, values: tuple[Any, Any], written: tuple[Any, Any], lines: list[str]) -> None:
    """Lines for the fields that differ between ``values`` (before, now: every field); an
    entry only one side has is shown as its file ``written`` it."""
    old, new = values
    if not (isinstance(old, dict) and isinstance(new, dict)):
        if old != new:  # a section set or unset (eval: null -> {...}) is shown as written
            shown = [side if isinstance(value, dict) and side is not None else value
                     for value, side in zip(values, written)]
            lines.append(f"{where}: {_flow(shown[0])} -> {_flow(shown[1])}")
        return
    for key in dict.fromkeys([*old, *new]):
        path = f"{where}.{key}" if where else str(key)
        inside = tuple(side.get(key) if isinstance(side, dict) else None for side in written)
        if key not in old:
            lines.append(f"{path}: added {_flow(inside[1] if inside[1] is not None else new[key])}")
        elif key not in new:
            lines.append(f"{path}: removed (was {_flow(inside[0] if inside[0] is not None else old[key])})")
        else:
            _compare(path, (old[key], new[key]), (inside[0], inside[1]), lines)


def written_steps(config_text: str) -> int:
    """``trainer.steps`` of a written pipeline (which leaves out a default value)."""
    data = _load(config_text)
    trainer = data.get("trainer") if isinstance(data, dict) else None
    steps = trainer.get("steps") if isinstance(trainer, dict) else None
    return steps if isinstance(steps, int) else int(TrainerSpec.model_fields["steps"].default)


def _load(text: str) -> Any:
    return yaml.load(text, Loader=ValueLoader)  # noqa: S506 - a SafeLoader subclass
