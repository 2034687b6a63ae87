"""Measured speed of every device, as a cost source the planner can search with.

The profiler measures node calls on devices; the planner predicts them. Their ratio, per
device, says how fast that device really is: 2.0 on a card throttled to half speed, 1.0
on one that runs as the cost model expects. Each step the ratio of one device is

    ratio(d) = sum of measured compute times of the node calls on d
               / sum of their predicted times              (time-weighted over nodes)

and ``DeviceCalibration`` keeps an exponentially weighted moving average of it. A node's
time on any devices, measured there or not, is then predicted as

    compute_s(node, devices) = base.compute_s(node, devices) * max over d of ratio(d)

(data-parallel: the slowest shard sets the node's time). One ratio per device, not per
(node, device type): two A100s of which one is throttled must not look alike, and a move
is judged by the node's time on a device it has never run on, which only a per-device
speed can predict.

The analytic model errs per node too (on a CPU it may predict generation 3x too slow and a
reference forward only 1.2x). Folded into the device ratios, such errors would make the
device that runs generation look fastest, whatever its real speed. So with
``calibration_steps`` > 0 the first measured steps (after one warm-up step, which pays
for lazy initialisation) learn a factor per node instead, assuming the devices run at
their nominal speed then:

    factor(node) = median over the calibration steps of measured / predicted
    compute_s(node, devices) = base.compute_s(node, devices) * factor(node) * max ratio(d)

and device ratios are measured against the calibrated prediction from then on: a device
is slow relative to how it ran at the start. A CPU slot whose cores other processes keep
busy runs slow from the start, and taken as it was, that slowness would be learned as the
node's own (the move off the busy slot predicted to gain 22 %/step where it gained 1.9x).
So the calibration samples are divided by the slot's slowdown from that load
(:func:`contention_slowdown`, from its measured utilisation and external load), and the
device's ratio afterwards carries the load as any later slowness.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from flowrl.devices.inventory import Device, Inventory
from flowrl.graph import PipelineGraph
from flowrl.planner.compiled import CompiledPlan
from flowrl.planner.costs import CostSource, NodeMemory
from flowrl.planner.sharing import core_shares, cores_shared, host_cores, shared_time
from flowrl.planner.simulate import Placement, simulate
from flowrl.planner.work import NodeWork
from flowrl.records import DeviceSample, NodeTiming, StepRecord, slowest_part_medians


def contention_slowdown(utilization: float, external_load: float) -> float:
    """How many times longer a slot's calls take for what other processes run on its cores:
    ``1 + D``, with ``D`` (0..1) the cores' worth of work those processes want.

    Both inputs are averages over the step (per core of the slot): ``utilization`` the share
    this worker was busy, ``external_load`` the share the others were. Under fair sharing of a
    core, while the worker runs (a share ``b`` of the step) the others get ``D / (1 + D)`` and
    the worker ``1 / (1 + D)``; while it waits they get ``D``. So ``u = b / (1 + D)`` and
    ``e = D (1 - u D)``, of which ``D = (1 - sqrt(1 - 4 u e)) / (2 u)`` (``D = e`` for an idle
    worker). A busy loop beside a worker that computes all the time: ``u = e = 0.5``, ``D = 1``,
    twice as long, as measured."""
    u, e = max(0.0, utilization), min(1.0, max(0.0, external_load))
    # the same root as 2e / (1 + sqrt(1 - 4ue)), which needs no case of its own at u = 0
    demand = 2.0 * e / (1.0 + math.sqrt(max(0.0, 1.0 - 4.0 * u * e)))
    return 1.0 + min(1.0, demand)


def contention_of(pipeline: PipelineGraph, samples: Sequence[DeviceSample]) -> dict[str, float]:
    """Device -> :func:`contention_slowdown` of each CPU slot sampled, where each slot has cores
    of its own (``planner.sharing.cores_shared``); none where slots share cores, since then
    the other slots' work is in the external load, and ``core_shares`` counts it already."""
    if cores_shared(pipeline):
        return {}
    return {sample.device: contention_slowdown(sample.utilization, sample.external_load)
            for sample in samples if sample.external_load is not None}


