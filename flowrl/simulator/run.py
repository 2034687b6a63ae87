"""Step a simulated cluster under a scheduler policy, with noise and device events.

One simulated step, for each policy, in this order::

    scenario events at this step  -> the cluster changes (speed, devices)
                                  -> the policy hears of lost/added devices (not of
                                     throttling: it has to measure that)
    policy.decide(step, events)   -> accepted re-plans; their moves' time is charged
                                     to this step
    run the plan                  -> node time = cost model x 1/device speed x noise;
                                     the planner's list schedule gives the step time and
                                     each device's busy time; a plan that needs a lost
                                     device fails the step
    policy.observe(step, ...)     -> per-device node times and utilisation

The noise factor of node ``n`` at step ``s`` is lognormal(0, sigma) drawn from a
generator seeded with ``(seed, s)``, so every policy meets the same noise and the same
seed gives the same output.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from flowrl.devices.groups import pipeline_groups
from flowrl.devices.inventory import Device, Inventory
from flowrl.devices.matching import match_groups
from flowrl.graph import PipelineGraph
from flowrl.planner.cost import CpuRates
from flowrl.planner.compiled import CompiledPlan
from flowrl.planner.costs import CostSource, EstimatedCosts, NodeMemory
from flowrl.planner.micro_batches import resolve_micro_batches
from flowrl.planner.sharing import core_shares, host_cores, shared_time
from flowrl.planner.simulate import Placement, simulate
from flowrl.planner.work import NodeWork
from flowrl.records import DeviceSample, NodeTiming
from flowrl.scheduler.events import Decision, DeviceAdded, DeviceEvent, DeviceLost
from flowrl.scheduler.moves import plan_moves
from flowrl.scheduler.policy import DynamicPolicy, PolicySettings, SchedulerPolicy, make_policy
from flowrl.simulator.scenario import ClusterEvent, Scenario


@dataclass(frozen=True)
class StepResult:
    step: int
    step_s: float
    """Wall time of the step: the schedule plus any moves made before it."""
    move_s: float
    failed: bool
    """The plan needed a device that is gone: the step's work is lost."""
    utilization: dict[str, float]
    """Device -> busy time / step time, for the devices present at this step."""
    num_moves: int


@dataclass(frozen=True)
class PolicySummary:
    policy: str
    num_steps: int
    num_completed: int
    num_failures: int
    total_s: float
    throughput_steps_per_s: float
    """Completed steps per second of simulated wall time (failed steps cost time too)."""
    mean_step_s: float
    """Mean over completed steps (moves included)."""
    std_step_s: float
    p10_step_s: float
    p90_step_s: float
    mean_utilization: float
    """Mean busy share of the cluster's GPUs (CPU slots when it has none), completed steps."""
    num_moves: int
    num_replans: int


@dataclass(frozen=True)
class SimulationResult:
    policy: str
    steps: list[StepResult]
    decisions: list[Decision]
    summary: PolicySummary
    first_plan: CompiledPlan
    last_plan: CompiledPlan
    notes: list[str] = field(default_factory=list)

    def mean_step_s_from(self, step: int) -> float:
        """Mean step time of the completed steps from ``step`` on (nan if none)."""
        times = [r.step_s for r in self.steps if r.step >= step and not r.failed]
        return statistics.fmean(times) if times else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "summary": asdict(self.summary),
            "decisions": [decision.to_dict() for decision in self.decisions],
            "steps": [asdict(step) for step in self.steps],
            "notes": list(self.notes),
        }


