"""Scenarios: a validated scenario file, checked against the inventory it runs on.

``--scenario NAME`` finds ``NAME.yaml`` in ``./scenarios`` or in the scenarios shipped at
the root of the flowrl repository; anything with a ``/`` or ending in ``.yaml`` is a path.
Device ids are checked step by step: a device may be throttled or lost only while it is
there (an added one from its step on), and an added GPU gets the next free ``gpu-<n>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from flowrl.devices.gpu_types import GPU_TYPES
from flowrl.devices.inventory import Device, Inventory
from flowrl.errors import FlowrlError, SpecIssue
from flowrl.spec.messages import did_you_mean
from flowrl.spec.scenario_file import (
    AddedEvent,
    LostEvent,
    ScenarioDocument,
    ScenarioFileError,
    ThrottleEvent,
    load_scenario_file,
)

SHIPPED_DIR = Path(__file__).resolve().parents[2] / "scenarios"
"""``scenarios/`` at the root of the flowrl repository."""


@dataclass(frozen=True)
class ClusterEvent:
    """One scenario event with its device resolved."""

    step: int
    kind: Literal["throttle", "lost", "added"]
    device: Device
    speed: float = 1.0
    """New speed share of the device (throttle events)."""

    @property
    def text(self) -> str:
        if self.kind == "throttle":
            return f"{self.device.id} at {self.speed:.0%} speed"
        if self.kind == "lost":
            return f"{self.device.id} lost"
        return f"{self.device.id} added ({self.device.name})"


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    noise: float
    """Lognormal sigma of node times."""
    seed: int
    move_restart_s: float
    """What restarting a moved role really costs on the simulated cluster, in seconds."""
    events: tuple[ClusterEvent, ...]
    source: str

    def events_at(self, step: int) -> list[ClusterEvent]:
        return [event for event in self.events if event.step == step]

    def summary(self) -> str:
        """``gpu-3 at 50% speed from step 50``, or ``noise only``."""
        if not self.events:
            return "noise only"
        return "; ".join(f"{event.text} from step {event.step}" for event in self.events)


def find_scenario(name: str, search_dirs: tuple[Path, ...] | None = None) -> Path:
    """The file ``--scenario NAME`` means; ``FlowrlError`` naming the known ones if none."""
    if "/" in name or name.endswith((".yaml", ".yml")):
        return Path(name)
    dirs = search_dirs if search_dirs is not None else (Path("scenarios"), SHIPPED_DIR)
    for directory in dirs:
        candidate = directory / f"{name}.yaml"
        if candidate.is_file():
            return candidate
    known = sorted({p.stem for d in dirs if d.is_dir() for p in d.glob("*.yaml")})
    hint = did_you_mean(name, known)
    listing = ", ".join(known) if known else "none found"
    raise FlowrlError(
        f"--scenario {name}: no scenario of that name{hint}; known scenarios: {listing} "
        "(or give the path of a scenario file)"
    )


def load_scenario(name: str, inventory: Inventory) -> Scenario:
    return resolve_scenario(load_scenario_file(find_scenario(name)), inventory)


def resolve_scenario(document: ScenarioDocument, inventory: Inventory) -> Scenario:
    """Check device ids and GPU types against ``inventory``; ``ScenarioFileError`` if wrong."""
    spec = document.spec
    issues: list[SpecIssue] = []
    present = {device.id: device for device in inventory.devices}
    hosts = [host.name for host in inventory.hosts]
    num_gpus = len(inventory.gpus())
    order = sorted(range(len(spec.events)), key=lambda i: (spec.events[i].step, i))
    resolved: dict[int, ClusterEvent] = {}
    for index in order:
        event = spec.events[index]
        path = f"events.{index}"
        if isinstance(event, AddedEvent):
            row = GPU_TYPES.get(event.type)
            host = event.host or (hosts[0] if hosts else "node-0")
            if row is None:
                hint = did_you_mean(event.type, GPU_TYPES)
                issues.append(document.issue(f"{path}.type", f"unknown GPU type '{event.type}'"
                                             f"{hint}; known: {', '.join(GPU_TYPES)}"))
                continue
            if event.host is not None and event.host not in hosts:
                hint = did_you_mean(event.host, hosts)
                issues.append(document.issue(f"{path}.host", f"no host '{event.host}' in "
                                             f"{inventory.source}{hint}; hosts: {', '.join(hosts)}"))
                continue
            device = Device(
                id=f"gpu-{num_gpus}", host=host,
                index=sum(1 for d in present.values() if d.kind == "gpu" and d.host == host),
                kind="gpu", name=row.name, arch=row.arch, memory_gb=row.memory_gb,
                family=row.family, tflops_bf16=row.tflops_bf16, bandwidth_gbs=row.bandwidth_gbs,
                l2_cache_mib=row.l2_cache_mib,
            )
            num_gpus += 1
            present[device.id] = device
            resolved[index] = ClusterEvent(event.step, "added", device)
            continue
        assert isinstance(event, (ThrottleEvent, LostEvent))
        found = present.get(event.device)
        if found is None:
            hint = did_you_mean(event.device, present)
            issues.append(document.issue(
                f"{path}.device",
                f"no device '{event.device}' in {inventory.source} at step {event.step}{hint}; "
                f"devices then: {', '.join(present)}",
            ))
            continue
        if isinstance(event, LostEvent):
            del present[event.device]
            resolved[index] = ClusterEvent(event.step, "lost", found)
        else:
            resolved[index] = ClusterEvent(event.step, "throttle", found, event.speed)
    if issues:
        issues.sort(key=lambda issue: issue.line or 0)
        raise ScenarioFileError(issues)
    return Scenario(spec.name, spec.description, spec.noise, spec.seed, spec.move_restart_s,
                    tuple(resolved[i] for i in order), document.source)