@dataclass
class DeviceCalibration:
    """A ``CostSource``: ``base`` scaled by each device's measured/predicted ratio."""

    base: CostSource
    """Where predictions come from (the planner's ``EstimatedCosts``)."""
    alpha: float = 0.3
    """Weight of the newest step in the moving average (0..1). Default 0.3."""
    calibration_steps: int = 0
    """Measured steps (after one warm-up step) that learn per-node factors; 0 = none: the
    base prediction is taken as right per node. Default 0."""
    ratios: dict[str, float] = field(default_factory=dict)
    """Device id -> measured / predicted time (1.0 until measured)."""
    node_factors: dict[str, float] = field(default_factory=dict)
    """Node -> measured / predicted time at the start (1.0 when not calibrated)."""
    memory_excess_gb: dict[str, float] = field(default_factory=dict)
    """Node -> GB its GPU calls held beyond the prediction, the largest seen (``observe_memory``)."""
    _steps_seen: int = 0
    _samples: dict[str, list[float]] = field(default_factory=dict)

    def state_dict(self) -> dict[str, object]:
        """What was learned, as JSON-ready data (a checkpoint's ``trainer_state.json``)."""
        return {"ratios": dict(self.ratios), "node_factors": dict(self.node_factors),
                "memory_excess_gb": dict(self.memory_excess_gb),
                "steps_seen": self._steps_seen, "samples": {k: list(v) for k, v in self._samples.items()}}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        ratios, factors, samples = state.get("ratios", {}), state.get("node_factors", {}), state.get("samples", {})
        steps_seen = state.get("steps_seen", 0)
        if isinstance(ratios, dict):
            self.ratios = {str(k): float(v) for k, v in ratios.items()}
        if isinstance(factors, dict):
            self.node_factors = {str(k): float(v) for k, v in factors.items()}
        excess = state.get("memory_excess_gb", {})
        if isinstance(excess, dict):
            self.memory_excess_gb = {str(k): float(v) for k, v in excess.items()}
        if isinstance(samples, dict):
            self._samples = {str(k): [float(x) for x in v] for k, v in samples.items()}
        if isinstance(steps_seen, int):
            self._steps_seen = steps_seen

    @property
    def calibrating(self) -> bool:
        return self.calibration_steps > 0 and self._steps_seen <= self.calibration_steps

    def ratio(self, device_id: str) -> float:
        return self.ratios.get(device_id, 1.0)

    def observe_step(
        self,
        timings: Sequence[NodeTiming],
        node_devices: Mapping[str, Sequence[Device]],
        offloaded: Mapping[str, bool],
        shares: Mapping[str, float] | None = None,
        contention: Mapping[str, float] | None = None,
    ) -> None:
        """Fold one step's node calls (one ``NodeTiming`` per node and device) in.

        ``node_devices`` says where each node ran, so that its prediction is the one of
        the placement that was measured; ``shares``: how many times slower each node ran
        for sharing its machine's cores in that placement (``planner.sharing.core_shares``,
        which ``simulate`` applies too), so that a factor learned in one placement holds
        in another; ``contention``: device -> how many times slower its calls ran this step
        for other processes on its cores (:func:`contention_slowdown`), taken out of what the
        calibration steps learn.
        """
        measured: dict[str, float] = {}
        predicted: dict[str, float] = {}
        calibrating = self.calibrating
        if calibrating and self._steps_seen == 0:
            self._steps_seen += 1  # the warm-up step: lazy initialisation, not speed
            return
        for timing in timings:
            devices = node_devices.get(timing.node)
            if not devices:
                continue
            expected = shared_time(self.base, timing.node, devices, offloaded.get(timing.node, False),
                                   (shares or {}).get(timing.node, 1.0))
            if calibrating and expected > 0:
                # the median: one step disturbed by something else on the machine must not
                # set the baseline every later step is judged against
                samples = self._samples.setdefault(timing.node, [])
                samples.append(timing.compute_s / (expected * (contention or {}).get(timing.device, 1.0)))
                self.node_factors[timing.node] = statistics.median(samples)
                continue
            measured[timing.device] = measured.get(timing.device, 0.0) + timing.compute_s
            predicted[timing.device] = predicted.get(timing.device, 0.0) + expected * self.factor(timing.node)
        if self.calibration_steps:
            self._steps_seen += 1
        for device_id in sorted(measured):
            if predicted[device_id] <= 0:
                continue
            self._blend(device_id, measured[device_id] / predicted[device_id])

    def observe_idle(self, device_id: str, expected_ratio: float) -> None:
        """A device that ran nothing this step: its ratio drifts towards what its load from
        other processes predicts (on a CPU core shared with one busy process, a node gets
        half the core: ratio 1 + load). Otherwise a device left because it was slow would
        look slow for ever, and never get its work back once it recovers."""
        if not self.calibrating:
            self._blend(device_id, expected_ratio)

    def _blend(self, device_id: str, now: float) -> None:
        # After calibration a device starts at its nominal speed (1.0), so that one noisy
        # step moves it by alpha only; without calibration the first measurement is taken.
        old = self.ratios.get(device_id, 1.0 if self.calibration_steps else None)
        self.ratios[device_id] = now if old is None else old + self.alpha * (now - old)

    def forget(self, device_id: str) -> None:
        self.ratios.pop(device_id, None)

    def factor(self, node: str) -> float:
        return self.node_factors.get(node, 1.0)

    def observe_memory(self, timings: Sequence[NodeTiming], predicted_gb: Mapping[tuple[str, str], float]) -> None:
        """Fold in what the node calls held on their GPUs against the plan's prediction of the
        same calls (``simulate.node_call_memory_gb``, per (node, device)). A call that held
        more than predicted raises that node's memory by the difference from then on, the
        largest seen (the first call of a node compiles, and a move compiles again); a call
        that held less changes nothing, since the gap may be another model's and would not
        move with this node."""
        for timing in timings:
            expected = predicted_gb.get((timing.node, timing.device))
            if expected is None or timing.peak_memory_gb <= 0:
                continue  # off a GPU nothing is measured
            excess = timing.peak_memory_gb - expected
            if excess > self.memory_excess_gb.get(timing.node, 0.0):
                self.memory_excess_gb[timing.node] = excess

    # ---- CostSource ------------------------------------------------------------------

    def compute_s(self, node: str, devices: Sequence[Device], offloaded: bool) -> float:
        return self.base.compute_s(node, devices, offloaded) * self._scale(node, devices)

    def fixed_s(self, node: str, devices: Sequence[Device], offloaded: bool) -> float:
        return self.base.fixed_s(node, devices, offloaded) * self._scale(node, devices)

    def _scale(self, node: str, devices: Sequence[Device]) -> float:
        return self.factor(node) * max((self.ratio(device.id) for device in devices), default=1.0)

    def memory(self, node: str, width: int, gpu: bool = False) -> NodeMemory:
        memory = self.base.memory(node, width, gpu)
        excess = self.memory_excess_gb.get(node, 0.0) if gpu else 0.0
        return replace(memory, transient_gb=memory.transient_gb + excess) if excess else memory

    def output_bytes(self, node: str) -> float:
        return self.base.output_bytes(node)

    def work(self, node: str) -> NodeWork:
        return self.base.work(node)


