"""The reward-failure guard: when it stops a run and what its message says."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from flowrl.api.reward_guard import RewardFailureGuard
from flowrl.errors import RewardError
from flowrl.records import RunEvent
from flowrl.spec.loader import pipeline_from_dict


def _graph(score_nodes: dict[str, str]) -> object:
    nodes = {"rollout": {"role": "generate", "model": "actor", "inputs": ["prompts"]}}
    nodes.update({name: {"role": "score", "fn": fn, "inputs": ["rollout"]} for name, fn in score_nodes.items()})
    nodes["adv"] = {"role": "advantage", "inputs": list(score_nodes)}
    nodes["train"] = {"role": "update", "model": "actor", "inputs": ["rollout", "adv"]}
    return pipeline_from_dict({"name": "p", "models": {"actor": {"path": "builtin:tiny-llama"}}, "nodes": nodes,
                               "data": {"source": "builtin:digits"}, "trainer": {"max_failed_reward_steps": 2}})


def _report(failed_share: float) -> SimpleNamespace:
    return SimpleNamespace(metrics={"reward/failed_share": failed_share}, messages=["boom (prompt 0)"])


def test_a_failing_function_beside_a_working_one_is_said_to_give_no_signal_itself(tmp_path: Path) -> None:
    checkpoints = tmp_path / "run" / "checkpoints"
    (checkpoints / "step-1").mkdir(parents=True)
    (checkpoints / "step-1" / "trainer_state.json").write_text("{}")
    guard = RewardFailureGuard(_graph({"correct": "digits", "shape": "digits"}), checkpoints)  # type: ignore[arg-type]
    events: list[object] = []
    guard.check(1, {"correct": _report(0.0), "shape": _report(1.0)}, events.append)
    with pytest.raises(RewardError) as raised:
        guard.check(2, {"correct": _report(0.0), "shape": _report(1.0)}, events.append)
    message = str(raised.value)
    assert "score node 'shape' failed on every sample for 2 steps in a row" in message
    assert "so its reward gave training no signal; the run stopped at step 2" in message
    assert (f"(fix the function, then `flowrl resume {tmp_path / 'run'}`; from Python: "
            f"`run(pipeline, output_dir='{tmp_path / 'run'}', resume=True)`)") in message
    # one node alone: training as a whole had no signal
    alone = RewardFailureGuard(_graph({"shape": "digits"}))  # type: ignore[arg-type]
    alone.check(1, {"shape": _report(1.0)}, events.append)
    with pytest.raises(RewardError, match="so training had no signal; the run stopped at step 2. First error: boom"):
        alone.check(2, {"shape": _report(1.0)}, events.append)


def test_a_score_node_no_advantage_reads_neither_stops_the_run_nor_hides_the_one_that_trains() -> None:
    """A watching node counted as a second score: the one trained function returning None on
    every sample never stopped the run, and the watcher failing everywhere stopped it."""
    spec = _graph({"correct": "digits", "watch": "digits"}).spec.model_dump(mode="json", exclude_unset=True)  # type: ignore[attr-defined]
    spec["nodes"]["adv"]["inputs"] = ["correct"]
    guard = RewardFailureGuard(pipeline_from_dict(spec))
    events: list[RunEvent] = []
    for step in range(1, 4):  # the watcher fails everywhere: warned, never stopped
        guard.check(step, {"correct": _report(0.0), "watch": _report(1.0)}, events.append)
    assert [event.kind for event in events] == ["warning"]
    guard.check(4, {"correct": _none(1.0), "watch": _report(1.0)}, events.append)
    with pytest.raises(RewardError, match="score node 'correct' failed or returned None .* so training had no signal"):
        guard.check(5, {"correct": _none(1.0), "watch": _report(1.0)}, events.append)


def _none(none_share: float) -> SimpleNamespace:
    return SimpleNamespace(metrics={"reward/failed_share": 0.0, "reward/none_share": none_share}, messages=[])


def test_a_function_that_applies_to_no_sample_is_warned_about_and_alone_stops_the_run() -> None:
    events: list[RunEvent] = []
    alone = RewardFailureGuard(_graph({"judge": "digits"}))  # type: ignore[arg-type]
    alone.check(1, {"judge": _none(1.0)}, events.append)
    assert [event.kind for event in events] == ["warning"]
    assert "returned None (does not apply) for every sample of this step" in events[0].message
    alone.check(2, {"judge": _none(0.5)}, events.append)  # some samples scored: the streak starts again
    alone.check(3, {"judge": _none(1.0)}, events.append)
    assert len(events) == 1  # warned once
    with pytest.raises(RewardError, match="failed or returned None on every sample for 2 steps in a row .* so "
                                          "training had no signal.*First error: it returned None for every sample"):
        alone.check(4, {"judge": _none(1.0)}, events.append)
    # beside a reward model's score node too: it gives signal
    spec = _graph({"judge": "digits"}).spec.model_dump(mode="json", exclude_unset=True)  # type: ignore[attr-defined]
    spec["models"]["rm"] = {"path": "builtin:tiny-rm", "kind": "reward"}
    spec["nodes"]["rm_score"] = {"role": "score", "model": "rm", "inputs": ["rollout"]}
    spec["nodes"]["adv"]["inputs"] = ["judge", "rm_score"]
    with_model = RewardFailureGuard(pipeline_from_dict(spec))
    for step in range(1, 6):
        with_model.check(step, {"judge": _none(1.0)}, events.append)
    # beside another function it may rightly apply to no sample of a batch: a warning only
    both = RewardFailureGuard(_graph({"judge": "digits", "math": "digits"}))  # type: ignore[arg-type]
    for step in range(1, 6):
        both.check(step, {"judge": _none(1.0), "math": _none(0.0)}, events.append)
    assert len(events) == 3


def test_a_batch_call_that_raised_is_warned_about_once() -> None:
    batch = ("the call of reward function 'digits' on the batch of 8 raised KeyError: 'x'; each sample was "
             "scored alone (8 calls)")
    report = SimpleNamespace(metrics={"reward/failed_share": 0.0, "reward/batch_failed": 1.0}, messages=[batch])
    events: list[RunEvent] = []
    guard = RewardFailureGuard(_graph({"judge": "digits"}))  # type: ignore[arg-type]
    for step in (1, 2, 3):
        guard.check(step, {"judge": report}, events.append)
    assert [(event.kind, event.step) for event in events] == [("warning", 1)]
    assert events[0].message.startswith(f"score node 'judge': {batch} (reward/batch_failed counts the steps")
