"""Reward functions: a registry of rule-based ones, user functions by 'module:function' or
by value (a callable given to the Python builder), called with TRL's keyword convention."""

from __future__ import annotations

from flowrl.rewards.builtin import (
    REWARD_FUNCTIONS,
    RewardFunction,
    completion_text,
    digit_match,
    exact_match,
    extract_answer,
    first_letter_match,
    length_penalty,
    math_answer,
    normalize_answer,
    regex_format,
    register_reward,
)
from flowrl.rewards.calling import FLOWRL_KEYWORDS, RewardInputs, call_reward, signature_problem
from flowrl.rewards.resolve import RewardCache, resolve_reward
from flowrl.rewards.safety import ScoreResult, score_safely

__all__ = [
    "RewardCache",
    "FLOWRL_KEYWORDS",
    "REWARD_FUNCTIONS",
    "RewardFunction",
    "RewardInputs",
    "ScoreResult",
    "call_reward",
    "completion_text",
    "digit_match",
    "exact_match",
    "extract_answer",
    "first_letter_match",
    "length_penalty",
    "math_answer",
    "normalize_answer",
    "regex_format",
    "register_reward",
    "resolve_reward",
    "score_safely",
    "signature_problem",
]
