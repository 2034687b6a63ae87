"""Updates that go non-finite: skipped, counted, and too many in a row stop the run.

(Lost and hung workers are events of the run's state machine: see ``lifecycle.py`` and
``driver.py``.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from flowrl.api.recovery import resume_note
from flowrl.errors import FlowrlError
from flowrl.records import NONFINITE_METRICS, RunEvent, StepRecord


class Events(Protocol):
    def event(self, event: RunEvent) -> None: ...


class NonFiniteGuard:
    """Counts updates skipped for a non-finite loss; too many in a row stop the run."""

    def __init__(self, limit: int, checkpoints: Path | None = None) -> None:
        self.limit = limit
        self.in_a_row = 0
        self.checkpoints = checkpoints

    def check(self, record: StepRecord, events: Events) -> None:
        skipped = [key.split("/")[0] for key in NONFINITE_METRICS if record.metrics.get(key)]
        if not skipped:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        which = " and ".join(f"the {name}'s" for name in skipped)  # the actor's, the critic's
        events.event(RunEvent(
            "warning", f"step {record.step}: {which} update had a NaN or infinite loss or gradient and was skipped",
            record.step))
        if self.in_a_row >= self.limit:
            raise FlowrlError(
                f"step {record.step}: {self.in_a_row} steps in a row skipped an update for a NaN or infinite loss or "
                f"gradient (trainer.max_nonfinite_updates; this step: {which} update); the run stopped"
                f"{resume_note(self.checkpoints, 'lower the learning rate or check the reward scale', True)}"
            )
