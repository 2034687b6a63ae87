"""Per-token rewards, returns and advantages: GAE, REINFORCE++ and masked whitening.

Shapes: ``[N, T]`` = N completions of T token positions, **right-padded**: each row's counted
tokens are positions ``0 .. L-1`` and ``mask`` is 0 from ``L`` on. The episode ends at the last
unmasked token and the value after it is 0 (no bootstrap): a completion is a whole episode.
This is the convention of OpenRLHF's ``get_advantages_and_returns`` and of TRL's PPOTrainer
up to TRL 0.x (TRL 1.x no longer ships PPO). Padding positions may hold anything, even NaN:
inputs are selected with ``torch.where`` before any arithmetic, and every result is exactly 0
on padding.

Everything returned is float32 data with no gradient: advantages and returns are targets, not
functions of the model being trained.
"""

from __future__ import annotations

import torch
from torch import Tensor

WHITEN_EPSILON = 1e-8
"""Added to the variance before ``rsqrt`` in :func:`masked_whiten` (TRL's and OpenRLHF's value)."""


def _check_right_padded(mask: Tensor, name: str = "mask") -> Tensor:
    if mask.dim() != 2:
        raise ValueError(f"{name} must have shape [N, T], got {tuple(mask.shape)}")
    selected = mask.bool()
    # Right-padded means the mask never goes 0 -> 1 along a row.
    if (selected[:, 1:] & ~selected[:, :-1]).any():
        raise ValueError(
            f"{name} must be right-padded (each row's tokens first, then padding); found a row "
            "with a masked position before an unmasked one. Pass the completion mask, not the "
            "prompt + completion attention mask."
        )
    return selected


def _check_same_shape(mask: Tensor, **tensors: Tensor) -> None:
    for name, tensor in tensors.items():
        if tensor.shape != mask.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but mask has {tuple(mask.shape)}; "
                "both must be [N, T]"
            )


def _selected_float(x: Tensor, selected: Tensor) -> Tensor:
    x = x.detach().to(torch.float32)
    return torch.where(selected, x, torch.zeros_like(x))


def masked_whiten(
    x: Tensor,
    mask: Tensor,
    shift_mean: bool = True,
    unbiased: bool = True,
    epsilon: float = WHITEN_EPSILON,
) -> Tensor:
    """Normalise ``x`` by the mean and variance of its unmasked entries (the whole batch).

    ``(x - mean) / sqrt(var + epsilon)``; with ``shift_mean=False`` the mean is added back,
    so only the scale changes (how TRL's PPO whitened rewards). ``unbiased`` applies Bessel's
    correction ``n / (n - 1)`` to the variance, as TRL's ``masked_var`` and ``nanstd`` do;
    OpenRLHF divides by ``n`` (``unbiased=False``). With fewer than two unmasked entries the
    variance is taken as 0. Padded positions come back as 0.
    """
    selected = mask.bool()
    if x.shape != selected.shape:
        raise ValueError(
            f"x {tuple(x.shape)} and mask {tuple(mask.shape)} must have the same shape"
        )
    values = _selected_float(x, selected)
    count = selected.sum()
    mean = values.sum() / count.clamp(min=1)
    centered = torch.where(selected, values - mean, torch.zeros_like(values))
    sum_sq = (centered**2).sum()
    if unbiased:
        variance = torch.where(
            count > 1, sum_sq / (count - 1).clamp(min=1), torch.zeros_like(sum_sq)
        )
    else:
        variance = sum_sq / count.clamp(min=1)
    whitened = centered * torch.rsqrt(variance + epsilon)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(selected, whitened, torch.zeros_like(whitened))


