"""What the scheduler is told (device events) and what it answers (decisions).

All plain, frozen data: the policy takes these in and gives these out, and whoever runs
the cluster (the Dask runtime, or the simulator) carries the decisions out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Union

from flowrl.devices.inventory import Device, Host
from flowrl.planner.compiled import CompiledPlan


@dataclass(frozen=True)
class DeviceLost:
    """A device's worker is gone; nothing can run there any more."""

    device: str


@dataclass(frozen=True)
class DeviceAdded:
    """A new device joined the cluster."""

    device: Device


@dataclass(frozen=True)
class DeviceThrottled:
    """A device reports that it runs slower than its nominal speed (NVML clock-throttle
    reasons). A hint only: how much slower is learned from measured node times."""

    device: str


@dataclass(frozen=True)
class DeviceReplaced:
    """A device's slot is served by another worker now, perhaps on another machine (a
    joined cluster's replacement): the device as that worker reports it, and its machine."""

    device: Device
    host: Host


DeviceEvent = Union[DeviceLost, DeviceAdded, DeviceThrottled, DeviceReplaced]


@dataclass(frozen=True)
class Move:
    """One model (or model-less node) changing devices."""

    subject: str
    """The model that moves, or the node when it has no model (an advantage)."""
    nodes: tuple[str, ...]
    """The nodes of ``subject`` whose devices change."""
    from_devices: tuple[str, ...]
    to_devices: tuple[str, ...]
    num_bytes: float
    """Weights (and, for a trained model, gradients and optimizer state) sent."""
    cost_s: float
    """Predicted seconds: ``num_bytes`` over the link, plus restarting the role."""
    why: str
    """What about the devices made it worth it (``gpu-3 at 50% speed``)."""

    @property
    def route(self) -> str:
        """``gpu-0+gpu-1 -> gpu-2``."""
        return f"{'+'.join(self.from_devices)} -> {'+'.join(self.to_devices)}"


@dataclass(frozen=True)
class Decision:
    """One re-plan the policy considered, accepted or not."""

    step: int
    """The step before which it is applied (1-based)."""
    triggers: tuple[str, ...]
    """What made the policy look (``every 10 steps``, ``gpu-3 slow``, ``gpu-2 lost``)."""
    accepted: bool
    forced: bool
    """A lost device forced it: accepted whatever it gains."""
    moves: tuple[Move, ...]
    predicted_before_s: float
    """Predicted step time of the current plan, from the latest measurements."""
    predicted_after_s: float
    """Predicted step time of the new plan."""
    move_cost_s: float
    """Sum of the moves' costs (the runtime migrates roles one after another)."""
    horizon_steps: int
    """Steps the gain is counted over (the next interval)."""
    reason: str
    """One line: why accepted or kept."""
    plan: CompiledPlan | None = field(default=None, compare=False)
    """The new plan when accepted."""

    @property
    def gain_s_per_step(self) -> float:
        return self.predicted_before_s - self.predicted_after_s

    @property
    def gain_share(self) -> float:
        """Predicted gain as a share of the current step time (0.18 = 18 %/step)."""
        if self.predicted_before_s <= 0 or self.predicted_before_s == float("inf"):
            return 0.0
        return self.gain_s_per_step / self.predicted_before_s

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("plan")
        data["gain_s_per_step"] = self.gain_s_per_step
        data["gain_share"] = self.gain_share
        data["plan_step_s"] = self.plan.iteration_s if self.plan is not None else None
        return data
