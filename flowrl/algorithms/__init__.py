"""Pure tensor math for RL on language models: advantages, losses, KL, log-probabilities.

Knows torch only: nothing here imports Dask, transformers or any other flowrl layer.
"""

from __future__ import annotations

from flowrl.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageEstimator, grpo_advantages
from flowrl.algorithms.kl import KL_ESTIMATORS, kl_penalty
from flowrl.algorithms.logprobs import token_entropy, token_logprobs
from flowrl.algorithms.losses import LOSS_AGGREGATIONS, aggregate, masked_mean, policy_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimator",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "aggregate",
    "grpo_advantages",
    "kl_penalty",
    "masked_mean",
    "policy_loss",
    "token_entropy",
    "token_logprobs",
]
