"""Scheduler policies: when to re-plan and whether a move pays. Events in, decisions out.

A policy never touches a cluster. Whoever runs the pipeline (the Dask runtime or the
simulator) feeds it, between two steps::

    observe(step, node timings, device samples)   measured step -> device speeds, triggers
    decide(step, device events)  -> [Decision]    before the next step; accepted ones
                                                  carry the new plan to carry out

``StaticPolicy`` plans once and never changes its mind (a lost device then fails every
step that needs it). ``DynamicPolicy`` re-plans when something triggers it:

- every ``every_steps`` steps;
- a device measured ``slow_ratio`` times slower than predicted, or one that reports
  throttling; a device under ``low_util`` for ``low_util_window_s`` seconds; a device
  above ``high_memory`` of its memory (each once when it starts, not every step);
- a device added (re-match around it) or lost (forced: re-plan onto the others).

A re-plan searches the current device match and the matches one substitution or swap
away around the suspect devices, each with the planner and the measured device speeds
(``DeviceCalibration``). With ``H`` the steps to the next regular re-plan, it keeps the
candidate with the least ``after_s * H + move_s * (1 + min_gain)`` and accepts it when
that beats ``before_s * H``: the predicted gain over the next interval must exceed the
moves' cost by ``min_gain``. That margin is the hysteresis: measurements that wobble
around a break-even point do not move work back and forth. A forced re-plan is accepted
whatever it costs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from flowrl.devices.groups import pipeline_groups
from flowrl.devices.inventory import Device, Inventory
from flowrl.devices.matching import Match, match_groups
from flowrl.errors import PlacementError
from flowrl.graph import PipelineGraph
from flowrl.planner.compiled import CompiledPlan, compile_plan
from flowrl.planner.costs import CostSource, EstimatedCosts
from flowrl.planner.search import evaluate
from flowrl.planner.sharing import core_shares, host_cores
from flowrl.planner.simulate import node_call_memory_gb
from flowrl.records import DeviceSample, NodeTiming
from flowrl.scheduler.calibration import DeviceCalibration, contention_of, contention_slowdown
from flowrl.scheduler.candidates import neighbour_matches, repair_matches
from flowrl.scheduler.events import (
    Decision,
    DeviceAdded,
    DeviceEvent,
    DeviceLost,
    DeviceReplaced,
    DeviceThrottled,
    Move,
)
from flowrl.scheduler.moves import plan_moves
from flowrl.scheduler.replan import placement_of, prune_moves
from flowrl.planner.search import MEMORY_RESERVE
from flowrl.spec.schema import SchedulerSettings, SchedulerSpec

RECORD_GAIN = 0.01
"""A re-plan that is not accepted is recorded when it would have gained this share per step."""


class PolicySettings(SchedulerSettings):
    """How eagerly the dynamic policy re-plans, and what a move must gain: the pipeline's
    ``scheduler:`` section (``SchedulerSettings``, whose fields say what each does) plus what the
    run measures or the simulator sets."""

    restart_s: float = 0.05
    """Predicted seconds to restart a moved role on its new device, beyond sending its
    weights; replaced by measured move times when there are some. Default 0.05."""
    slow_ratio: float = 1.25
    """A device whose measured node times exceed the predicted ones by this ratio is slow
    (a trigger); it counts as recovered below half that excess. Default 1.25."""
    alpha: float = 0.3
    """Weight of the newest step in the measured device speeds (EWMA). Default 0.3."""
    horizon_steps: int | None = None
    """Steps a move's predicted gain is counted over; None = ``every_steps`` (the next
    interval). Longer horizons accept moves that pay back later. Default None."""
    calibration_steps: int = 0
    """Measured steps (after a warm-up step) that learn how far the cost model is off per
    node, before device speeds are judged (``DeviceCalibration``). Real runs need it; the
    simulator, whose node times are the cost model's, does not. Default 0."""


def settings_from_spec(
    spec: SchedulerSpec, restart_s: float | None = None, calibration_steps: int = 0
) -> PolicySettings:
    """Settings from a pipeline's ``scheduler:`` section."""
    settings = PolicySettings.model_validate({**spec.model_dump(), "calibration_steps": calibration_steps})
    return settings if restart_s is None else settings.model_copy(update={"restart_s": restart_s})


