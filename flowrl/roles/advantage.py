"""The ``advantage`` role: scores (and values) -> advantages, with any registered estimator
(grpo, rloo, gae, reinforce_pp).

Dataflow of one step (PPO with a critic and a reward model; GRPO has only the score)::

    rollout --+--> score (fn or reward model) --> scores   [N]    --+
              +--> value (critic) --------------> values   [N, T] --+--> advantage
              +--> reference_logprob -----------> ref logp [N, T] --+      |
              +--> (rollout.sampled_logprobs = policy logp [N, T], mask) --+
    advantage --> advantages --> update (actor)
              --> returns ----> update (critic, with the value node's values as old values)

KL as a reward penalty: with ``kl_coef > 0`` each token's reward gets
``-kl_coef * (log p_policy - log p_ref)`` (the k1 estimate, as TRL's PPO and OpenRLHF do);
the coefficient comes from the caller so a KL controller can change it every step.
"""

from __future__ import annotations

import torch

from flowrl.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs, AdvantageSettings
from flowrl.algorithms.losses import masked_mean
from flowrl.roles.batch import Advantages, NodeOutput, Scores
from flowrl.spec.schema import AdvantageNode


def advantage_settings(node: AdvantageNode) -> AdvantageSettings:
    return AdvantageSettings(gamma=node.gamma, lam=node.lam, whiten=node.whiten, scale_by_std=node.scale_by_std,
                             epsilon=node.epsilon)


def run_advantage(
    scores: list[Scores],
    values: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    policy_logprobs: torch.Tensor | None,
    mask: torch.Tensor | None,
    group_size: int,
    node: AdvantageNode,
    kl_coef: float = 0.0,
) -> NodeOutput:
    """Advantages (and gae's returns) of one rollout; several score inputs add up (each
    already carries its weight)."""
    if not scores:
        raise ValueError("an advantage node needs at least one score input")
    estimator = ADVANTAGE_ESTIMATORS.get(node.estimator)
    if estimator is None:
        raise ValueError(
            f"unknown advantage estimator {node.estimator!r}; "
            f"expected one of {', '.join(ADVANTAGE_ESTIMATORS)}"
        )
    total = torch.stack([s.values.float() for s in scores]).sum(dim=0)
    kl: torch.Tensor | None = None
    if kl_coef > 0:
        if ref_logprobs is None or policy_logprobs is None or mask is None:
            raise ValueError(
                "a KL reward penalty needs the policy's and the reference's log-probs and the "
                "completion mask; give the advantage node a reference_logprob input"
            )
        kl = policy_logprobs.float() - ref_logprobs.float()
    inputs = AdvantageInputs(
        scores=total,
        group_size=group_size,
        mask=None if mask is None else mask.bool(),
        values=None if values is None else values.float(),
        kl=kl,
        kl_coef=float(kl_coef),
    )
    result = estimator(inputs, advantage_settings(node))
    output = Advantages(advantages=result.advantages, returns=result.returns, scores=total, kl=kl,
                        kl_coef=float(kl_coef))
    return NodeOutput(value=output, metrics=_metrics(output, mask, group_size, node.estimator))


def _metrics(output: Advantages, mask: torch.Tensor | None, group_size: int, estimator: str) -> dict[str, float]:
    advantages = output.advantages
    if output.token_level:
        assert mask is not None
        selected = mask.bool()
        counted = advantages[selected]
        mean = float(masked_mean(advantages, selected))
    else:
        counted = advantages
        mean = float(advantages.mean())
    metrics = {
        "critic/advantages/mean": mean,
        "critic/advantages/max": float(counted.max()) if counted.numel() else 0.0,
        "critic/advantages/min": float(counted.min()) if counted.numel() else 0.0,
        "critic/rewards/mean": float(output.scores.mean()),
        # the extremes of the sequences' total score (several score nodes' sum): the score
        # nodes' own extremes do not add up to them
        "critic/score/max": float(output.scores.max()) if output.scores.numel() else 0.0,
        "critic/score/min": float(output.scores.min()) if output.scores.numel() else 0.0,
    }
    if output.kl is not None and mask is not None and output.kl_coef != 0.0:
        # verl's critic/rewards: each sequence's reward with the KL penalty in it (the sum of
        # its token rewards), where critic/score is the score alone
        selected = mask.bool()
        kl_sum = torch.where(selected, output.kl, torch.zeros_like(output.kl)).sum(dim=1)
        metrics["critic/rewards/mean"] = float((output.scores - output.kl_coef * kl_sum).mean())
    if estimator in ("grpo", "rloo"):
        groups = output.scores.view(-1, group_size)
        # Groups whose samples all scored the same teach nothing to a group baseline.
        metrics["critic/zero_std_groups"] = (
            float((groups.std(dim=1) == 0).float().mean()) if group_size > 1 else 1.0
        )
    if output.returns is not None and mask is not None:
        metrics["critic/returns/mean"] = float(masked_mean(output.returns, mask.bool()))
    if output.kl is not None and mask is not None:
        selected = mask.bool()
        kl = torch.where(selected, output.kl, torch.zeros_like(output.kl))
        # The per-sequence sum is what an adaptive KL controller is fed (TRL's PPO measure).
        metrics["critic/kl/sequence_mean"] = float(kl.sum(dim=1).mean())
        metrics["critic/kl/token_mean"] = float(masked_mean(kl, selected))
        # verl's names: the mean over sequences of each one's token-mean KL, and its weight
        per_sequence = kl.sum(dim=1) / selected.sum(dim=1).clamp(min=1)
        metrics["actor/reward_kl_penalty"] = float(per_sequence.mean())
        metrics["actor/reward_kl_penalty_coeff"] = output.kl_coef
    return metrics
