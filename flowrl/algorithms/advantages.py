"""Advantage estimators: credit per completion (GRPO, RLOO) or per token (GAE, REINFORCE++).

The sequence-level math lives here and the per-token math in
:mod:`flowrl.algorithms.token_advantages`. An advantage node names its estimator in its
``estimator`` field, looked up in :data:`ADVANTAGE_ESTIMATORS`. Every registered estimator has
the same calling convention::

    result = ADVANTAGE_ESTIMATORS[name](inputs, settings)   # -> AdvantageResult

- :class:`AdvantageInputs` holds this step's data (scores, masks, critic values, KL, the KL
  coefficient of this step); an estimator reads the fields it needs and raises ``ValueError``
  naming a missing one.
- :class:`AdvantageSettings` holds the node's fixed hyperparameters (gamma, lambda, ...).
- :class:`AdvantageResult` holds ``advantages`` (``[N]`` for grpo and rloo, ``[N, T]`` for gae
  and reinforce_pp; :func:`flowrl.algorithms.losses.policy_loss` takes both) and ``returns``
  (the critic's ``[N, T]`` targets, gae only).

KL as a reward penalty: when ``inputs.kl`` is given and ``inputs.kl_coef`` is not 0, the
token-level estimators subtract ``kl_coef * kl_t`` from every token's reward and the
sequence-level ones subtract ``kl_coef * sum_t kl_t`` from the completion's score (the same
total, as TRL's RLOOTrainer does with ``beta``). KL as a loss term is the update node's job
and needs no input here.

:func:`grpo_advantages` and :func:`rloo_advantages` keep their plain tensor signatures for
direct callers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from flowrl.algorithms.token_advantages import (
    gae_advantages,
    reinforce_pp_advantages,
    sequence_reward_to_tokens,
)


@dataclass(frozen=True)
class AdvantageInputs:
    """One step's data for an advantage estimator; shapes ``[N]`` and ``[N, T]``.

    Rows are laid out group-contiguous: the ``group_size`` completions of prompt 0, then
    those of prompt 1, and so on.
    """

    scores: Tensor
    """``[N]`` reward per completion (several reward sources already summed with weights)."""
    group_size: int = 1
    """Completions per prompt; grpo and rloo compare the members of a group."""
    mask: Tensor | None = None
    """``[N, T]`` right-padded completion mask; needed by gae and reinforce_pp, and by the
    KL penalty."""
    values: Tensor | None = None
    """``[N, T]`` critic values of the sampled tokens; needed by gae."""
    kl: Tensor | None = None
    """``[N, T]`` per-token ``KL(policy || reference)`` estimate, for the reward penalty."""
    kl_coef: float = 0.0
    """Weight of the KL reward penalty this step (a KL controller may change it each step);
    0 turns the penalty off."""


@dataclass(frozen=True)
class AdvantageSettings:
    """Hyperparameters of an advantage node; each estimator reads the ones it uses."""

    gamma: float = 1.0
    """Discount per token (gae, reinforce_pp); 1.0 = no discount, the usual choice for text."""
    lam: float = 0.95
    """GAE lambda in [0, 1] (gae): 0 = one-step TD, 1 = Monte Carlo minus the value."""
    whiten: bool = True
    """Normalise gae advantages over the batch's unmasked tokens (reinforce_pp always does)."""
    scale_by_std: bool = True
    """Divide grpo advantages by the group's standard deviation (False = Dr. GRPO)."""
    epsilon: float = 1e-6
    """Added to grpo's group standard deviation before dividing."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma must be in [0, 1], got {self.gamma}")
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"lam must be in [0, 1], got {self.lam}")
        if self.epsilon < 0:
            raise ValueError(f"epsilon must be >= 0, got {self.epsilon}")


@dataclass(frozen=True)
class AdvantageResult:
    """What an estimator returns."""

    advantages: Tensor
    """``[N]`` (one per completion, broadcast over its tokens) or ``[N, T]`` (0 on padding)."""
    returns: Tensor | None = None
    """``[N, T]`` value targets for the critic (gae), else None."""


class AdvantageEstimator(Protocol):
    """The registry's calling convention, see the module docstring."""

    def __call__(self, inputs: AdvantageInputs, settings: AdvantageSettings) -> AdvantageResult: ...


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


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """REINFORCE leave-one-out advantages (Kool et al. 2019; Ahmadian et al. 2024).

    ``rewards`` is ``[N]``, group-contiguous as in :func:`grpo_advantages`. Each sample is
    compared with the mean of the *other* samples of its group:

        ``A_i = r_i - (sum_{j in group} r_j - r_i) / (k - 1) = k / (k - 1) * (r_i - mean(group))``

    with ``k = group_size``. The baseline does not depend on ``r_i``, so the estimate stays
    unbiased (GRPO's group mean includes the sample itself). This is the baseline of TRL's
    ``RLOOTrainer`` (without its optional ``normalize_advantages`` batch scaling). Needs
    ``group_size >= 2``. Returns float32 ``[N]``, no gradient.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape [N], got {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(
            f"RLOO needs at least 2 samples per prompt to form a leave-one-out baseline, got "
            f"group_size={group_size}; sample n >= 2 completions per prompt or use 'grpo'"
        )
    num_samples = rewards.shape[0]
    if num_samples % group_size != 0:
        raise ValueError(
            f"{num_samples} rewards cannot be split into groups of {group_size}; "
            "the generate node must return n samples for every prompt"
        )
    grouped = rewards.detach().to(torch.float32).view(-1, group_size)
    baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - baseline).reshape(num_samples)


def _require(inputs: AdvantageInputs, estimator: str, *names: str) -> None:
    missing = [name for name in names if getattr(inputs, name) is None]
    if missing:
        raise ValueError(
            f"advantage estimator {estimator!r} needs {' and '.join(missing)} in its inputs, "
            "which were not given; give the advantage node the inputs that produce them "
            "(the generate node for mask, a value node for values)"
        )


def _kl_penalty_active(inputs: AdvantageInputs) -> bool:
    return inputs.kl is not None and inputs.kl_coef != 0.0


def _penalised_scores(inputs: AdvantageInputs, estimator: str) -> Tensor:
    """Sequence score minus ``kl_coef * sum_t kl_t`` when the KL penalty is on."""
    scores = inputs.scores.detach().to(torch.float32)
    if not _kl_penalty_active(inputs):
        return scores
    _require(inputs, estimator, "mask")
    assert inputs.mask is not None and inputs.kl is not None
    kl = inputs.kl.detach().to(torch.float32)
    kl_sum = torch.where(inputs.mask.bool(), kl, torch.zeros_like(kl)).sum(dim=-1)
    return scores - inputs.kl_coef * kl_sum


def _token_rewards(inputs: AdvantageInputs) -> Tensor:
    assert inputs.mask is not None
    kl = inputs.kl if _kl_penalty_active(inputs) else None
    return sequence_reward_to_tokens(inputs.scores, inputs.mask, kl, inputs.kl_coef)


def _grpo(inputs: AdvantageInputs, settings: AdvantageSettings) -> AdvantageResult:
    scores = _penalised_scores(inputs, "grpo")
    advantages = grpo_advantages(
        scores, inputs.group_size, scale_by_std=settings.scale_by_std, epsilon=settings.epsilon
    )
    return AdvantageResult(advantages)


def _rloo(inputs: AdvantageInputs, settings: AdvantageSettings) -> AdvantageResult:
    return AdvantageResult(rloo_advantages(_penalised_scores(inputs, "rloo"), inputs.group_size))


def _gae(inputs: AdvantageInputs, settings: AdvantageSettings) -> AdvantageResult:
    _require(inputs, "gae", "mask", "values")
    assert inputs.mask is not None and inputs.values is not None
    advantages, returns = gae_advantages(
        _token_rewards(inputs),
        inputs.values,
        inputs.mask,
        gamma=settings.gamma,
        lam=settings.lam,
        whiten=settings.whiten,
    )
    return AdvantageResult(advantages, returns)


def _reinforce_pp(inputs: AdvantageInputs, settings: AdvantageSettings) -> AdvantageResult:
    _require(inputs, "reinforce_pp", "mask")
    assert inputs.mask is not None
    advantages = reinforce_pp_advantages(_token_rewards(inputs), inputs.mask, gamma=settings.gamma)
    return AdvantageResult(advantages)


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": _grpo,
    "rloo": _rloo,
    "gae": _gae,
    "reinforce_pp": _reinforce_pp,
}
"""Estimator name (the ``estimator`` field of an advantage node) -> estimator with the
uniform ``(AdvantageInputs, AdvantageSettings) -> AdvantageResult`` convention."""