class SchedulerPolicy(Protocol):
    """What a runner needs from a policy."""

    name: str

    @property
    def plan(self) -> CompiledPlan: ...

    def observe(self, step: int, timings: Sequence[NodeTiming],
                devices: Sequence[DeviceSample], step_s: float) -> None: ...

    def decide(self, step: int, events: Sequence[DeviceEvent]) -> list[Decision]: ...

    def observe_move(self, predicted_s: float, measured_s: float) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def initial_plan(
    pipeline: PipelineGraph, inventory: Inventory, costs: CostSource
) -> tuple[Match, CompiledPlan]:
    match = match_groups(pipeline_groups(pipeline.spec), inventory)
    return match, compile_plan(pipeline, inventory, match=match, costs=costs)


class StaticPolicy:
    """Plan once, before the first step; never re-plan."""

    name = "static"

    def __init__(self, pipeline: PipelineGraph, inventory: Inventory,
                 costs: CostSource | None = None, base_dir: Path | None = None) -> None:
        costs = costs or EstimatedCosts(pipeline, base_dir=base_dir)
        self._match, self._plan = initial_plan(pipeline, inventory, costs)

    @property
    def plan(self) -> CompiledPlan:
        return self._plan

    def observe(self, step: int, timings: Sequence[NodeTiming],
                devices: Sequence[DeviceSample], step_s: float) -> None:
        return None

    def decide(self, step: int, events: Sequence[DeviceEvent]) -> list[Decision]:
        return []

    def observe_move(self, predicted_s: float, measured_s: float) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        return None


@dataclass(frozen=True)
class _Option:
    """A candidate re-plan: ``score`` = after_s * horizon + move_s * (1 + min_gain)."""

    score: float
    index: int
    match: Match
    plan: CompiledPlan
    moves: tuple[Move, ...]
    cost_s: float


@dataclass
class _Flags:
    """Per-device conditions that trigger once when they start."""

    slow: set[str] = field(default_factory=set)
    low_util_s: dict[str, float] = field(default_factory=dict)
    low_util: set[str] = field(default_factory=set)
    high_memory: set[str] = field(default_factory=set)
    pending: list[str] = field(default_factory=list)
    """Triggers raised by ``observe`` since the last ``decide``."""
    suspects: list[str] = field(default_factory=list)


