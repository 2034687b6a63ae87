"""Evaluation split over the generate node's workers: the parts' metrics join into the whole's."""

from __future__ import annotations

from pathlib import Path

from flowrl.api.evaluation import Evaluator, merge_parts
from flowrl.spec.loader import load_pipeline


def test_parts_merge_by_their_number_of_prompts() -> None:
    # part 1: 3 prompts, mean 1/3, pass@2 2/3, 1 failure; part 2: 1 prompt, mean 1.0, pass 1.0
    # whole: mean (3 * 1/3 + 1 * 1) / 4 = 0.5; pass@2 (3 * 2/3 + 1) / 4 = 0.75; 1 failure; 4 prompts
    first = {"val/num_prompts": 3.0, "val/r/mean": 1 / 3, "val/r/pass@2": 2 / 3, "val/r/num_failed": 1.0}
    second = {"val/num_prompts": 1.0, "val/r/mean": 1.0, "val/r/pass@2": 1.0, "val/r/num_failed": 0.0}
    merged = merge_parts([first, second])
    assert merged == {"val/num_prompts": 4.0, "val/r/mean": 0.5, "val/r/pass@2": 0.75, "val/r/num_failed": 1.0}
    assert merge_parts([first]) == first


def test_the_event_gives_a_short_evaluation_in_milliseconds() -> None:
    graph = load_pipeline(Path(__file__).parents[2] / "pipelines" / "grpo_arith.yaml")
    evaluator = Evaluator(graph, ["a", "b"])
    metrics = {"val/reward/mean": 0.25, "val/response_length/mean": 7.0}
    fast = evaluator.describe(10, metrics, 0.042)
    assert fast.startswith("after step 10: val/reward/mean 0.250 (2 prompts x ")
    assert fast.endswith(", 42 ms)")
    assert evaluator.describe(0, metrics, 2.345).endswith(", 2.3 s)")
