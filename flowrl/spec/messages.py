"""Turn pydantic validation errors into plain ``(dotted path, message)`` pairs.

pydantic's own wording ("Input should be a valid integer") names neither the allowed range
nor the nearest valid name; these messages say what was expected, what was found and,
for a near-miss name, what was probably meant.
"""

from __future__ import annotations

import difflib
import re
import typing
from collections.abc import Iterable, Sequence
from typing import Any, get_args

import annotated_types
from pydantic import BaseModel, ValidationError

from flowrl.spec.schema import NODE_CLASSES, ROLES, SECTION_CLASSES, PipelineSpec

Issue = tuple[str, str]
"""(dotted path, message)."""


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest known name, or an empty string."""
    matches = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    if not matches:
        lowered = {item.lower(): item for item in known}
        if name.lower() in lowered:
            matches = [lowered[name.lower()]]
    return f" (did you mean '{matches[0]}'?)" if matches else ""


def show(value: Any) -> str:
    """A value the way the user wrote it in YAML."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"'{value}'"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if type(value) in (int, float):
        return str(value)
    # from Python, not a file: a tuple, a Path, a numpy number... named by its type
    library = type(value).__module__.split(".")[0]
    kind = f"a {library if library not in ('builtins', 'pathlib') else 'Python'} {type(value).__name__}"
    text = str(value)
    # a table or an array prints over many lines: its type says enough
    return kind if "\n" in text or len(text) > SHOWN_CHARS else f"{text} ({kind})"


SHOWN_CHARS = 80
"""The longest printed value a message shows; a longer one is named by its type alone."""


def issues_from_validation(error: ValidationError, within: Sequence[str] = ()) -> list[Issue]:
    """One ``(path, message)`` per pydantic error, in pydantic's (field) order; ``within``:
    the section the validated model is (``("trainer",)``) when it is not the whole pipeline."""
    return [_issue((*within, *detail["loc"]), detail) for detail in error.errors()]


def _path(loc: Sequence[Any]) -> str:
    parts = [str(part) for part in loc if part != "[key]"]
    if len(parts) >= 3 and parts[0] == "nodes":
        del parts[2]  # pydantic puts the role tag of the discriminated union here
    return ".".join(parts)


def _owner(loc: Sequence[Any]) -> tuple[type[BaseModel] | None, str | None]:
    """The schema class that holds the field an error is about, and the field's name (a
    section inside an entry, such as ``models.actor.lora``, is followed down)."""
    section = loc[0] if loc else None
    if len(loc) == 1:
        return PipelineSpec, str(section)
    if section in ("models", "devices"):
        return _nested(SECTION_CLASSES[section], loc[2:]) if len(loc) >= 3 else (None, None)
    if section == "nodes":
        if len(loc) >= 4 and loc[2] in NODE_CLASSES:
            return _nested(NODE_CLASSES[loc[2]], loc[3:])
        return None, None
    if section in SECTION_CLASSES and len(loc) >= 2:
        return _nested(SECTION_CLASSES[str(section)], loc[1:])
    return None, None


def _nested(owner: type[BaseModel], rest: Sequence[Any]) -> tuple[type[BaseModel], str]:
    """``rest[0]`` of ``owner``, or, where that field is itself a section (a schema class,
    optional or not) and ``rest`` goes on into one of its fields, that field of it."""
    field = str(rest[0])
    while len(rest) >= 2 and field in owner.model_fields:
        inner = [kind for kind in (owner.model_fields[field].annotation, *get_args(owner.model_fields[field].annotation))
                 if isinstance(kind, type) and issubclass(kind, BaseModel)]
        if not inner:
            break
        owner, rest, field = inner[0], rest[1:], str(rest[1])
    return owner, field


