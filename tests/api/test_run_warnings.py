"""What a run warns about (an evaluation of the training prompts themselves, local-cluster
settings on a run that joins a cluster) and options it refuses as the file's would be."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flowrl.api.data import evaluates_training_prompts
from flowrl.errors import FlowrlError
from flowrl.spec.loader import pipeline_from_dict


def _pipeline(source: str, evaluation: dict[str, Any], **data: Any) -> Any:
    return pipeline_from_dict({
        "name": "p",
        "models": {"actor": {"path": "builtin:tiny-llama"}},
        "nodes": {
            "rollout": {"role": "generate", "model": "actor", "inputs": ["prompts"]},
            "reward": {"role": "score", "fn": "digits", "inputs": ["rollout"]},
            "adv": {"role": "advantage", "inputs": ["reward"]},
            "train": {"role": "update", "model": "actor", "inputs": ["rollout", "adv"]},
        },
        "data": {"source": source, **data},
        "eval": {"every_steps": 5, **evaluation},
    })


def test_only_a_single_file_without_an_eval_source_evaluates_on_its_training_prompts(tmp_path: Path) -> None:
    (tmp_path / "train.jsonl").write_text('{"prompt": "a"}\n')
    (tmp_path / "held.jsonl").write_text('{"prompt": "b"}\n')
    (tmp_path / "splits").mkdir()
    assert evaluates_training_prompts(_pipeline("train.jsonl", {}), tmp_path)
    assert evaluates_training_prompts(_pipeline("train.jsonl", {"source": "train.jsonl"}), tmp_path)
    assert not evaluates_training_prompts(_pipeline("train.jsonl", {"source": "held.jsonl"}), tmp_path)
    assert not evaluates_training_prompts(_pipeline("splits", {}), tmp_path)  # a folder: its test split
    assert not evaluates_training_prompts(_pipeline("builtin:digits", {}), tmp_path)


def test_settings_of_a_local_cluster_are_named_when_a_run_joins_one() -> None:
    from flowrl.api.run import local_only_settings
    from flowrl.spec.schema import RuntimeSpec

    assert local_only_settings(RuntimeSpec(scheduler_address="tcp://head:8786")) == []
    joined = RuntimeSpec(scheduler_address="tcp://head:8786", cpu_slots=4, pin_cpus=True, standby_workers=1)
    assert local_only_settings(joined) == ["runtime.cpu_slots", "runtime.pin_cpus"]


def test_a_run_option_out_of_range_reads_as_the_file_s_would() -> None:
    import pytest

    from flowrl.api.run import run
    from flowrl.errors import FlowrlError

    with pytest.raises(FlowrlError) as caught:
        run(_pipeline("builtin:digits", {}), steps=0)
    assert str(caught.value) == "trainer.steps: out of range: allowed steps >= 1, found 0"


def test_a_logger_listed_twice_is_refused() -> None:
    import pytest
    from pydantic import ValidationError

    from flowrl.spec.schema import TrainerSpec

    with pytest.raises(ValidationError, match="'tensorboard' is listed more than once"):
        TrainerSpec(loggers=("jsonl", "tensorboard", "tensorboard"))


def test_held_out_prompts_may_name_their_own_columns(tmp_path: Path) -> None:
    import pytest

    from flowrl.api.data import eval_examples
    from flowrl.data.formatting import PromptFormatter
    from flowrl.errors import DataError

    (tmp_path / "train.jsonl").write_text('{"question": "1+1=", "answer": "2"}\n')
    (tmp_path / "held.jsonl").write_text('{"prompt": "2+2=", "target": "4"}\n')
    graph = _pipeline("train.jsonl", {"source": "held.jsonl", "prompt_key": "prompt", "answer_key": "target"},
                      prompt_key="question")
    examples = eval_examples(graph, tmp_path, PromptFormatter())
    assert [(e.prompt, e.answer) for e in examples] == [("2+2=", "4")]
    # without eval.prompt_key the training data's key applies, and the message names eval's field
    with pytest.raises(DataError, match=r"held.jsonl has no column 'prompt_x' .*set eval.prompt_key"):
        eval_examples(_pipeline("train.jsonl", {"source": "held.jsonl", "prompt_key": "prompt_x"}), tmp_path,
                      PromptFormatter())


def test_the_evaluation_event_counts_held_out_prompts_skipped_or_cut_as_too_long() -> None:
    from flowrl.api.run import _formatted
    from flowrl.data.formatting import FormatCounts

    assert _formatted(FormatCounts(10, num_skipped=1)) == " (of the split read, 1 skipped as longer than data.max_prompt_tokens)"
    assert _formatted(FormatCounts(10, num_skipped=2, num_truncated=3)) == (
        " (of the split read, 2 skipped as longer than data.max_prompt_tokens, 3 truncated on the left)")
    assert _formatted(FormatCounts(10)) == "" and _formatted(None) == ""


def test_a_run_a_check_refuses_records_why_in_its_folder(tmp_path: Path) -> None:
    import json

    import pytest

    from flowrl.api.run import run
    from flowrl.errors import FlowrlError

    (tmp_path / "rw.py").write_text("def wants_solution(completions, solution, **kwargs):\n    return [0.0] * len(completions)\n")
    pipeline = _pipeline("builtin:digits", {})
    spec = pipeline.spec.model_copy(update={"eval": None})
    spec.nodes["reward"] = spec.nodes["reward"].model_copy(update={"fn": "rw:wants_solution"})
    from flowrl.graph import PipelineGraph

    output = tmp_path / "out"
    with pytest.raises(FlowrlError, match="needs the argument 'solution'") as caught:
        run(PipelineGraph(spec), output_dir=output, base_dir=tmp_path)
    events = [json.loads(line) for line in (output / "events.jsonl").read_text().splitlines()]
    assert events[-1]["kind"] == "stopped" and events[-1]["message"] == str(caught.value)


def test_the_plain_log_says_where_a_run_stopped_and_leaves_why_to_the_error_printed_next() -> None:
    import io

    from flowrl.records import RunEvent
    from flowrl.ui.plain import PlainLog

    stream = io.StringIO()
    log = PlainLog(stream)
    log.on_event(RunEvent("stopped", "step 3: the Dask scheduler cannot be reached", 3))
    log.on_event(RunEvent("warning", "w", 3))
    assert stream.getvalue() == "[event] stopped after step 3 (the reason follows)\n[event] warning: w\n"
    # a run that stopped as it started (its data refused) or in its first step: no step is
    # said to have finished
    log.on_event(RunEvent("stopped", "data.source: ...", 0))
    assert stream.getvalue().endswith("[event] stopped before any step finished (the reason follows)\n")


def test_the_changes_a_resume_refuses_leave_out_more_steps_and_a_moved_folder(tmp_path: Path) -> None:
    from flowrl.api.outputs import RunFolder
    from flowrl.api.run import _check_unchanged
    from flowrl.spec.dump import to_yaml
    from flowrl.spec.loader import load_pipeline

    pipeline = load_pipeline(Path(__file__).resolve().parents[2] / "pipelines" / "grpo_tiny.yaml")
    before = to_yaml(pipeline)
    now = before.replace("trainer: {steps: 120, output_dir: outputs/grpo-tiny}",
                         "trainer: {steps: 200, output_dir: /elsewhere/grpo-tiny}").replace("lr: 0.0005", "lr: 0.001")
    assert now != before and "steps: 200" in now
    folder = RunFolder(tmp_path)
    changes = _check_unchanged(folder, before, now, force=True)
    assert changes == ["nodes.train.lr: 0.0005 -> 0.001"]
    # a field set back to its default is shown with the value it takes, not as removed
    written = "data: {source: builtin:digits, batch_size: 4}"
    assert written in before
    at_default = before.replace(written, "data: {source: builtin:digits}")
    assert _check_unchanged(folder, before, at_default, force=True) == ["data.batch_size: 4 -> 8"]
    spelled_out = before.replace(written, "data: {source: builtin:digits, batch_size: 8}")
    assert _check_unchanged(folder, at_default, spelled_out, force=False) == []  # the same job
    # the Dask cluster joined is no change (a scheduler lost and started again elsewhere)
    assert _check_unchanged(folder, before + "runtime: {scheduler_address: 'tcp://a:8786'}\n",
                            before + "runtime: {scheduler_address: 'tcp://b:8786'}\n", force=False) == []
    assert _check_unchanged(folder, before + "runtime: {scheduler_address: 'tcp://a:8786'}\n", before, force=False) == []
    # a section set where there was none: as written, not every field of it
    assert _check_unchanged(folder, before, before + "eval: {every_steps: 5}\n", force=True) == [
        "eval: null -> {every_steps: 5}"]
    # an earlier text this version cannot read is shown as a diff of its lines
    unknown = before.replace(written, "data: {source: builtin:digits, batch_size: 4, shuffle_buffer: 3}")
    with pytest.raises(FlowrlError, match=r"\(- before, \+ now\):\n  -data: .*shuffle_buffer: 3\}\n  \+data: "):
        _check_unchanged(folder, unknown, before, force=False)
    # the steps alone are no change at all
    assert _check_unchanged(folder, before, before.replace("steps: 120", "steps: 200"), force=False) == []


def test_a_trainer_section_of_only_steps_is_no_change_against_none() -> None:
    from flowrl.api.run import _real_changes
    from flowrl.spec.dump import resumable_form

    assert resumable_form("name: x\ntrainer: {steps: 50}\n") == resumable_form("name: x\n")
    assert _real_changes(["-trainer: {steps: 50}", "-  lr: 1", "+  lr: 2"]) == ["-  lr: 1", "+  lr: 2"]
    assert _real_changes(["-trainer: {steps: 50, seed: 1}"]) == ["-trainer: {steps: 50, seed: 1}"]


def test_a_run_s_error_reaches_the_caller_without_flowrl_s_own_frames() -> None:
    import traceback

    import pytest

    from flowrl.api.run import run
    from flowrl.errors import FlowrlError

    with pytest.raises(FlowrlError) as caught:
        run(_pipeline("builtin:digits", {}), steps=0)
    frames = [frame.filename for frame in traceback.extract_tb(caught.value.__traceback__)]
    # this test's call and run()'s own re-raise: nothing of the dozen frames beneath
    assert [Path(name).name for name in frames] == ["test_run_warnings.py", "run.py"], frames


def test_a_metric_no_step_has_is_a_key_error_naming_the_closest() -> None:
    from flowrl.api.run import RunResult
    from flowrl.records import StepRecord

    result = RunResult(Path("out"), [StepRecord(1, 2, {"val/reward/mean": 0.5, "critic/score/mean": 0.1}),
                                     StepRecord(2, 2, {"critic/score/mean": 0.2})])
    assert result.metric("val/reward/mean") == [0.5] and result.metric("critic/score/mean") == [0.1, 0.2]
    with pytest.raises(KeyError, match="'val/my_reward/mean'; did you mean 'val/reward/mean'"):
        result.metric("val/my_reward/mean")
    assert RunResult(Path("out")).metric("anything") == []  # a run that trained nothing
