"""A few rows of a step's outputs as plain values, for the run's ``samples.jsonl``: what the
policy wrote for which prompt, what each score node gave it, and its advantage."""

from __future__ import annotations

from typing import Any

from flowrl.roles.batch import Advantages, Rollout, Scores


def sample_rows(value: Any, rows: int) -> list[dict[str, Any]]:
    """The first ``rows`` rows of a node's output: a rollout's prompt, completion and answer,
    a score node's reward, an advantage node's advantage (one per sequence; a per-token
    estimator's is left out). Anything else gives no rows."""
    if isinstance(value, Rollout):
        count = min(rows, value.num_sequences)
        return [{"prompt": value.prompts[i], "completion": value.completions[i], "answer": _plain(value.answers[i])}
                for i in range(count)]
    if isinstance(value, Scores):
        return [{"reward": float(score)} for score in value.values[:rows].tolist()]
    if isinstance(value, Advantages) and value.advantages.dim() == 1:
        return [{"advantage": float(advantage)} for advantage in value.advantages[:rows].tolist()]
    return []


def _plain(value: Any) -> Any:
    """A value JSON writes as it is (a dataset's answer may be any type)."""
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)
