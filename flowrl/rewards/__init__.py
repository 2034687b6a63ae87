"""Reward functions: a registry of rule-based ones, user functions by 'module:function'."""

from __future__ import annotations

from flowrl.rewards.builtin import (
    REWARD_FUNCTIONS,
    RewardFunction,
    digit_match,
    exact_match,
    first_letter_match,
    register_reward,
)
from flowrl.rewards.resolve import resolve_reward
from flowrl.rewards.safety import score_safely

__all__ = [
    "REWARD_FUNCTIONS",
    "RewardFunction",
    "digit_match",
    "exact_match",
    "first_letter_match",
    "register_reward",
    "resolve_reward",
    "score_safely",
]
