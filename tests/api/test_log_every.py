"""trainer.log_every: the terminal sees every Nth step and the last; metrics.jsonl every step."""

from __future__ import annotations

import json
from pathlib import Path

from flowrl.api.outputs import RunFolder
from flowrl.api.run import _Watchers
from flowrl.records import RunEvent, StepRecord


class Seen:
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step(self, record: StepRecord) -> None:
        self.steps.append(record.step)

    def on_event(self, event: RunEvent) -> None:
        pass


def test_log_every_thins_the_terminal_and_keeps_every_metric_line(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path)
    seen = Seen()
    watchers = _Watchers(folder, seen, log_every=4)
    for step in range(1, 11):
        watchers.step(StepRecord(step, 10, {"loss": float(step)}))
    assert seen.steps == [4, 8, 10]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 11))
