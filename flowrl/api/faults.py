"""Updates that go non-finite: skipped, counted, and too many in a row stop the run.

(Lost and hung workers are events of the run's state machine: see ``lifecycle.py`` and
``driver.py``.)
"""

from __future__ import annotations

from typing import Protocol

from flowrl.errors import FlowrlError
from flowrl.records import NONFINITE_METRICS, RunEvent, StepRecord


class Events(Protocol):
    def event(self, event: RunEvent) -> None: ...


class NonFiniteGuard:
    """Counts updates skipped for a non-finite loss; too many in a row stop the run."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_a_row = 0

    def check(self, record: StepRecord, events: Events) -> None:
        if not any(record.metrics.get(key) for key in NONFINITE_METRICS):
            self.in_a_row = 0
            return
        self.in_a_row += 1
        events.event(RunEvent(
            "warning", f"step {record.step}: the update's loss or gradient was NaN or infinite; the update was skipped",
            record.step))
        if self.in_a_row >= self.limit:
            raise FlowrlError(
                f"step {record.step}: {self.in_a_row} updates in a row had a NaN or infinite loss or gradient "
                "(trainer.max_nonfinite_updates); the run stopped, its newest checkpoint is kept. Lower the "
                "learning rate or check the reward scale, then resume"
            )
