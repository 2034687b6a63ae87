"""The ``score`` role: one reward per completion from a reward function."""

from __future__ import annotations

from typing import Any, Callable

import torch

from flowrl.rewards import RewardInputs, score_safely
from flowrl.roles.batch import NodeOutput, Rollout, Scores


def reward_inputs(rollout: Rollout) -> RewardInputs:
    """The rollout as a reward function sees it (TRL's keywords)."""
    completions: list[Any] = list(rollout.completions)
    if rollout.chat:
        completions = [[{"role": "assistant", "content": text}] for text in completions]
    return RewardInputs(
        prompts=list(rollout.data_prompts or rollout.prompts),
        completions=completions,
        completion_ids=rollout.completion_token_lists(),
        max_new_tokens=rollout.max_new_tokens,
        columns={name: list(values) for name, values in rollout.columns.items()},
    )


def run_score(
    rollout: Rollout,
    reward_fn: Callable[..., Any],
    weight: float,
    on_error: str,
    name: str | None = None,
    params: dict[str, Any] | None = None,
) -> NodeOutput:
    result = score_safely(reward_fn, reward_inputs(rollout), params or {}, on_error=on_error, name=name)  # type: ignore[arg-type]
    scores = Scores(
        values=torch.tensor(result.scores, dtype=torch.float32) * weight,
        num_failed=result.num_failed,
        num_none=result.num_none,
        first_error=result.first_error,
        batch_error=result.batch_error,
    )
    return NodeOutput(
        value=scores,
        metrics=score_metrics(scores, with_failures=True),
        tokens_in=rollout.num_completion_tokens,
        messages=scores.messages(),
    )


def score_metrics(scores: Scores, with_failures: bool) -> dict[str, float]:
    """``critic/score/*`` of a batch; failure counts and share for reward functions."""
    tensor = scores.values
    metrics = {
        "critic/score/mean": float(tensor.mean()),
        "critic/score/max": float(tensor.max()),
        "critic/score/min": float(tensor.min()),
    }
    if with_failures:
        metrics["reward/num_failed"] = float(scores.num_failed)
        metrics["reward/failed_share"] = scores.num_failed / max(1, int(tensor.numel()))
        metrics["reward/num_none"] = float(scores.num_none)
        metrics["reward/none_share"] = scores.num_none / max(1, int(tensor.numel()))
        # 1: the call on the whole batch raised, and each sample was scored alone
        metrics["reward/batch_failed"] = 1.0 if scores.batch_error else 0.0
    return metrics
