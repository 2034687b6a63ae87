"""The planner's answer as plain data, and the one call that produces it.

    compile_plan(pipeline, inventory)  ->  CompiledPlan
        match groups -> options per node -> search (simulate each) -> explain each choice

A ``CompiledPlan`` holds only strings, numbers, lists and dicts, so ``to_dict()`` is
JSON-ready and a run can write one per re-plan (``plan-<step>.json``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from flowrl.devices.groups import pipeline_groups
from flowrl.devices.inventory import Inventory
from flowrl.devices.matching import Match, match_groups
from flowrl.graph import PipelineGraph
from flowrl.planner.cost import CpuRates
from flowrl.planner.costs import CostSource, EstimatedCosts
from flowrl.planner.search import (FEWER_CPU_SLOTS_WITHIN, Alternative, Evaluation, SearchOptions, SearchResult, evaluate,
                                   search, sharing_words)


@dataclass(frozen=True)
class NodePlan:
    node: str
    role: str
    model: str | None
    devices: list[str]
    offloaded: bool
    start_s: float
    end_s: float
    memory_gb: float
    """Memory the node needs on each of its devices: weights, state and transient."""
    reason: str

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class DevicePlan:
    device: str
    label: str
    kind: str
    capacity_gb: float
    """The device's memory in GB (10^9 bytes; the inventory's GiB converted)."""
    peak_gb: float
    """Predicted peak memory, in GB (CPU slots: this slot's share of its host)."""
    models: list[str]
    """Models that live on the device (several = colocated, time-shared)."""
    nodes: list[str]


@dataclass(frozen=True)
class TimelineEntry:
    device: str
    task: str
    kind: str
    """``node`` or ``sync`` (a weight transfer after the update)."""
    start_s: float
    end_s: float


def layout_words(shared: Mapping[str, str]) -> str:
    """How device groups share devices (group -> the group whose devices it runs on)."""
    if not shared:
        return "every device group on its own devices"
    return ", ".join(sharing_words(group, host) for group, host in sorted(shared.items()))


@dataclass(frozen=True)
class CompiledPlan:
    """Where every node runs and what that is predicted to cost; JSON-ready."""

    pipeline: str
    step: int
    iteration_s: float
    """Predicted time of one iteration, in seconds."""
    nodes: list[NodePlan]
    devices: list[DevicePlan]
    critical_path: list[str]
    timeline: list[TimelineEntry]
    colocations: dict[str, list[str]]
    """Device -> models time-sharing it (only devices holding two or more)."""
    offloaded: list[str]
    """Nodes whose model's weights are paged in from host memory for the call."""
    method: str
    num_evaluated: int
    reasons: list[str] = field(default_factory=list)
    """One line per decision."""
    shared: dict[str, str] = field(default_factory=dict)
    """Device group -> the group whose devices it runs on (groups sharing devices)."""
    alternative: Alternative | None = None
    """The fastest layout of the device groups not chosen (another way of sharing devices)."""

    @property
    def node_devices(self) -> dict[str, list[str]]:
        return {item.node: item.devices for item in self.nodes}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compile_plan(
    pipeline: PipelineGraph,
    inventory: Inventory,
    match: Match | None = None,
    costs: CostSource | None = None,
    options: SearchOptions | None = None,
    step: int = 0,
    base_dir: Path | None = None,
    cpu_rates: CpuRates | None = None,
    prompt_tokens: int | None = None,
) -> CompiledPlan:
    """Plan ``pipeline`` on ``inventory``; ``PlacementError`` when groups or memory fail."""
    options = options or SearchOptions()
    if match is None:
        match = match_groups(pipeline_groups(pipeline.spec), inventory)
    match.raise_if_unsatisfied()
    if costs is None:
        costs = EstimatedCosts(pipeline, cpu_rates, base_dir, prompt_tokens)
    result = search(pipeline, inventory, match, costs, options)
    return _compiled(pipeline, inventory, costs, result, options, step)


def _compiled(
    pipeline: PipelineGraph,
    inventory: Inventory,
    costs: CostSource,
    result: SearchResult,
    options: SearchOptions,
    step: int,
) -> CompiledPlan:
    reasons = {
        node: _reason(pipeline, inventory, costs, result, options, node) for node in pipeline.topological_order()
    }
    plan = plan_from_evaluation(
        pipeline, inventory, costs, result.best, reasons, step, result.method, result.num_evaluated
    )
    return replace(plan, shared=dict(result.shared), alternative=result.alternative)


def plan_from_evaluation(
    pipeline: PipelineGraph,
    inventory: Inventory,
    costs: CostSource,
    evaluation: Evaluation,
    reasons: dict[str, str],
    step: int,
    method: str,
    num_evaluated: int,
) -> CompiledPlan:
    """The plain-data plan of one evaluated placement, with one reason line per node."""
    schedule = evaluation.schedule
    nodes: list[NodePlan] = []
    for node in pipeline.topological_order():
        chosen = evaluation.placement[node]
        task = schedule.task(node)
        gpu = any(device.kind == "gpu" for device in inventory.devices if device.id in chosen.devices)
        memory = costs.memory(node, len(chosen.devices), gpu)
        nodes.append(
            NodePlan(
                node=node,
                role=pipeline.spec.nodes[node].role,
                model=pipeline.spec.nodes[node].model,
                devices=list(chosen.devices),
                offloaded=chosen.offloaded,
                start_s=task.start_s,
                end_s=task.end_s,
                memory_gb=memory.weights_gb + memory.state_gb + memory.transient_gb + memory.cache_gb,
                reason=reasons.get(node, ""),
            )
        )
    devices: list[DevicePlan] = []
    for device in inventory.devices:
        if device.id not in evaluation.memory_gb:
            continue
        here = [item for item in nodes if device.id in item.devices]
        models = sorted({item.model for item in here if item.model is not None and not item.offloaded})
        devices.append(
            DevicePlan(device.id, device.label, device.kind, device.capacity_gb,
                       round(evaluation.memory_gb[device.id], 6), models, [item.node for item in here])
        )
    timeline = [
        TimelineEntry(device_id, task.name, task.kind, task.start_s, task.end_s)
        for task in schedule.tasks
        for device_id in task.devices
    ]
    rank = {device.id: index for index, device in enumerate(inventory.devices)}
    timeline.sort(key=lambda entry: (rank[entry.device], entry.start_s))
    return CompiledPlan(
        pipeline=pipeline.name,
        step=step,
        iteration_s=schedule.iteration_s,
        nodes=nodes,
        devices=devices,
        critical_path=list(schedule.critical_path),
        timeline=timeline,
        colocations={item.device: item.models for item in devices if len(item.models) > 1},
        offloaded=[item.node for item in nodes if item.offloaded],
        method=method,
        num_evaluated=num_evaluated,
        reasons=[f"{item.node} -> {', '.join(item.devices)}: {item.reason}" for item in nodes],
    )


def _reason(
    pipeline: PipelineGraph,
    inventory: Inventory,
    costs: CostSource,
    result: SearchResult,
    options: SearchOptions,
    node: str,
) -> str:
    """Why this option: its note, and what the runner-up would have cost."""
    choices = result.options[node]
    chosen = choices[result.choice[node]]
    if len(choices) == 1:
        return f"{chosen.note} (the only option)"
    best = result.best
    runner_up: tuple[float, str] | None = None
    for index, option in enumerate(choices):
        if index == result.choice[node]:
            continue
        trial = evaluate(pipeline, {**best.placement, node: option}, inventory, costs,
                         options.memory_reserve)
        text = f"{', '.join(option.devices)} ({option.note})"
        if not trial.feasible:
            candidate = (float("inf"), f"{text} does not fit in memory")
        else:
            delta_s = trial.schedule.iteration_s - best.schedule.iteration_s
            # a faster option lost only to one on fewer CPU slots (search.FEWER_CPU_SLOTS_WITHIN)
            note = (f"{_signed_duration(delta_s)}, within {FEWER_CPU_SLOTS_WITHIN:.0%} on fewer CPU slots"
                    if delta_s < 0 else _signed_duration(delta_s))
            candidate = (trial.schedule.iteration_s, f"{text} {note}")
        if runner_up is None or candidate[0] < runner_up[0]:
            runner_up = candidate
    assert runner_up is not None
    return f"{chosen.note}; best of {len(choices)}, next: {runner_up[1]}"


def _signed_duration(seconds: float) -> str:
    """A step's change with its sign, in the unit that reads: ``+12.34 ms``, ``+42.0 s``,
    ``+106.3 h`` (a 7B model's pass on a CPU)."""
    sign = "-" if seconds < 0 else "+"
    size = abs(seconds)
    if size < 10:
        return f"{sign}{size * 1e3:.2f} ms"
    if size < 3600:
        return f"{sign}{size:.1f} s"
    return f"{sign}{size / 3600:.1f} h"
