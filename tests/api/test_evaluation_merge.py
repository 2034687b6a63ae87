"""Evaluation split over the generate node's workers: the parts' metrics join into the whole's."""

from __future__ import annotations

from flowrl.api.evaluation import merge_parts


def test_parts_merge_by_their_number_of_prompts() -> None:
    # part 1: 3 prompts, mean 1/3, pass@2 2/3, 1 failure; part 2: 1 prompt, mean 1.0, pass 1.0
    # whole: mean (3 * 1/3 + 1 * 1) / 4 = 0.5; pass@2 (3 * 2/3 + 1) / 4 = 0.75; 1 failure; 4 prompts
    first = {"val/num_prompts": 3.0, "val/r/mean": 1 / 3, "val/r/pass@2": 2 / 3, "val/r/num_failed": 1.0}
    second = {"val/num_prompts": 1.0, "val/r/mean": 1.0, "val/r/pass@2": 1.0, "val/r/num_failed": 0.0}
    merged = merge_parts([first, second])
    assert merged == {"val/num_prompts": 4.0, "val/r/mean": 0.5, "val/r/pass@2": 0.75, "val/r/num_failed": 1.0}
    assert merge_parts([first]) == first
