"""Policy-gradient and value (critic) losses over masked token tensors.

Shapes: ``[N, T]`` = N sequences (completions) of T token positions; ``mask`` is 1 (or True)
on the completion tokens that count and 0 on padding. Padding positions may hold anything,
even NaN or inf: every function here selects with ``torch.where`` before arithmetic, so a
padded value reaches neither the loss nor the gradient.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

LossAggregation = Literal["token_mean", "seq_mean", "token_sum_norm"]
LOSS_AGGREGATIONS: tuple[str, ...] = ("token_mean", "seq_mean", "token_sum_norm")


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


def aggregate(per_token: Tensor, mask: Tensor, loss_agg: LossAggregation, norm_tokens: int | None = None) -> Tensor:
    """Reduce a ``[N, T]`` per-token loss to a scalar.

    - ``token_mean``: sum over all unmasked tokens / number of unmasked tokens, so every token
      weighs the same and long completions weigh more (TRL's ``loss_type="bnpo"``; DAPO).
    - ``seq_mean``: mean over sequences of each sequence's own token mean, so every sequence
      weighs the same; sequences without any unmasked token are left out of the mean
      (TRL's ``loss_type="grpo"``, the original GRPO paper).
    - ``token_sum_norm``: sum over all unmasked tokens / (N x ``norm_tokens``), a constant
      (the most tokens a completion may have), so that neither a completion's length nor the
      batch's shapes the weight of a token (Dr. GRPO; TRL's ``loss_type="dr_grpo"``).

    Use the same rule for the KL term as for the policy term so their scales stay comparable.
    """
    if loss_agg == "token_mean":
        return masked_mean(per_token, mask)
    if loss_agg == "seq_mean":
        per_sequence = masked_mean(per_token, mask, dim=-1)
        has_tokens = mask.bool().any(dim=-1)
        return masked_mean(per_sequence, has_tokens)
    if loss_agg == "token_sum_norm":
        if norm_tokens is None or norm_tokens < 1:
            raise ValueError(f"loss_agg token_sum_norm needs norm_tokens >= 1, got {norm_tokens}")
        total = torch.where(mask.bool(), per_token, torch.zeros_like(per_token)).sum()
        return total / (per_token.shape[0] * norm_tokens)
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
    clip_eps_high: float | None = None,
    norm_tokens: int | None = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate loss (Schulman et al. 2017), as GRPO uses it.

    Per token: ``-min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps_high) * A)`` with
    ``ratio = exp(logprobs - old_logprobs)``; then reduced by :func:`aggregate`.
    This is the same per-token term as TRL's GRPOTrainer with ``epsilon_low = clip_eps`` and
    ``epsilon_high = clip_eps_high`` (DAPO's clip-higher when the upper range is wider).

    Args:
        logprobs: ``[N, T]`` log-probabilities of the sampled tokens under the policy being
            trained (carries the gradient).
        old_logprobs: ``[N, T]`` log-probabilities of the same tokens under the policy that
            sampled them (data, detached).
        advantages: ``[N]`` (one per sequence, broadcast over its tokens) or ``[N, T]``
            (data, detached).
        mask: ``[N, T]``, non-zero on the tokens that count.
        clip_eps: half-width of the trust region around ratio 1, e.g. 0.2.
        clip_eps_high: the region's upper half-width; None: ``clip_eps``.
        norm_tokens: the constant of ``token_sum_norm``, see :func:`aggregate`.
        token_weights: ``[N, T]`` factors of each token's term (data, detached), such as
            truncated importance weights between the sampling engine and this policy's
            forward; None: 1.
        loss_agg: ``"token_mean"``, ``"seq_mean"`` or ``"token_sum_norm"``, see :func:`aggregate`.

    Returns:
        ``(loss, stats)``: the scalar loss to minimise, and 0-dim tensors (detached, on the
        loss's device: reading them as numbers waits for the device) ``pg_clipfrac`` (share of
        unmasked tokens where the clipped term is the smaller one, so the token gives no
        gradient), ``ratio_mean`` (token mean of the ratio), ``ppo_kl`` (token mean of
        ``old_logprobs - logprobs``: how far the policy moved since the rollout) and
        ``pg_loss`` (the loss value). The names are verl's.
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
    high = clip_eps if clip_eps_high is None else clip_eps_high
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high) * advantages
    per_token = -torch.min(unclipped, clipped)
    if token_weights is not None:
        per_token = per_token * torch.where(selected, token_weights.detach().to(logprobs.dtype), zeros)
    loss = aggregate(per_token, selected, loss_agg, norm_tokens)
    with torch.no_grad():
        stats = {
            "pg_clipfrac": masked_mean((clipped < unclipped).to(logprobs.dtype), selected),
            "ratio_mean": masked_mean(ratio, selected),
            "ppo_kl": masked_mean(-log_ratio, selected),
            "pg_loss": loss.detach(),
        }
    return loss, stats


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_range_value: float | None,
    loss_agg: LossAggregation = "token_mean",
    norm_tokens: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value (critic) loss, as in PPO2's baselines, TRL's PPO and OpenRLHF.

    Per token: ``0.5 * max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2)`` with
    ``c = clip_range_value``; then reduced by :func:`aggregate`. Taking the max makes the loss
    pessimistic: a value that moved more than ``c`` away from ``v_old`` stops getting gradient
    when that move went past the return. ``clip_range_value=None`` gives the plain
    ``0.5 * (v - R)^2``. ``c`` is in reward units, so it must suit the scale of the rewards.

    Args:
        values: ``[N, T]`` critic values being trained (carries the gradient).
        old_values: ``[N, T]`` values from the critic that scored the rollout (data).
        returns: ``[N, T]`` value targets, e.g. GAE's ``advantages + values`` (data).
        mask: ``[N, T]``, non-zero on the tokens that count.
        clip_range_value: ``c`` above, > 0; None turns clipping off.
        norm_tokens: the constant of ``token_sum_norm``, see :func:`aggregate`.
        loss_agg: ``"token_mean"``, ``"seq_mean"`` or ``"token_sum_norm"``, see :func:`aggregate`.

    Returns:
        ``(loss, stats)``: the scalar loss and 0-dim tensors (as :func:`policy_loss`'s)
        ``vf_loss`` (the loss value),
        ``vf_clipfrac`` (share of unmasked tokens where the clipped error is the larger one,
        so the token gives no gradient) and ``vpred_mean`` (token mean of ``values``).
    """
    if not (values.shape == old_values.shape == returns.shape == mask.shape):
        raise ValueError(
            f"values {tuple(values.shape)}, old_values {tuple(old_values.shape)}, returns "
            f"{tuple(returns.shape)} and mask {tuple(mask.shape)} must have the same [N, T] shape"
        )
    if clip_range_value is not None and clip_range_value <= 0:
        raise ValueError(
            f"clip_range_value must be > 0 or None (no clipping), got {clip_range_value}"
        )
    selected = mask.bool()
    zeros = torch.zeros_like(values)
    values = torch.where(selected, values, zeros)
    old_values = torch.where(selected, old_values.detach().to(values.dtype), zeros)
    returns = torch.where(selected, returns.detach().to(values.dtype), zeros)
    unclipped = (values - returns) ** 2
    if clip_range_value is None:
        per_token = 0.5 * unclipped
        clipped_is_larger = torch.zeros_like(selected)
    else:
        clipped_values = old_values + torch.clamp(
            values - old_values, -clip_range_value, clip_range_value
        )
        clipped = (clipped_values - returns) ** 2
        per_token = 0.5 * torch.max(unclipped, clipped)
        clipped_is_larger = clipped > unclipped
    loss = aggregate(per_token, selected, loss_agg, norm_tokens)
    with torch.no_grad():
        stats = {
            "vf_loss": loss.detach(),
            "vf_clipfrac": masked_mean(clipped_is_larger.to(values.dtype), selected),
            "vpred_mean": masked_mean(values, selected),
        }
    return loss, stats