class _StepCosts:
    """What node times really are this step: the estimate, slowed and noised."""

    def __init__(self, base: CostSource, speeds: Mapping[str, float], noise: Mapping[str, float]):
        self.base, self.speeds, self.noise = base, speeds, noise

    def slowdown(self, devices: Sequence[Device]) -> float:
        return max((1 / self.speeds.get(d.id, 1.0) for d in devices), default=1.0)

    def compute_s(self, node: str, devices: Sequence[Device], offloaded: bool) -> float:
        return self.base.compute_s(node, devices, offloaded) * self._scale(node, devices)

    def fixed_s(self, node: str, devices: Sequence[Device], offloaded: bool) -> float:
        return self.base.fixed_s(node, devices, offloaded) * self._scale(node, devices)

    def _scale(self, node: str, devices: Sequence[Device]) -> float:
        return self.slowdown(devices) * self.noise.get(node, 1.0)

    def memory(self, node: str, width: int, gpu: bool = False) -> NodeMemory:
        return self.base.memory(node, width, gpu)

    def output_bytes(self, node: str) -> float:
        return self.base.output_bytes(node)

    def work(self, node: str) -> NodeWork:
        return self.base.work(node)


def noise_factors(pipeline: PipelineGraph, sigma: float, seed: int, step: int) -> dict[str, float]:
    generator = random.Random(f"{seed}:{step}")
    return {node: generator.lognormvariate(0.0, sigma) for node in pipeline.topological_order()}


def simulate_policy(
    pipeline: PipelineGraph,
    inventory: Inventory,
    scenario: Scenario,
    policy_name: str,
    num_steps: int,
    seed: int | None = None,
    settings: PolicySettings | None = None,
    base_dir: Path | None = None,
    cpu_rates: CpuRates | None = None,
) -> SimulationResult:
    """Run ``num_steps`` simulated steps of ``pipeline`` under one policy; ``cpu_rates``: this
    machine's measured CPU rates (``planner.cost.measure_cpu_rates``) where it is simulated."""
    seed = scenario.seed if seed is None else seed
    match = match_groups(pipeline_groups(pipeline.spec), inventory)
    match.raise_if_unsatisfied()
    truth = EstimatedCosts(pipeline, cpu_rates, base_dir=base_dir)
    pipeline, truth, _ = resolve_micro_batches(pipeline, inventory, match, truth)
    policy = make_policy(policy_name, pipeline, inventory, settings, truth, base_dir, num_steps)
    first_plan = policy.plan
    cluster = inventory
    speeds: dict[str, float] = {}
    results: list[StepResult] = []
    decisions: list[Decision] = []
    for step in range(1, num_steps + 1):
        events = scenario.events_at(step)
        cluster = _apply(cluster, speeds, events)
        told: list[DeviceEvent] = [
            DeviceLost(e.device.id) if e.kind == "lost" else DeviceAdded(e.device)
            for e in events if e.kind != "throttle"
        ]
        before = policy.plan
        made = policy.decide(step, told)
        decisions.extend(made)
        move_s, num_moves = 0.0, 0
        for decision in made:
            if decision.accepted and decision.plan is not None:
                moves = plan_moves(before, decision.plan, cluster, truth, scenario.move_restart_s, {})
                move_s += sum(move.cost_s for move in moves)
                num_moves += len(moves)
                if isinstance(policy, DynamicPolicy):
                    policy.observe_move(decision.move_cost_s, move_s)
                before = decision.plan
        noise = noise_factors(pipeline, scenario.noise, seed, step)
        results.append(_run_step(pipeline, policy, cluster, truth, speeds, noise, step,
                                 move_s, num_moves))
    notes = [f"{e.text} at step {e.step} is after the last step ({num_steps})"
             for e in scenario.events if e.step > num_steps]
    summary = summarize(policy_name, results, decisions)
    return SimulationResult(policy_name, results, decisions, summary, first_plan, policy.plan, notes)


def _apply(cluster: Inventory, speeds: dict[str, float], events: Sequence[ClusterEvent]) -> Inventory:
    devices = list(cluster.devices)
    for event in events:
        if event.kind == "throttle":
            speeds[event.device.id] = event.speed
        elif event.kind == "lost":
            devices = [d for d in devices if d.id != event.device.id]
            speeds.pop(event.device.id, None)
        else:
            devices.append(event.device)
    order = {"gpu": 0, "cpu": 1}
    devices.sort(key=lambda d: (order[d.kind], d.number))
    return replace(cluster, devices=tuple(devices))


