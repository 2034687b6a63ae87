"""Skipped non-finite updates count for a policy and for a critic alike."""

from __future__ import annotations

import pytest

from flowrl.api.faults import NonFiniteGuard
from flowrl.errors import FlowrlError
from flowrl.records import RunEvent, StepRecord


class _Events:
    def __init__(self) -> None:
        self.seen: list[RunEvent] = []

    def event(self, event: RunEvent) -> None:
        self.seen.append(event)


@pytest.mark.parametrize("key", ["actor/nonfinite_skipped", "critic/nonfinite_skipped"])
def test_two_skipped_updates_in_a_row_stop_the_run_and_a_good_one_resets_the_count(key: str) -> None:
    guard, events = NonFiniteGuard(limit=2), _Events()
    guard.check(StepRecord(1, 10, {key: 1.0}), events)
    guard.check(StepRecord(2, 10, {key: 0.0}), events)  # a finite step in between
    guard.check(StepRecord(3, 10, {key: 1.0}), events)
    assert [event.kind for event in events.seen] == ["warning", "warning"]
    with pytest.raises(FlowrlError, match="step 4: 2 updates in a row"):
        guard.check(StepRecord(4, 10, {key: 1.0}), events)
