"""A step's metrics from its node reports: verl's per-token timings, with one score node and
with several (whose scores, and times, add up)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.api.metrics import step_metrics
from flowrl.runtime.calls import NodeReport
from flowrl.spec.loader import load_pipeline

PIPELINE = """
name: two-scores
models:
  actor: {path: builtin:tiny-llama, device_group: g}
devices:
  g: {type: cpu}
nodes:
  rollout: {role: generate, model: actor, inputs: [prompts], n: 2, max_new_tokens: 4}
  digits:  {role: score, fn: digits, inputs: [rollout]}
  again:   {role: score, fn: digits, inputs: [rollout]}
  adv:     {role: advantage, estimator: grpo, inputs: [digits, again]}
  train:   {role: update, model: actor, inputs: [rollout, adv], lr: 1.0e-4}
data: {source: builtin:digits, batch_size: 2}
"""


def _report(node: str, role: str, compute_s: float, tokens_in: int, tokens_out: int, **metrics: float) -> NodeReport:
    return NodeReport(node, role, "cpu-0", f"1:{node}", compute_s, compute_s, 0.0, tokens_in, tokens_out, metrics)


def _two_score_reports() -> dict[str, NodeReport]:
    """A step of PIPELINE: 4 completions of 4 tokens after prompts of 6 (16 generated, 40
    read in all); 'digits' scores 0.25 on average, 'again' 0.5."""
    return {
        "rollout": _report("rollout", "generate", 0.2, 24, 16),
        "digits": _report("digits", "score", 0.01, 16, 0, **{"critic/score/mean": 0.25}),
        "again": _report("again", "score", 0.03, 16, 0, **{"critic/score/mean": 0.5}),
        "adv": _report("adv", "advantage", 0.002, 0, 0),
        "train": _report("train", "update", 0.4, 40, 0),
    }


def test_per_token_timings_with_two_score_nodes(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(PIPELINE)
    graph = load_pipeline(path)
    metrics, _ = step_metrics(graph, _two_score_reports(), step_s=0.7, num_devices=1)
    assert metrics["critic/score/mean"] == pytest.approx(0.75)  # the two scores add up
    assert metrics["perf/total_num_tokens"] == 40.0 and metrics["perf/time_per_step"] == 0.7
    assert metrics["timing_per_token_ms/gen"] == pytest.approx(200.0 / 16)  # per generated token
    assert metrics["timing_per_token_ms/update_actor"] == pytest.approx(400.0 / 40)  # per token of the step
    # the score nodes are timed together (their sum), and so is their per-token time
    assert metrics["timing_s/reward"] == pytest.approx(0.04)
    assert metrics["timing_per_token_ms/reward"] == pytest.approx(40.0 / 40)


def test_the_status_line_names_nodes_that_share_a_metrics_name_by_their_own(tmp_path: Path) -> None:
    from flowrl.api.metrics import status_labels

    path = tmp_path / "p.yaml"
    path.write_text(PIPELINE)
    assert status_labels(load_pipeline(path)) == {
        "rollout": "gen", "digits": "digits", "again": "again", "adv": "adv", "train": "update_actor"}


def test_one_score_node_is_logged_under_its_own_name_too(tmp_path: Path) -> None:
    # reward/<node>/... for one score node as for several; reward/batch_failed over the nodes
    path = tmp_path / "p.yaml"
    path.write_text(PIPELINE.replace("  again:   {role: score, fn: digits, inputs: [rollout]}\n", "")
                    .replace("inputs: [digits, again]", "inputs: [digits]"))
    graph = load_pipeline(path)
    scores = {"critic/score/mean": 0.25, "reward/num_failed": 1.0, "reward/failed_share": 0.25,
              "reward/batch_failed": 1.0}
    reports = {
        "rollout": _report("rollout", "generate", 0.2, 24, 16),
        "digits": _report("digits", "score", 0.01, 16, 0, **scores),
        "adv": _report("adv", "advantage", 0.002, 0, 0),
        "train": _report("train", "update", 0.4, 40, 0),
    }
    metrics, _ = step_metrics(graph, reports, step_s=0.7, num_devices=1)
    assert metrics["critic/score/mean"] == metrics["reward/digits/mean"] == 0.25
    assert metrics["reward/digits/num_failed"] == metrics["reward/num_failed"] == 1.0
    assert metrics["reward/batch_failed"] == metrics["reward/digits/batch_failed"] == 1.0


def test_a_score_no_advantage_reads_is_logged_but_not_added_to_the_reward(tmp_path: Path) -> None:
    """'again' feeds nothing: the step's reward (the status line's, the report's curve) was
    0.75 while the advantage trained on 0.25."""
    path = tmp_path / "p.yaml"
    path.write_text(PIPELINE.replace("inputs: [digits, again]", "inputs: [digits]"))
    graph = load_pipeline(path)
    reports = _two_score_reports()
    metrics, _ = step_metrics(graph, reports, step_s=0.7, num_devices=1)
    assert metrics["critic/score/mean"] == 0.25
    assert metrics["reward/digits/mean"] == 0.25 and metrics["reward/again/mean"] == 0.5
    # the one score node an advantage reads is the reward; the one it does not, never
    path.write_text(PIPELINE.replace("inputs: [digits, again]", "inputs: [again]"))
    reports = {name: report for name, report in reports.items() if name != "digits"}
    metrics, _ = step_metrics(load_pipeline(path), reports, step_s=0.7, num_devices=1)
    assert metrics["critic/score/mean"] == 0.5 and metrics["reward/again/mean"] == 0.5