def _run_step(
    pipeline: PipelineGraph,
    policy: SchedulerPolicy,
    cluster: Inventory,
    truth: CostSource,
    speeds: Mapping[str, float],
    noise: Mapping[str, float],
    step: int,
    move_s: float,
    num_moves: int,
) -> StepResult:
    plan = policy.plan
    present = {device.id: device for device in cluster.devices}
    if any(d not in present for item in plan.nodes for d in item.devices):
        # the work up to the failure is lost; charge the step the plan's own prediction
        return StepResult(step, plan.iteration_s + move_s, move_s, True, {}, num_moves)
    placement = {item.node: Placement(tuple(item.devices), item.offloaded) for item in plan.nodes}
    actual = _StepCosts(truth, speeds, noise)
    schedule = simulate(pipeline, placement, cluster, actual)
    step_s = schedule.iteration_s + move_s
    busy: dict[str, float] = {device_id: 0.0 for device_id in present}
    for task in schedule.tasks:
        for device_id in task.devices:
            busy[device_id] += task.end_s - task.start_s
    utilization = {d: busy[d] / step_s if step_s > 0 else 0.0 for d in present}
    timings = []
    # what the node calls measure: slowed, as in the schedule, by sharing a machine's cores
    shares = core_shares(pipeline, {item.node: [present[d] for d in item.devices] for item in plan.nodes},
                         host_cores(cluster))
    for item in plan.nodes:
        devices = [present[d] for d in item.devices]
        nominal = shared_time(truth, item.node, devices, item.offloaded, shares.get(item.node, 1.0))
        nominal *= noise.get(item.node, 1.0)
        for device in devices:
            seconds = nominal / speeds.get(device.id, 1.0)
            timings.append(NodeTiming(item.node, item.role, device.id, seconds, seconds, 0.0, 0, 0,
                                      rate_of_output=pipeline.spec.nodes[item.node].rate_of_output))
    memory = {device.device: device.peak_gb for device in plan.devices}
    samples = [
        DeviceSample(d.id, d.kind, utilization[d.id], memory.get(d.id, 0.0), d.capacity_gb)
        for d in cluster.devices
    ]
    policy.observe(step, timings, samples, step_s)
    return StepResult(step, step_s, move_s, False, utilization, num_moves)


def summarize(policy: str, steps: Sequence[StepResult], decisions: Sequence[Decision]) -> PolicySummary:
    done = [r for r in steps if not r.failed]
    times = sorted(r.step_s for r in done)
    total = sum(r.step_s for r in steps)
    utilizations = [_cluster_utilization(r.utilization) for r in done]
    return PolicySummary(
        policy=policy,
        num_steps=len(steps),
        num_completed=len(done),
        num_failures=len(steps) - len(done),
        total_s=total,
        throughput_steps_per_s=len(done) / total if total > 0 else 0.0,
        mean_step_s=statistics.fmean(times) if times else float("nan"),
        std_step_s=statistics.pstdev(times) if times else float("nan"),
        p10_step_s=_quantile(times, 0.10),
        p90_step_s=_quantile(times, 0.90),
        mean_utilization=statistics.fmean(utilizations) if utilizations else 0.0,
        num_moves=sum(r.num_moves for r in steps),
        num_replans=sum(1 for d in decisions if d.accepted),
    )


def _cluster_utilization(utilization: Mapping[str, float]) -> float:
    gpus = [value for device, value in utilization.items() if device.startswith("gpu-")]
    values = gpus or list(utilization.values())
    return statistics.fmean(values) if values else 0.0


def _quantile(ordered: Sequence[float], share: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not ordered:
        return float("nan")
    position = share * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def compare_policies(
    pipeline: PipelineGraph,
    inventory: Inventory,
    scenario: Scenario,
    policies: Sequence[str],
    num_steps: int,
    seed: int | None = None,
    settings: PolicySettings | None = None,
    base_dir: Path | None = None,
    cpu_rates: CpuRates | None = None,
) -> dict[str, SimulationResult]:
    """Each policy on the same scenario, noise stream and seed."""
    return {
        name: simulate_policy(pipeline, inventory, scenario, name, num_steps, seed, settings, base_dir, cpu_rates)
        for name in policies
    }
