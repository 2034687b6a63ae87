"""Policy-gradient losses over masked token tensors.

Shapes: ``[N, T]`` = N sequences (completions) of T token positions; ``mask`` is 1 (or True)
on the completion tokens that count and 0 on padding. Padding positions may hold anything,
even NaN or inf: every function here selects with ``torch.where`` before arithmetic, so a
padded value reaches neither the loss nor the gradient.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

LossAggregation = Literal["token_mean", "seq_mean"]
LOSS_AGGREGATIONS: tuple[str, ...] = ("token_mean", "seq_mean")


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over the positions where ``mask`` is non-zero.

    With ``dim`` given, the mean is taken along that dimension only. Where no position is
    selected the result is 0 (not NaN), so an all-padding row or batch adds nothing.
    """
    selected = mask.bool()
    values = torch.where(selected, x, torch.zeros_like(x))
    if dim is None:
        return values.sum() / selected.sum().clamp(min=1)
    return values.sum(dim=dim) / selected.sum(dim=dim).clamp(min=1)


def aggregate(per_token: Tensor, mask: Tensor, loss_agg: LossAggregation) -> Tensor:
    """Reduce a ``[N, T]`` per-token loss to a scalar.

    - ``token_mean``: sum over all unmasked tokens / number of unmasked tokens, so every token
      weighs the same and long completions weigh more (TRL's ``loss_type="bnpo"``; DAPO).
    - ``seq_mean``: mean over sequences of each sequence's own token mean, so every sequence
      weighs the same; sequences without any unmasked token are left out of the mean
      (TRL's ``loss_type="grpo"``, the original GRPO paper).

    Use the same rule for the KL term as for the policy term so their scales stay comparable.
    """
    if loss_agg == "token_mean":
        return masked_mean(per_token, mask)
    if loss_agg == "seq_mean":
        per_sequence = masked_mean(per_token, mask, dim=-1)
        has_tokens = mask.bool().any(dim=-1)
        return masked_mean(per_sequence, has_tokens)
    raise ValueError(
        f"unknown loss_agg {loss_agg!r}; expected one of {', '.join(LOSS_AGGREGATIONS)}"
    )


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float,
    loss_agg: LossAggregation = "token_mean",
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate loss (Schulman et al. 2017), as GRPO uses it.

    Per token: ``-min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps) * A)`` with
    ``ratio = exp(logprobs - old_logprobs)``; then reduced by :func:`aggregate`.
    This is the same per-token term as TRL's GRPOTrainer with ``epsilon_low == epsilon_high``.

    Args:
        logprobs: ``[N, T]`` log-probabilities of the sampled tokens under the policy being
            trained (carries the gradient).
        old_logprobs: ``[N, T]`` log-probabilities of the same tokens under the policy that
            sampled them (data, detached).
        advantages: ``[N]`` (one per sequence, broadcast over its tokens) or ``[N, T]``
            (data, detached).
        mask: ``[N, T]``, non-zero on the tokens that count.
        clip_eps: half-width of the trust region around ratio 1, e.g. 0.2.
        loss_agg: ``"token_mean"`` or ``"seq_mean"``, see :func:`aggregate`.

    Returns:
        ``(loss, stats)``: the scalar loss to minimise, and floats ``clipfrac`` (share of
        unmasked tokens where the clipped term is the smaller one, so the token gives no
        gradient), ``ratio_mean`` (token mean of the ratio) and ``pg_loss`` (the loss value).
    """
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and "
            f"mask {tuple(mask.shape)} must have the same [N, T] shape"
        )
    if advantages.dim() == 1 and advantages.shape[0] == logprobs.shape[0]:
        advantages = advantages.unsqueeze(-1).expand_as(logprobs)
    if advantages.shape != logprobs.shape:
        raise ValueError(
            f"advantages must have shape [N] or [N, T] = {tuple(logprobs.shape)}, "
            f"got {tuple(advantages.shape)}"
        )
    selected = mask.bool()
    zeros = torch.zeros_like(logprobs)
    # Select before exp so a garbage value at a padded position cannot become inf/NaN and
    # poison the gradient through exp's backward (0 * inf = NaN).
    log_ratio = torch.where(selected, logprobs - old_logprobs.detach(), zeros)
    advantages = torch.where(selected, advantages.detach().to(logprobs.dtype), zeros)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    per_token = -torch.min(unclipped, clipped)
    loss = aggregate(per_token, selected, loss_agg)
    with torch.no_grad():
        stats = {
            "clipfrac": float(masked_mean((clipped < unclipped).to(logprobs.dtype), selected)),
            "ratio_mean": float(masked_mean(ratio, selected)),
            "pg_loss": float(loss),
        }
    return loss, stats
