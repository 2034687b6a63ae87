"""Advantage estimators: per-sample credit from scalar rewards.

Only GRPO exists in this version. An estimator is looked up by the ``estimator`` field of an
advantage node in :data:`ADVANTAGE_ESTIMATORS`; "gae", "rloo" and "reinforce_pp" will join it.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor


class AdvantageEstimator(Protocol):
    """Turns one reward per sample into one advantage per sample."""

    def __call__(
        self, rewards: Tensor, group_size: int, scale_by_std: bool = True, epsilon: float = 1e-6
    ) -> Tensor: ...


def grpo_advantages(
    rewards: Tensor, group_size: int, scale_by_std: bool = True, epsilon: float = 1e-6
) -> Tensor:
    """Group-relative advantages (GRPO, Shao et al. 2024).

    ``rewards`` has shape ``[N]`` laid out group-contiguous: the ``group_size`` samples of
    prompt 0, then those of prompt 1, and so on. Each sample's advantage is
    ``(r - mean(group)) / (std(group) + epsilon)``, or ``r - mean(group)`` when
    ``scale_by_std`` is False (the Dr. GRPO variant, which avoids favouring prompts whose
    rewards barely vary).

    The group standard deviation is the unbiased one (Bessel's correction, divide by n - 1),
    as TRL's ``GRPOTrainer`` does with ``scale_rewards="group"``. A group of one sample has
    advantage 0 (its reward is its own mean) and no standard deviation is taken. A group whose
    rewards are all equal gets advantage 0 for every sample: it carries no learning signal.

    Returns a float32 tensor of shape ``[N]`` on the rewards' device; no gradient flows back
    into the rewards (they are data, not a function of the policy).
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape [N], got {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    num_samples = rewards.shape[0]
    if num_samples % group_size != 0:
        raise ValueError(
            f"{num_samples} rewards cannot be split into groups of {group_size}; "
            "the generate node must return n samples for every prompt"
        )
    grouped = rewards.detach().to(torch.float32).view(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_by_std and group_size > 1:
        std = grouped.std(dim=1, unbiased=True, keepdim=True)
        # A constant group stays at exactly 0 even with epsilon = 0 (no 0 / 0 = NaN).
        centered = torch.where(std > 0, centered / (std + epsilon), torch.zeros_like(centered))
    return centered.reshape(num_samples)


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": grpo_advantages,
}
"""Estimator name (the ``estimator`` field of an advantage node) -> function."""