class DynamicPolicy:
    """Re-plan from measurements; move only what pays for itself (see the module docs)."""

    name = "dynamic"

    def __init__(
        self,
        pipeline: PipelineGraph,
        inventory: Inventory,
        settings: PolicySettings | None = None,
        costs: CostSource | None = None,
        base_dir: Path | None = None,
        num_steps: int | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.settings = settings or PolicySettings()
        self.inventory = inventory
        self.num_steps = num_steps
        """Steps in the run; a move near the end counts its gain only up to the end."""
        self.calibration = DeviceCalibration(
            costs or EstimatedCosts(pipeline, base_dir=base_dir),
            alpha=self.settings.alpha,
            calibration_steps=self.settings.calibration_steps,
        )
        self.groups = pipeline_groups(pipeline.spec)
        self._match, self._plan = initial_plan(pipeline, inventory, self.calibration.base)
        self._flags = _Flags()
        self._measured_on: dict[str, tuple[str, ...]] = {}
        """Node -> the devices its last observed call ran on."""
        self._restart_s = self.settings.restart_s

    @property
    def plan(self) -> CompiledPlan:
        return self._plan

    # ---- measurements in -------------------------------------------------------------

    def observe(self, step: int, timings: Sequence[NodeTiming],
                devices: Sequence[DeviceSample], step_s: float) -> None:
        by_id = {device.id: device for device in self.inventory.devices}
        node_devices = {
            item.node: [by_id[d] for d in item.devices if d in by_id] for item in self._plan.nodes
        }
        offloaded = {item.node: item.offloaded for item in self._plan.nodes}
        # A node's first call on devices it moved to warms up there (its model's first shapes,
        # compiles, caches): 0.77 s against 25 ms after. Taken as speed, it made the devices
        # a move had just chosen look slow, and the next re-plan moved the node back.
        placed = {item.node: tuple(item.devices) for item in self._plan.nodes}
        warming = {node for node, devices in placed.items()
                   if node in self._measured_on and self._measured_on[node] != devices}
        self._measured_on = placed
        self.calibration.observe_step([timing for timing in timings if timing.node not in warming], node_devices,
                                      offloaded, core_shares(self.pipeline, node_devices, host_cores(self.inventory)),
                                      contention_of(self.pipeline, devices))
        planned = {d for item in self._plan.nodes for d in item.devices}
        if any(timing.peak_memory_gb > 0 for timing in timings) and planned <= set(by_id):
            predicted = node_call_memory_gb(self.pipeline, placement_of(self._plan), self.inventory,
                                            self.calibration.base)
            self.calibration.observe_memory(timings, predicted)
        flags, settings = self._flags, self.settings
        recovered = 1 + (settings.slow_ratio - 1) / 2
        for device_id, ratio in sorted(self.calibration.ratios.items()):
            if ratio >= settings.slow_ratio and device_id not in flags.slow:
                flags.slow.add(device_id)
                self._raise(f"{device_id} slow ({1 / ratio:.0%} of predicted speed)", device_id)
            elif ratio < recovered and device_id in flags.slow:
                flags.slow.discard(device_id)
        used = {d for item in self._plan.nodes for d in item.devices}
        for sample in devices:
            if sample.device not in used:
                if sample.external_load is not None:
                    self.calibration.observe_idle(sample.device,
                                                  contention_slowdown(sample.utilization, sample.external_load))
                continue
            if sample.utilization < settings.low_util:
                total = flags.low_util_s.get(sample.device, 0.0) + step_s
                flags.low_util_s[sample.device] = total
                if total >= settings.low_util_window_s and sample.device not in flags.low_util:
                    flags.low_util.add(sample.device)
                    self._raise(f"{sample.device} under-used ({sample.utilization:.0%})", sample.device)
            else:
                flags.low_util_s.pop(sample.device, None)
                flags.low_util.discard(sample.device)
            share = sample.memory_gb / sample.memory_total_gb if sample.memory_total_gb else 0.0
            if share > settings.high_memory and sample.device not in flags.high_memory:
                flags.high_memory.add(sample.device)
                self._raise(f"{sample.device} memory at {share:.0%}", sample.device)
            elif share <= settings.high_memory:
                flags.high_memory.discard(sample.device)

    def observe_move(self, predicted_s: float, measured_s: float) -> None:
        """A carried-out re-plan's measured cost corrects the restart estimate."""
        if predicted_s > 0:
            self._restart_s *= measured_s / predicted_s

    def state_dict(self) -> dict[str, Any]:
        """What the policy learned (device calibration, the measured move cost), for a
        checkpoint: a resumed run judges devices as the interrupted one did. With it, the
        machine each device was on, so that a resumed run whose device of the same name is
        elsewhere does not take its speed."""
        return {"calibration": self.calibration.state_dict(), "restart_s": self._restart_s,
                "machines": {device.id: self._machine(device) for device in self.inventory.devices}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.calibration.load_state_dict(state.get("calibration", {}))
        if isinstance(state.get("restart_s"), (int, float)):
            self._restart_s = float(state["restart_s"])
        machines = state.get("machines")
        if isinstance(machines, dict):  # absent in checkpoints written before it was kept
            for device in self.inventory.devices:
                if device.id in machines and list(machines[device.id]) != self._machine(device):
                    self.calibration.forget(device.id)

    def _machine(self, device: Device) -> list[Any]:
        """[host, cores, card uuid] of ``device`` (JSON-ready)."""
        return [device.host, host_cores(self.inventory).get(device.host), device.uuid]

    def _raise(self, trigger: str, device_id: str) -> None:
        self._flags.pending.append(trigger)
        if device_id not in self._flags.suspects:
            self._flags.suspects.append(device_id)

    # ---- decisions out ---------------------------------------------------------------

    def decide(self, step: int, events: Sequence[DeviceEvent]) -> list[Decision]:
        flags = self._flags
        triggers, lost, added = list(flags.pending), [], []
        events = [event for event in events if not (isinstance(event, DeviceReplaced) and self._nothing_new(event))]
        for event in events:
            if isinstance(event, DeviceLost):
                lost.append(event.device)
                triggers.append(f"{event.device} lost")
            elif isinstance(event, DeviceAdded):
                added.append(event.device.id)
                triggers.append(f"{event.device.id} added ({event.device.name})")
            elif isinstance(event, DeviceThrottled):
                triggers.append(f"{event.device} reports throttling")
            elif isinstance(event, DeviceReplaced):
                added.append(event.device.id)
                triggers.append(f"{event.device.id} now on {event.host.name}")
        self._apply_inventory(events)
        every = self.settings.every_steps
        if step > 1 and (step - 1) % every == 0:
            triggers.append(f"every {every} steps")
        suspects = [*flags.suspects, *added, *sorted(flags.slow)]
        flags.pending, flags.suspects = [], []
        if not triggers:
            return []
        decision = self._replan(step, tuple(triggers), list(dict.fromkeys(suspects)), lost, added)
        if decision is None:
            return []
        if decision.accepted and decision.plan is not None:
            self._plan = decision.plan
        return [decision]

    def _nothing_new(self, event: DeviceReplaced) -> bool:
        """Whether a replaced device tells the policy nothing: a device it no longer has (lost
        since), or the same card or slot on the same machine (host name and cores) as its old
        worker's."""
        known = self.inventory.by_id(event.device.id)
        return known is None or self._machine(known) == [event.device.host, event.host.cores, event.device.uuid]

    def _apply_inventory(self, events: Sequence[DeviceEvent]) -> None:
        devices = list(self.inventory.devices)
        hosts = list(self.inventory.hosts)
        for event in events:
            if isinstance(event, DeviceLost):
                devices = [d for d in devices if d.id != event.device]
                self._forget(event.device)
            elif isinstance(event, DeviceAdded) and all(d.id != event.device.id for d in devices):
                devices.append(event.device)
            elif isinstance(event, DeviceReplaced):
                # another machine: what was learned of the device's speed no longer holds
                devices = [event.device if d.id == event.device.id else d for d in devices]
                hosts = [h for h in hosts if h.name != event.host.name] + [event.host]
                self._forget(event.device.id)
        if events:  # links change only when devices do
            devices = _linked_both_ways(devices)
        order = {"gpu": 0, "cpu": 1}
        devices.sort(key=lambda d: (order[d.kind], d.number))
        self.inventory = replace(self.inventory, devices=tuple(devices), hosts=tuple(hosts))

    def _forget(self, device_id: str) -> None:
        """Drop what was learned of a device that is gone or now another machine's: its
        calibration and the conditions marked on it (a device of the same id that comes back
        starts clean, and is not re-planned around an old slowdown)."""
        self.calibration.forget(device_id)
        flags = self._flags
        for marked in (flags.slow, flags.low_util, flags.high_memory):
            marked.discard(device_id)
        flags.low_util_s.pop(device_id, None)
        flags.suspects = [d for d in flags.suspects if d != device_id]

    def _replan(self, step: int, triggers: tuple[str, ...], suspects: list[str],
                lost: list[str], added: list[str]) -> Decision | None:
        settings = self.settings
        horizon = settings.horizon_steps or settings.every_steps
        if self.num_steps is not None:
            horizon = max(1, min(horizon, self.num_steps - step + 1))
        before = self._current_s()
        forced = before == float("inf")
        if forced:
            matches: list[Match] = []
            for device_id in lost or self._missing():
                base = matches[0] if matches else self._match
                matches = repair_matches(base, self.groups, self.inventory, device_id)
        else:
            matches = neighbour_matches(self._match, self.groups, self.inventory, suspects)
        speeds = {d: 1 / self.calibration.ratio(d) for d in self._flags.slow}
        best: _Option | None = None
        for index, match in enumerate(matches):
            try:
                plan = compile_plan(self.pipeline, self.inventory, match=match,
                                    costs=self.calibration, step=step)
            except PlacementError:
                continue
            moves = self._moves(plan, speeds, lost, added)
            pruned = prune_moves(self.pipeline, self._plan, plan, moves, self.inventory,
                                 self.calibration, horizon, settings.min_gain, MEMORY_RESERVE)
            variants = [(plan, moves)]
            if pruned is not plan:  # both: undoing moves one by one can miss a pair that pays
                variants.append((pruned, self._moves(pruned, speeds, lost, added)))
            for variant, variant_moves in variants:
                if not variant_moves:
                    continue
                if not forced and len(variant_moves) > settings.max_moves_per_replan:
                    continue
                cost = sum(move.cost_s for move in variant_moves)
                option = _Option(variant.iteration_s * horizon + cost * (1 + settings.min_gain),
                                 index, match, variant, tuple(variant_moves), cost)
                if best is None or (option.score, option.index) < (best.score, best.index):
                    best = option
        if best is None:
            if not forced:
                return None
            return Decision(step, triggers, False, True, (), before, float("inf"), 0.0, horizon,
                            "no placement fits on the remaining devices; steps fail until one does")
        accepted = forced or best.score < before * horizon
        gain_s = (before - best.plan.iteration_s) * horizon
        if not accepted and gain_s < RECORD_GAIN * before * horizon:
            return None  # nothing clearly better exists: not worth a record
        factor = f"{1 + settings.min_gain:g}"
        if forced:
            reason = "forced: the current plan uses a lost device"
        elif accepted:
            reason = (f"gain {gain_s * 1e3:.1f} ms over {horizon} steps beats move cost "
                      f"{best.cost_s * 1e3:.1f} ms x {factor}")
        else:
            weighed = ", ".join(f"{move.subject} {move.route}" for move in best.moves)
            reason = (f"kept: moving {weighed} would gain {gain_s * 1e3:.1f} ms over {horizon} steps, which does "
                      f"not beat move cost {best.cost_s * 1e3:.1f} ms x {factor}")
        if accepted:
            self._match = best.match
        return Decision(step, triggers, accepted, forced, best.moves, before,
                        best.plan.iteration_s, best.cost_s, horizon, reason,
                        best.plan if accepted else None)

    def _moves(self, plan: CompiledPlan, speeds: Mapping[str, float], lost: list[str],
               added: list[str]) -> list[Move]:
        return plan_moves(self._plan, plan, self.inventory, self.calibration.base,
                          self._restart_s, speeds, lost, added)

    def _current_s(self) -> float:
        """The current plan's predicted step time now; infinite when it lost a device."""
        if self._missing():
            return float("inf")
        result = evaluate(self.pipeline, placement_of(self._plan), self.inventory,
                          self.calibration, MEMORY_RESERVE)
        return result.schedule.iteration_s

    def _missing(self) -> list[str]:
        present = {device.id for device in self.inventory.devices}
        used = [d for item in self._plan.nodes for d in item.devices]
        return sorted({d for d in used if d not in present})


def make_policy(
    name: str,
    pipeline: PipelineGraph,
    inventory: Inventory,
    settings: PolicySettings | None = None,
    costs: CostSource | None = None,
    base_dir: Path | None = None,
    num_steps: int | None = None,
) -> StaticPolicy | DynamicPolicy:
    """``static`` or ``dynamic`` by name."""
    if name == "static":
        return StaticPolicy(pipeline, inventory, costs, base_dir)
    if name == "dynamic":
        return DynamicPolicy(pipeline, inventory, settings, costs, base_dir, num_steps)
    raise ValueError(f"unknown policy {name!r}")


__all__ = [
    "DynamicPolicy",
    "PolicySettings",
    "SchedulerPolicy",
    "StaticPolicy",
    "initial_plan",
    "make_policy",
    "settings_from_spec",
]


def _linked_both_ways(devices: Sequence[Device]) -> list[Device]:
    """``devices`` with each NVLink peer that is present kept only where the link still
    holds: on the same host, naming this device back. A card replaced on another machine
    leaves its old neighbours' peer lists, so the cost model no longer prices their copies as
    NVLink ones. A lost peer stays listed (no copy goes to it while it is gone), so that the
    link holds again if it comes back. Lists only lose entries here: a card that arrives on a
    host whose cards did not list it is priced over PCIe for the rest of the run (the safe
    side: copies are predicted slower, never faster, than they are)."""
    by_id = {d.id: d for d in devices}

    def holds(device: Device, peer_id: str) -> bool:
        peer = by_id.get(peer_id)
        return peer is None or (peer.host == device.host and device.id in peer.nvlink_peers)

    return [replace(d, nvlink_peers=tuple(p for p in d.nvlink_peers if holds(d, p))) if d.nvlink_peers else d
            for d in devices]
