"""The ``score`` role: one reward per completion from a rule-based function."""

from __future__ import annotations

from typing import Callable

import torch

from flowrl.rewards import score_safely
from flowrl.roles.batch import NodeOutput, Rollout, Scores


def run_score(
    rollout: Rollout, reward_fn: Callable[..., list[float]], weight: float, on_error: str, name: str | None = None
) -> NodeOutput:
    values, num_failed = score_safely(
        reward_fn,
        rollout.prompts,
        rollout.completions,
        rollout.answers,
        rollout.max_new_tokens,
        on_error=on_error,
        name=name,
    )
    scores = Scores(values=torch.tensor(values, dtype=torch.float32) * weight, num_failed=num_failed)
    return NodeOutput(value=scores, metrics=score_metrics(scores, with_failures=True), tokens_in=rollout.num_completion_tokens)


def score_metrics(scores: Scores, with_failures: bool) -> dict[str, float]:
    """``critic/score/*`` of a batch; ``reward/num_failed`` for rule-based functions."""
    tensor = scores.values
    metrics = {
        "critic/score/mean": float(tensor.mean()),
        "critic/score/max": float(tensor.max()),
        "critic/score/min": float(tensor.min()),
    }
    if with_failures:
        metrics["reward/num_failed"] = float(scores.num_failed)
    return metrics
