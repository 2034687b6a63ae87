"""The schema of ``scenarios/*.yaml`` simulator scenarios, and their loader.

A scenario says how a simulated cluster behaves while a pipeline runs on it: how noisy
node times are, and what happens to devices at which step::

    name: throttle
    description: the H100 (gpu-3) runs at half speed from step 50
    noise: 0.05                  # lognormal sigma on every node time
    seed: 0
    move_restart_s: 0.05         # starting a role's actor on its new device
    events:
      - {step: 50, kind: throttle, device: gpu-3, speed: 0.5}
      - {step: 80, kind: lost, device: gpu-2}
      - {step: 120, kind: added, type: H100-80GB, host: node-0}

Like the pipeline and inventory loaders, every problem is reported at once as
``file:line: path: message`` (exit code 2). Whether a named device exists depends on the
inventory the scenario is run against, so that check happens when the simulation starts;
``ScenarioDocument.issue`` gives it the same ``file:line`` form.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, Field, ValidationError


from flowrl.errors import SpecError, SpecIssue
from flowrl.spec.lines import LineMap, line_of, read_yaml_file
from flowrl.spec.messages import did_you_mean, issues_from_validation, show
from flowrl.spec.strict import StrictModel


class ThrottleEvent(StrictModel):
    """A device runs slower (or faster) from ``step`` on: thermal or power throttling,
    a noisy neighbour."""

    kind: Literal["throttle"]
    step: int = Field(ge=1)
    """First step (1-based) that runs at the new speed. Required."""
    device: str = Field(min_length=1)
    """Device id in the inventory (``gpu-3``, ``cpu-0``). Required."""
    speed: float = Field(gt=0)
    """Speed relative to the device's nominal one: 0.5 = every node there takes twice as
    long. Required."""


class LostEvent(StrictModel):
    """A device disappears (its worker dies) before ``step`` runs."""

    kind: Literal["lost"]
    step: int = Field(ge=1)
    """First step (1-based) without the device. Required."""
    device: str = Field(min_length=1)
    """Device id in the inventory. Required."""


class AddedEvent(StrictModel):
    """A new GPU joins the cluster before ``step`` runs."""

    kind: Literal["added"]
    step: int = Field(ge=1)
    """First step (1-based) the device is there. Required."""
    type: str = Field(min_length=1)
    """GPU type from the GPU table (``H100-80GB``). Required."""
    host: str | None = None
    """Host it joins; None = the inventory's first host. Default None."""


ScenarioEvent = Annotated[
    Union[ThrottleEvent, LostEvent, AddedEvent], Field(discriminator="kind")
]
EVENT_CLASSES: dict[str, type[BaseModel]] = {
    "throttle": ThrottleEvent,
    "lost": LostEvent,
    "added": AddedEvent,
}
"""Event kind -> its schema class."""


class ScenarioFileSpec(StrictModel):
    """A whole scenario file."""

    name: str = Field(min_length=1)
    """Name of the scenario, shown in the simulator's output. Required."""
    description: str = ""
    """One line saying what happens. Default empty."""
    noise: float = Field(default=0.05, ge=0, le=2)
    """Lognormal sigma of the factor every simulated node time is multiplied by
    (0 = no noise, 0.05 = about 5 % spread). Default 0.05."""
    seed: int = 0
    """Seed of the noise; the same seed gives the same run. Default 0."""
    move_restart_s: float = Field(default=0.05, ge=0)
    """Seconds the cluster takes to start a moved role on its new device, on top of
    sending its weights (save, start the actor, load). Default 0.05."""
    events: list[ScenarioEvent] = []
    """Device events in any order; several may share a step. Default [] (noise only)."""


@dataclass(frozen=True)
class ScenarioDocument:
    """A validated scenario and where each of its keys sits in the file."""

    spec: ScenarioFileSpec
    source: str
    """File name as given (or ``<name>`` for a scenario built in code)."""
    line_map: LineMap = field(default_factory=dict)

    def issue(self, path: str, message: str) -> SpecIssue:
        """A ``file:line: path: message`` issue about ``path`` (``events.0.device``)."""
        return SpecIssue(path, message, self.source, line_of(path, self.line_map))


class ScenarioFileError(SpecError):
    """A scenario file with one or more problems; all of them are listed."""

    subject = "the scenario"


def load_scenario_file(path: str | Path) -> ScenarioDocument:
    """Read and validate a scenario file; raise ``ScenarioFileError`` listing every issue."""
    source = str(path)
    data, line_map, duplicates = read_yaml_file(path, "scenario", ScenarioFileError)
    return scenario_from_dict(data, source, line_map, duplicates)


def scenario_from_dict(
    data: Any,
    source: str = "<scenario>",
    line_map: LineMap | None = None,
    early: list[SpecIssue] | None = None,
) -> ScenarioDocument:
    """Validate plain data into a ``ScenarioDocument`` (lines when a map is given)."""
    lines = line_map or {}
    issues = list(early or [])
    if not isinstance(data, dict):
        found = "the file is empty" if data is None else f"found {show(data)}"
        message = f"expected a mapping with name, noise, seed and events; {found}"
        raise ScenarioFileError([*issues, SpecIssue("", message, source, 1)])
    try:
        spec = ScenarioFileSpec.model_validate(data)
    except ValidationError as error:
        plain = issues_from_validation(error)
        for detail, (_, message) in zip(error.errors(), plain):
            path, message = _translate(tuple(detail["loc"]), detail, message)
            issues.append(SpecIssue(path, message, source, line_of(path, lines)))
        issues.sort(key=lambda issue: issue.line or 0)
        raise ScenarioFileError(issues) from None
    if issues:
        raise ScenarioFileError(issues)
    return ScenarioDocument(spec, source, lines)


def _translate(loc: tuple[Any, ...], detail: Any, message: str) -> tuple[str, str]:
    """The path without pydantic's union tag, and messages that name scenario fields."""
    parts = [str(part) for part in loc]
    if len(parts) >= 3 and parts[0] == "events" and parts[2] in EVENT_CLASSES:
        del parts[2]  # pydantic puts the event kind of the discriminated union here
    path = ".".join(parts)
    kind = detail["type"]
    if kind == "extra_forbidden":
        return path, _unknown_field(loc)
    if kind == "union_tag_invalid":
        value = detail.get("input")
        found = value.get("kind") if isinstance(value, dict) else None
        hint = did_you_mean(found, EVENT_CLASSES) if isinstance(found, str) else ""
        return f"{path}.kind", (
            f"unknown event kind {show(found)}{hint}; known kinds: {', '.join(EVENT_CLASSES)}"
        )
    if kind == "union_tag_not_found":
        return f"{path}.kind", f"an event needs a kind; known kinds: {', '.join(EVENT_CLASSES)}"
    return path, message


def _unknown_field(loc: tuple[Any, ...]) -> str:
    name = str(loc[-1])
    owner: type[BaseModel] | None = ScenarioFileSpec if len(loc) == 1 else None
    if len(loc) == 4 and loc[0] == "events":
        owner = EVENT_CLASSES.get(str(loc[2]))
    allowed = list(owner.model_fields) if owner is not None else []
    hint = did_you_mean(name, allowed)
    return f"unknown field '{name}'{hint or '; allowed: ' + ', '.join(allowed)}"
