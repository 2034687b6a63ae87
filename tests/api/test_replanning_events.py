"""Device events a recovery queues for the policy: delivered once, before the next step or
with a shrink's losses, the last taker of a slot counting, a slot that is gone dropped."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from flowrl.api.replanning import Replanner
from flowrl.devices.inventory import Device, Host
from flowrl.scheduler.events import DeviceEvent, DeviceReplaced
from flowrl.spec.loader import load_pipeline

GRPO = Path(__file__).resolve().parents[2] / "pipelines" / "grpo_tiny.yaml"


class Heard:
    """A policy that only records what ``decide`` is told."""

    name = "heard"

    def __init__(self) -> None:
        self.calls: list[tuple[int, list[DeviceEvent]]] = []

    def decide(self, step: int, events: Sequence[DeviceEvent]) -> list[Any]:
        self.calls.append((step, list(events)))
        return []


def replaced(slot: str, host: str) -> DeviceReplaced:
    return DeviceReplaced(Device(slot, host, 0, "cpu", "cpu", "cpu", 64.0), Host(host, 8, 64.0))


def replanner(policy: Heard) -> Replanner:
    return Replanner(load_pipeline(GRPO), policy, None, ["cpu-0", "cpu-1"], None, lambda event: None)  # type: ignore[arg-type]


def test_the_last_taker_of_each_slot_is_told_once_before_the_next_step() -> None:
    policy = Heard()
    target = replanner(policy)
    target.note([replaced("cpu-0", "c"), replaced("cpu-1", "c")])
    target.note([replaced("cpu-0", "d")])  # cpu-0 taken again before the step
    target.before_step(4)
    target.before_step(5)
    assert policy.calls == [(4, [replaced("cpu-1", "c"), replaced("cpu-0", "d")]), (5, [])]


def test_a_slot_that_is_gone_is_not_told_as_replaced() -> None:
    target = replanner(Heard())
    target.note([replaced("cpu-0", "c"), replaced("cpu-1", "c")])
    assert target._take_events({"cpu-1"}) == [replaced("cpu-0", "c")]
    assert target._take_events() == []