def calibrated_prediction(
    pipeline: PipelineGraph,
    plan: CompiledPlan,
    inventory: Inventory,
    base: CostSource,
    records: Sequence[StepRecord],
) -> dict[str, object] | None:
    """How well ``plan``'s prediction does once calibrated, judged on steps it has not seen.

    The steps ``plan`` governed (step 1 is left out: it pays for lazy initialisation) are
    split in halves. Over the first half each node's factor is the median of measured /
    predicted (``DeviceCalibration``'s calibration, as the dynamic policy learns it); the
    plan's placement is then simulated again with the calibrated costs and set beside the
    second half's measured medians. None when there are too few steps (fewer than 4).
    """
    steps = [record for record in records if record.step > max(plan.step, 1)]
    if len(steps) < 4:
        return None
    half = len(steps) // 2
    learn, judge = steps[:half], steps[half:]
    placement = {item.node: Placement(tuple(item.devices), item.offloaded, item.reason) for item in plan.nodes}
    by_id = {device.id: device for device in inventory.devices}
    calibration = DeviceCalibration(base, calibration_steps=len(learn))
    calibration.observe_step([], {}, {})  # the warm-up step was left out above
    devices = {node: [by_id[d] for d in where.devices if d in by_id] for node, where in placement.items()}
    offloaded = {node: where.offloaded for node, where in placement.items()}
    shares = core_shares(pipeline, devices, host_cores(inventory))
    loads: dict[str, list[float]] = {}
    for record in learn:
        contention = contention_of(pipeline, record.devices)
        calibration.observe_step(record.nodes, devices, offloaded, shares, contention)
        for device_id, slowdown in contention.items():
            loads.setdefault(device_id, []).append(slowdown)
    # the factors leave other processes' load out; the devices carry it, as a policy's do
    for device_id, slowdowns in loads.items():
        calibration.ratios[device_id] = statistics.median(slowdowns)
    schedule = simulate(pipeline, placement, inventory, calibration)
    measured = slowest_part_medians((t.node, r.step, t.compute_s) for r in judge for t in r.nodes)
    step_times = [r.metrics["timing_s/step"] for r in judge if math.isfinite(r.metrics.get("timing_s/step", math.nan))]
    return {
        "learned_from_steps": [learn[0].step, learn[-1].step],
        "judged_on_steps": [judge[0].step, judge[-1].step],
        "node_factors": dict(calibration.node_factors),
        "iteration_s": schedule.iteration_s,
        "measured_step_s_median": statistics.median(step_times) if step_times else None,
        "nodes": {
            node: {"predicted_s": schedule.task(node).end_s - schedule.task(node).start_s,
                   "measured_s": measured.get(node)}
            for node in pipeline.topological_order()
        },
    }
