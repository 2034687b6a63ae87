"""Skipped non-finite updates count for a policy and for a critic alike."""

from __future__ import annotations

from pathlib import Path

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
    who = key.split("/")[0]
    assert f"step 3: the {who}'s update had a NaN or infinite loss or gradient" in events.seen[-1].message
    with pytest.raises(FlowrlError, match=f"step 4: 2 steps in a row skipped an update .* this step: the {who}'s "
                                          "update\\); the run stopped"):
        guard.check(StepRecord(4, 10, {key: 1.0}), events)


def test_the_stop_names_the_newest_checkpoint_or_says_none_was_written(tmp_path: Path) -> None:
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    guard = NonFiniteGuard(limit=1, checkpoints=checkpoints)
    with pytest.raises(FlowrlError, match="no checkpoint was written \\(trainer.checkpoint_every"):
        guard.check(StepRecord(1, 10, {"actor/nonfinite_skipped": 1.0}), _Events())
    (checkpoints / "step-2").mkdir()
    (checkpoints / "step-2" / "trainer_state.json").write_text("{}")
    with pytest.raises(FlowrlError) as caught:
        guard.check(StepRecord(3, 10, {"actor/nonfinite_skipped": 1.0}), _Events())
    assert f"its newest checkpoint is {checkpoints / 'step-2'} (lower the learning rate" in str(caught.value)
    # the fix changes the pipeline, which a resume takes with --force
    assert f"then `flowrl resume {tmp_path / 'run'} --force`" in str(caught.value)