def _issue(loc: Sequence[Any], detail: Any) -> Issue:
    kind: str = detail["type"]
    value = detail.get("input")
    ctx = detail.get("ctx") or {}
    path = _path(loc)
    found = f"found {show(value)}"
    if "[key]" in loc or kind == "invalid_key":
        return path, f"names must be strings, {found}"
    if kind == "missing":
        if isinstance(loc[-1], int):
            return path, f"item {loc[-1]} is missing"
        what = "section" if len(loc) == 1 and loc[0] != "name" else "field"
        return path, f"required {what} '{loc[-1]}' is missing"
    if kind == "extra_forbidden":
        return path, _unknown_field(loc)
    if kind == "union_tag_invalid":
        role = value.get("role") if isinstance(value, dict) else ctx.get("tag")
        hint = did_you_mean(role, ROLES) if isinstance(role, str) else ""
        return f"{path}.role", f"unknown role {show(role)}{hint}; known roles: {', '.join(ROLES)}"
    if kind == "union_tag_not_found":
        return f"{path}.role", f"a node needs a role; known roles: {', '.join(ROLES)}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return path, f"expected a mapping of fields, {found}"
    if kind == "literal_error":
        allowed = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        hint = did_you_mean(str(value), allowed) if isinstance(value, str) else ""
        return path, f"expected one of {', '.join(allowed)}, {found}{hint}"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return path, f"out of range: allowed {_bounds(loc, ctx)}, {found}"
    simple = {
        "int_type": "an integer",
        "int_parsing": "an integer",
        "int_from_float": "a whole number",
        "float_type": "a number",
        "float_parsing": "a number",
        "bool_type": "true or false",
        "bool_parsing": "true or false",
        "string_type": "a string",
        "list_type": "a list",
        "tuple_type": "a list",
    }
    if kind in simple:
        # YAML 1.1 reads yes/no/on/off as booleans: the file may not say "true" at all
        hint = " (a boolean; YAML reads yes, no, on and off as booleans too)" if isinstance(value, bool) else ""
        device = re.fullmatch(r"(gpu|cpu)-(\d+)", value.strip()) if isinstance(value, str) else None
        if device is not None and "device_ids" in path:  # the id the commands print for a device
            hint = f" (device_ids takes device numbers: write {device.group(2)} for {value.strip()})"
        return path, f"expected {simple[kind]}, {found}{hint}"
    if kind == "string_pattern_mismatch":
        return path, f"expected a size such as 500MB, 5GB or 2GiB, {found}"
    if kind == "string_too_short":
        return path, "must not be empty"
    if kind in ("too_short", "too_long"):
        return path, f"wrong number of items: {ctx.get('actual_length')} given"
    if kind == "value_error":
        return path, str(detail["msg"]).removeprefix("Value error, ")
    message = str(detail["msg"])
    return path, f"{message[:1].lower()}{message[1:]}, {found}"


def _unknown_field(loc: Sequence[Any]) -> str:
    name = str(loc[-1])
    if len(loc) == 1:
        allowed = list(PipelineSpec.model_fields)
        hint = did_you_mean(name, allowed)
        return f"unknown section '{name}'{hint}" + (
            "" if hint else f"; sections: {', '.join(allowed)}"
        )
    owner, _ = _owner(loc)
    role = str(loc[2]) if loc[0] == "nodes" and len(loc) >= 3 else None
    return unknown_field(name, owner, role)


def unknown_field(name: str, owner: type[BaseModel] | None, role: str | None = None) -> str:
    """What is wrong with field ``name`` of a section or node of class ``owner`` (a node of
    ``role``): the nearest field it may have meant, else the fields allowed there."""
    allowed = [field for field in owner.model_fields] if owner is not None else []
    hint = did_you_mean(name, allowed)
    if hint:
        return f"unknown field '{name}'{hint}"
    message = f"unknown field '{name}'; allowed: {', '.join(allowed)}"
    if role is not None:
        elsewhere = [other for other, cls in NODE_CLASSES.items() if name in cls.model_fields]
        if elsewhere:
            message += f" ('{name}' belongs to {' / '.join(elsewhere)} nodes, not {role})"
    return message


_BOUND_ATTRIBUTE = {
    annotated_types.Gt: "gt",
    annotated_types.Ge: "ge",
    annotated_types.Lt: "lt",
    annotated_types.Le: "le",
}


def _bounds(loc: Sequence[Any], ctx: dict[str, Any]) -> str:
    """``0 < top_p <= 1`` from the field's declared constraints (or the failed one)."""
    owner, field = _owner(loc)
    found: dict[str, Any] = {}
    if owner is not None and field in owner.model_fields:
        info = owner.model_fields[field]
        for item in _constraints([*info.metadata, info.annotation]):
            attribute = _BOUND_ATTRIBUTE[type(item)]
            found[attribute] = getattr(item, attribute)
    if not found:
        found = {key: ctx[key] for key in ("gt", "ge", "lt", "le") if key in ctx}
    name = field or _path(loc).rsplit(".", 1)[-1]
    lower = next(
        ((found[key], op) for key, op in (("gt", ">"), ("ge", ">=")) if key in found), None
    )
    upper = next(
        ((found[key], op) for key, op in (("lt", "<"), ("le", "<=")) if key in found), None
    )
    if lower and upper:
        flipped = "<" if lower[1] == ">" else "<="
        return f"{lower[0]} {flipped} {name} {upper[1]} {upper[0]}"
    if lower:
        return f"{name} {lower[1]} {lower[0]}"
    if upper:
        return f"{name} {upper[1]} {upper[0]}"
    return name


def _constraints(items: Iterable[Any]) -> list[Any]:
    """Every Gt/Ge/Lt/Le constraint found in field metadata or nested Annotated types."""
    found: list[Any] = []
    for item in items:
        if isinstance(item, tuple(_BOUND_ATTRIBUTE)):
            found.append(item)
        elif hasattr(item, "metadata") and isinstance(item.metadata, list):
            found.extend(_constraints(item.metadata))
        elif typing.get_origin(item) is not None:
            found.extend(_constraints(typing.get_args(item)))
    return found
