"""Reading a run's steps back from its output folder."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from flowrl.api.run import load_run
from flowrl.errors import FlowrlError


def test_steps_and_evaluations_come_back_from_metrics_jsonl(tmp_path: Path) -> None:
    lines = [
        {"step": 0, "elapsed_s": 0.5, "val/reward/mean": 0.1},  # the evaluation before training
        {"step": 1, "elapsed_s": 1.0, "critic/score/mean": 0.25, "actor/grad_norm": None},  # NaN is written null
        {"step": 2, "elapsed_s": 1.5, "critic/score/mean": 0.5, "val/reward/mean": 0.3},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = load_run(tmp_path)
    assert [record.step for record in result.records] == [1, 2]
    assert result.metric("critic/score/mean") == [0.25, 0.5] and result.records[1].elapsed_s == 1.5
    assert math.isnan(result.metric("actor/grad_norm")[0])
    assert result.evaluations == [(0, {"val/reward/mean": 0.1}), (2, {"val/reward/mean": 0.3})]
    assert result.metric("val/reward/mean") == [0.3]
    assert result.steps_of("val/reward/mean") == [(0, 0.1), (2, 0.3)]  # the evaluation before training too
    assert result.steps_of("critic/score/mean") == [(1, 0.25), (2, 0.5)]
    with pytest.raises(KeyError, match="did you mean 'critic/score/mean'"):
        result.steps_of("critic/scores/mean")
    assert result.finished_steps == 0  # no run.json says it finished


def test_a_folder_without_a_run_or_with_a_broken_line_is_said_to_be_one(tmp_path: Path) -> None:
    with pytest.raises(FlowrlError, match="holds no metrics.jsonl"):
        load_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "x": \n{"step": 3}\n')
    with pytest.raises(FlowrlError, match=r"metrics.jsonl:2 is not a metrics line"):
        load_run(tmp_path)
    # a last line cut short by a killed process is left out, as a resume drops it
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "x": ')
    assert [record.step for record in load_run(tmp_path).records] == [1]


def test_a_damaged_run_record_is_an_error_where_a_resume_needs_it(tmp_path: Path) -> None:
    from flowrl.api.outputs import read_run_info

    (tmp_path / "run.json").write_text('{"base_dir": "/x", "fini')
    assert read_run_info(tmp_path) == {}  # a fresh start or a report does without it
    with pytest.raises(FlowrlError, match=r"run.json cannot be read \(JSONDecodeError: .*\): the run's record is damaged"):
        read_run_info(tmp_path, strict=True)


def test_the_clock_a_resume_goes_on_from_comes_from_the_lines_up_to_its_checkpoint(tmp_path: Path) -> None:
    """For a checkpoint written before trainer_state.json kept the run's seconds: the step's
    line, else the latest line before it (its own line lost with an edited file)."""
    from flowrl.api.outputs import RunFolder

    lines = [{"step": 0, "elapsed_s": 0.5}, {"step": 1, "elapsed_s": 1.0}, {"step": 3, "elapsed_s": 3.0},
             {"step": 4, "elapsed_s": 4.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"step": 5, "ela')
    folder = RunFolder(tmp_path)
    try:
        assert [folder.elapsed_at(step) for step in (0, 1, 2, 3, 4, 9)] == [0.0, 1.0, 1.0, 3.0, 4.5, 4.5]
    finally:
        folder.release()
