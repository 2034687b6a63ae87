"""Per-token KL penalty estimators between the policy and a frozen reference.

Both estimate ``KL(policy || reference)`` from tokens sampled by the policy, using only the
log-probabilities of the sampled tokens (Schulman, "Approximating KL Divergence", 2020).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

KlEstimatorName = Literal["k1", "k3"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k3")

LOG_RATIO_CLAMP = 20.0
"""k3 clamps ``ref - logp`` to [-20, 20] before ``exp``: one token whose log-probability
collapsed under the policy (e.g. -80 vs -2) would otherwise give ``exp(78)`` and an inf/NaN
loss that destroys the whole update. exp(20) is about 4.9e8, still a very strong penalty."""


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: KlEstimatorName = "k3") -> Tensor:
    """Per-token KL estimate, same shape as ``logprobs``.

    - ``k1 = logp - logp_ref``: unbiased, but negative on some tokens and high variance.
    - ``k3 = exp(logp_ref - logp) - (logp_ref - logp) - 1``: unbiased and always >= 0
      (``e^x - x - 1 >= 0``), lower variance. It is the estimator TRL's GRPOTrainer uses for
      its ``beta`` term. The log-ratio is clamped, see :data:`LOG_RATIO_CLAMP`.

    Gradients flow into ``logprobs``; ``ref_logprobs`` is treated as data. Masking is the
    caller's job (use :func:`flowrl.algorithms.losses.masked_mean`).
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} "
            "must have the same shape"
        )
    ref_logprobs = ref_logprobs.detach()
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k3":
        log_ratio = torch.clamp(ref_logprobs - logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(
        f"unknown KL estimator {estimator!r}; expected one of {', '.join(KL_ESTIMATORS)}"
    )
