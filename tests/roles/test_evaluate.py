"""Evaluation metrics on hand-made scores: mean, mean@n and pass@n over prompt groups."""

from __future__ import annotations

from flowrl.roles.evaluate import _score_metrics


def test_pass_at_n_counts_prompts_with_any_positive_completion() -> None:
    # 3 prompts x n=2, consecutive: [0, 1] [0, 0] [1, 1] -> mean 3/6 = 0.5; pass@2 = 2/3
    metrics = _score_metrics("acc", [0.0, 1.0, 0.0, 0.0, 1.0, 1.0], n=2)
    assert metrics == {"val/acc/mean": 0.5, "val/acc/mean@2": 0.5, "val/acc/pass@2": 2 / 3}


def test_one_sample_per_prompt_has_only_the_mean() -> None:
    assert _score_metrics("acc", [1.0, 0.0, 0.0, 0.0], n=1) == {"val/acc/mean": 0.25}
