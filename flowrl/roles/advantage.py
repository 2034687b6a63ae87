"""The ``advantage`` role: turn scores into one advantage per completion."""

from __future__ import annotations

from typing import Any

import torch

from flowrl.algorithms.advantages import grpo_advantages
from flowrl.roles.batch import NodeOutput, Scores


def run_advantage(scores: list[Scores], group_size: int, node: Any) -> NodeOutput:
    """Several score inputs add up (each already carries its weight)."""
    total = torch.stack([s.values for s in scores]).sum(dim=0)
    if node.estimator != "grpo":
        raise NotImplementedError(f"advantage estimator {node.estimator!r}")
    advantages = grpo_advantages(total, group_size, scale_by_std=node.scale_by_std, epsilon=node.epsilon)
    groups = total.view(-1, group_size)
    metrics = {
        "critic/advantages/mean": float(advantages.mean()),
        "critic/advantages/max": float(advantages.max()),
        "critic/advantages/min": float(advantages.min()),
        # Groups whose samples all scored the same teach nothing under GRPO.
        "critic/zero_std_groups": float((groups.std(dim=1) == 0).float().mean()) if group_size > 1 else 1.0,
    }
    return NodeOutput(value=advantages, metrics=metrics)
