"""Batches of the PPO roles (value, advantage with estimators, critic update)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PPOAdvantages:
    """What an advantage node with an estimator leaves for the update nodes.

    The policy update reads ``advantages`` (``run_update`` takes ``[N]`` and ``[N, T]``); the
    critic update reads ``returns`` as its targets.
    """

    advantages: torch.Tensor
    """``[N]`` (grpo, rloo) or ``[N, T]`` (gae, reinforce_pp) float32, 0 on padding."""
    returns: torch.Tensor | None
    """``[N, T]`` float32 value targets (gae), else None."""
    scores: torch.Tensor
    """``[N]`` summed score of every completion, before any KL penalty."""
    kl: torch.Tensor | None = None
    """``[N, T]`` per-token ``log p_policy - log p_ref`` used for the reward penalty, else None."""
    kl_coef: float = 0.0
    """Coefficient the KL reward penalty had this step (0 = off)."""

    @property
    def token_level(self) -> bool:
        return self.advantages.dim() == 2
