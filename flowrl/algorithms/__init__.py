"""Pure tensor math for RL on language models: advantages, losses, KL, log-probabilities.

Knows torch only: nothing here imports Dask, transformers or any other flowrl layer.
"""

from __future__ import annotations

from flowrl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    AdvantageInputs,
    AdvantageResult,
    AdvantageSettings,
    grpo_advantages,
    rloo_advantages,
)
from flowrl.algorithms.kl import KL_ESTIMATORS, kl_penalty
from flowrl.algorithms.kl_control import AdaptiveKLController, FixedKLController, KLController
from flowrl.algorithms.logprobs import token_entropy, token_logprobs
from flowrl.algorithms.losses import (
    LOSS_AGGREGATIONS,
    aggregate,
    masked_mean,
    policy_loss,
    value_loss,
)
from flowrl.algorithms.token_advantages import (
    discounted_returns,
    gae_advantages,
    masked_whiten,
    reinforce_pp_advantages,
    sequence_reward_to_tokens,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "AdvantageInputs",
    "AdvantageResult",
    "AdvantageSettings",
    "FixedKLController",
    "KLController",
    "aggregate",
    "discounted_returns",
    "gae_advantages",
    "grpo_advantages",
    "kl_penalty",
    "masked_mean",
    "masked_whiten",
    "policy_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "sequence_reward_to_tokens",
    "token_entropy",
    "token_logprobs",
    "value_loss",
]
