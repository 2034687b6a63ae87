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
speed can predict. Per-node errors of the cost model are folded into the device's ratio.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from flowrl.devices.inventory import Device
from flowrl.planner.costs import CostSource, NodeMemory
from flowrl.planner.work import NodeWork
from flowrl.records import NodeTiming


@dataclass
class DeviceCalibration:
    """A ``CostSource``: ``base`` scaled by each device's measured/predicted ratio."""

    base: CostSource
    """Where predictions come from (the planner's ``EstimatedCosts``)."""
    alpha: float = 0.3
    """Weight of the newest step in the moving average (0..1). Default 0.3."""
    ratios: dict[str, float] = field(default_factory=dict)
    """Device id -> measured / predicted time (1.0 until measured)."""

    def ratio(self, device_id: str) -> float:
        return self.ratios.get(device_id, 1.0)

    def observe_step(
        self,
        timings: Sequence[NodeTiming],
        node_devices: Mapping[str, Sequence[Device]],
        offloaded: Mapping[str, bool],
    ) -> None:
        """Fold one step's node calls (one ``NodeTiming`` per node and device) in.

        ``node_devices`` says where each node ran, so that its prediction is the one of
        the placement that was measured.
        """
        measured: dict[str, float] = {}
        predicted: dict[str, float] = {}
        for timing in timings:
            devices = node_devices.get(timing.node)
            if not devices:
                continue
            expected = self.base.compute_s(timing.node, devices, offloaded.get(timing.node, False))
            compute = max(0.0, timing.latency_s - timing.wait_s)
            measured[timing.device] = measured.get(timing.device, 0.0) + compute
            predicted[timing.device] = predicted.get(timing.device, 0.0) + expected
        for device_id in sorted(measured):
            if predicted[device_id] <= 0:
                continue
            now = measured[device_id] / predicted[device_id]
            old = self.ratios.get(device_id)
            self.ratios[device_id] = now if old is None else old + self.alpha * (now - old)

    def forget(self, device_id: str) -> None:
        self.ratios.pop(device_id, None)

    # ---- CostSource ------------------------------------------------------------------

    def compute_s(self, node: str, devices: Sequence[Device], offloaded: bool) -> float:
        factor = max((self.ratio(device.id) for device in devices), default=1.0)
        return self.base.compute_s(node, devices, offloaded) * factor

    def memory(self, node: str, width: int) -> NodeMemory:
        return self.base.memory(node, width)

    def output_bytes(self, node: str) -> float:
        return self.base.output_bytes(node)

    def work(self, node: str) -> NodeWork:
        return self.base.work(node)