def sequence_reward_to_tokens(
    scores: Tensor, mask: Tensor, kl_per_token: Tensor | None = None, kl_coef: float = 0.0
) -> Tensor:
    """Token rewards ``[N, T]`` from one score per completion and an optional KL penalty.

    ``r_t = -kl_coef * kl_t`` on every unmasked token, plus ``scores[i]`` on the last unmasked
    token of row ``i`` (the reward model judges the finished completion). This is the KL as a
    per-token reward penalty of Ziegler et al. 2019, TRL's PPO (``non_score_reward``) and
    OpenRLHF's ``compute_reward``. ``kl_per_token`` is the estimate of
    ``KL(policy || reference)`` per sampled token, e.g. ``logp - logp_ref``
    (:func:`flowrl.algorithms.kl.kl_penalty` with ``"k1"``). A row without unmasked tokens
    gets no reward: it has no token to credit.
    """
    selected = _check_right_padded(mask)
    if scores.shape != (mask.shape[0],):
        raise ValueError(
            f"scores must have shape [N] = ({mask.shape[0]},), got {tuple(scores.shape)}"
        )
    rewards = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    if kl_per_token is not None and kl_coef != 0.0:
        _check_same_shape(mask, kl_per_token=kl_per_token)
        rewards = -kl_coef * _selected_float(kl_per_token, selected)
    lengths = selected.sum(dim=-1)
    has_tokens = lengths > 0
    rows = torch.arange(mask.shape[0], device=mask.device)[has_tokens]
    last = lengths[has_tokens] - 1
    rewards[rows, last] += scores.detach().to(torch.float32)[has_tokens]
    return rewards


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """``G_t = sum_{s >= t} gamma^(s - t) r_s`` within each row's episode; 0 on padding."""
    selected = _check_right_padded(mask)
    _check_same_shape(mask, token_rewards=token_rewards)
    rewards = _selected_float(token_rewards, selected)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    # Padding rewards are 0, so the running sum is still 0 when it reaches a row's last token.
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    return torch.where(selected, returns, torch.zeros_like(returns))


def gae_advantages(
    token_rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
    whiten: bool = True,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over right-padded completions.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` with ``V_{t+1} = 0`` after the last unmasked
    token; ``A_t = delta_t + gamma * lam * A_{t+1}``; the value targets are
    ``returns = A + V`` (before whitening). With ``whiten`` the advantages are normalised over
    all unmasked tokens of the batch (:func:`masked_whiten`, Bessel-corrected, mean shifted to
    0), as TRL's PPO did; the returns are never whitened.

    Args:
        token_rewards: ``[N, T]`` reward per token, e.g. from :func:`sequence_reward_to_tokens`.
        values: ``[N, T]`` critic value of the state before each token is generated.
        mask: ``[N, T]`` right-padded completion mask.
        gamma: discount per token; 1.0 for language (TRL's and OpenRLHF's default).
        lam: GAE lambda, 0 = one-step TD (low variance, biased by the critic), 1 = Monte Carlo
            returns minus the value (unbiased, high variance); 0.95 by default.
        whiten: normalise the advantages over the batch.

    Returns:
        ``(advantages, returns)``, both float32 ``[N, T]`` and 0 on padding.
    """
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must be in [0, 1], got gamma={gamma}, lam={lam}")
    selected = _check_right_padded(mask)
    _check_same_shape(mask, token_rewards=token_rewards, values=values)
    rewards = _selected_float(token_rewards, selected)
    values = _selected_float(values, selected)
    num_positions = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    # Padding holds r = 0 and V = 0, so delta = 0 there and the recursion reaches each row's
    # last token with A_{t+1} = 0 and V_{t+1} = 0: the episode ends without a bootstrap.
    for t in reversed(range(num_positions)):
        next_values = values[:, t + 1] if t + 1 < num_positions else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        running = delta + gamma * lam * running
        advantages[:, t] = running
    returns = torch.where(selected, advantages + values, torch.zeros_like(values))
    if whiten:
        advantages = masked_whiten(advantages, selected)
    advantages = torch.where(selected, advantages, torch.zeros_like(advantages))
    return advantages, returns


def reinforce_pp_advantages(
    token_rewards: Tensor, mask: Tensor, gamma: float = 1.0, epsilon: float = WHITEN_EPSILON
) -> Tensor:
    """REINFORCE++ advantages (Hu et al. 2025, arXiv:2501.03262), as OpenRLHF computes them.

    The token rewards carry the KL penalty on every token and the score on the last one
    (build them with :func:`sequence_reward_to_tokens`), so the return is

        ``G_t = sum_{s >= t} gamma^(s - t) r_s
              = gamma^(L-1-t) * score - kl_coef * sum_{s >= t} gamma^(s - t) kl_s``

    and the advantage is that return normalised over every unmasked token of the batch (no
    critic, no per-prompt group):

        ``A_t = (G_t - mean(G)) / sqrt(var(G) + epsilon)``,

    with the mean and the (biased, divide-by-n) variance over all unmasked tokens, as in
    OpenRLHF's batch advantage normalisation. ``gamma`` is 1.0 in the paper. Returns float32
    ``[N, T]``, 0 on padding.
    """
    returns = discounted_returns(token_rewards, mask, gamma)
    return masked_whiten(returns, mask, shift_mean=True, unbiased=False, epsilon=epsilon)
