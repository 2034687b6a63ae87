"""The scheduler: when to re-plan and whether a move pays (pure: events in, decisions out)."""

from flowrl.scheduler.calibration import DeviceCalibration
from flowrl.scheduler.events import (
    Decision,
    DeviceAdded,
    DeviceEvent,
    DeviceLost,
    DeviceReplaced,
    DeviceThrottled,
    Move,
)
from flowrl.scheduler.policy import (
    DynamicPolicy,
    PolicySettings,
    SchedulerPolicy,
    StaticPolicy,
    make_policy,
    settings_from_spec,
)

__all__ = [
    "Decision",
    "DeviceAdded",
    "DeviceCalibration",
    "DeviceEvent",
    "DeviceLost",
    "DeviceReplaced",
    "DeviceThrottled",
    "DynamicPolicy",
    "Move",
    "PolicySettings",
    "SchedulerPolicy",
    "StaticPolicy",
    "make_policy",
    "settings_from_spec",
]
