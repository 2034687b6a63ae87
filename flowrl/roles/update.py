"""The ``update`` role for a policy: PPO-clipped GRPO loss with an optional KL term.

One call consumes one rollout: ``ppo_epochs`` passes over it in shuffled mini-batches of
``mini_batch_size`` sequences, one optimizer step per mini-batch. The "old" log-probs of
the ratio are computed once per rollout, before the first step; when there is a single
step (one epoch, one mini-batch) they equal the current ones, so the forward pass that
computes the loss provides them (detached) and no extra pass is made.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from flowrl.algorithms.kl import kl_penalty
from flowrl.algorithms.losses import aggregate, policy_loss
from flowrl.roles.batch import NodeOutput, Rollout
from flowrl.roles.data_parallel import DataParallel
from flowrl.roles.forward import completion_logprobs, micro_batches
from flowrl.roles.state import ModelState


TOKEN_MEANS = ("actor/clipfrac", "actor/ratio_mean")
NONFINITE_METRIC = "actor/nonfinite_skipped"
"""1.0 when an optimizer step was skipped because its loss or gradient was NaN or infinite."""


def run_update(
    state: ModelState,
    rollout: Rollout,
    advantages: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    node: Any,
    seed: int,
    dp: DataParallel | None = None,
) -> NodeOutput:
    """One update from one rollout; with ``dp``, this rank's part of a data-parallel update
    (see :mod:`flowrl.roles.data_parallel`): every rank returns the same whole-batch metrics."""
    optimizer = state.ensure_optimizer(node.lr, tuple(node.betas), node.weight_decay)
    for group in optimizer.param_groups:
        group["lr"] = node.lr
    module = state.module
    module.train()
    num_rows = rollout.num_sequences
    mini_batch = min(node.mini_batch_size or num_rows, num_rows)
    single_step = node.ppo_epochs == 1 and mini_batch == num_rows

    old_logprobs: torch.Tensor | None = None
    if not single_step:
        with torch.no_grad():
            old_logprobs = _old_logprobs(state, rollout, dp)

    # The shuffle of mini-batches is a function of (seed, update count): resumable.
    shuffle = torch.Generator().manual_seed(seed * 1_000_003 + state.num_updates)
    totals: dict[str, float] = {}
    num_steps = 0
    for _ in range(node.ppo_epochs):
        order = torch.randperm(num_rows, generator=shuffle) if not single_step else torch.arange(num_rows)
        for start in range(0, num_rows, mini_batch):
            rows = order[start : start + mini_batch]
            part = rollout if single_step else rollout.select(rows)
            stats = _step(state, optimizer, part, advantages[rows], old_logprobs, ref_logprobs, rows, node, dp)
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + value
            num_steps += 1
    state.num_updates += 1
    metrics = {key: value / num_steps for key, value in totals.items()}
    metrics["actor/lr"] = node.lr
    metrics["actor/num_optimizer_steps"] = float(num_steps)
    mine = dp.rows(num_rows) if dp is not None else slice(0, num_rows)
    tokens = int(rollout.prompt_mask[mine].sum() + rollout.completion_mask[mine].sum())
    blocked = dp.blocked_s if dp is not None else 0.0
    return NodeOutput(value=None, metrics=metrics, tokens_in=tokens, blocked_s=blocked)


def _old_logprobs(state: ModelState, rollout: Rollout, dp: DataParallel | None) -> torch.Tensor:
    """Log-probs of the rollout before any step; with ``dp`` each rank computes its rows."""
    if dp is None:
        return completion_logprobs(state.module, rollout, state.device).detach().cpu()
    mine = dp.rows(rollout.num_sequences)
    width = rollout.completion_ids.shape[1]
    local = torch.zeros((0, width))
    if mine.stop > mine.start:
        part = rollout.select(torch.arange(mine.start, mine.stop))
        local = completion_logprobs(state.module, part, state.device).detach().float().cpu()
    return dp.gather_rows(local, rollout.num_sequences)


def _share(mask: torch.Tensor, mine: slice | torch.Tensor, loss_agg: str) -> float:
    """The share of rows ``mine`` in a batch loss's normaliser: tokens (token_mean) or
    sequences with tokens (seq_mean). A data-parallel rank's part and a micro-batch are both
    weighted by it, so that their weighted losses add up to the whole batch's loss."""
    if loss_agg == "seq_mean":
        counted = mask.bool().any(dim=-1).float()
    else:
        counted = mask.float()
    total = float(counted.sum())
    return float(counted[mine].sum()) / total if total > 0 else 0.0


def _step(
    state: ModelState,
    optimizer: torch.optim.Optimizer,
    part: Rollout,
    advantages: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    rows: torch.Tensor,
    node: Any,
    dp: DataParallel | None,
) -> dict[str, float]:
    mine = dp.rows(part.num_sequences) if dp is not None else slice(0, part.num_sequences)
    weight = _share(part.completion_mask, mine, node.loss_agg) if dp is not None else 1.0
    # clipfrac and ratio_mean are token means whatever the loss aggregation
    token_weight = _share(part.completion_mask, mine, "token_mean") if dp is not None else 1.0
    use_kl = ref_logprobs is not None and node.kl_coef > 0
    keys = ["actor/clipfrac", "actor/ratio_mean", "actor/pg_loss", *(["actor/kl"] if use_kl else []), "actor/loss"]
    values = [0.0] * len(keys)
    optimizer.zero_grad(set_to_none=True)
    if mine.stop > mine.start:
        sub = part if dp is None else part.select(torch.arange(mine.start, mine.stop))
        local_rows = rows[mine]
        context = _StepContext(state, sub, advantages[mine], old_logprobs, ref_logprobs, local_rows, node, use_kl)
        groups = micro_batches(sub, getattr(node, "micro_batch_tokens", None))
        for group in groups:
            # Each pass's loss, weighted by its share of the mini-batch's normaliser: the
            # gradients of the passes add up to the gradient of the whole mini-batch's loss.
            share = _share(sub.completion_mask, group, node.loss_agg) if len(groups) > 1 else 1.0
            tokens_share = _share(sub.completion_mask, group, "token_mean") if len(groups) > 1 else 1.0
            numbers = context.backward(group if len(groups) > 1 else None, share * weight)
            for index, key in enumerate(keys):
                scale = tokens_share * token_weight if key in TOKEN_MEANS else share * weight
                values[index] += numbers[key] * scale
    if dp is not None:
        # the whole mini-batch's gradient and numbers: each rank's part, weighted, summed
        dp.sum_gradients(state.module)
        values = dp.sum_numbers(values)
    if node.max_grad_norm > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(state.module.parameters(), node.max_grad_norm)
    else:
        grad_norm = _grad_norm(state.module)
    result = dict(zip(keys, values))
    result["actor/grad_norm"] = float(grad_norm)
    # A NaN or infinite loss or gradient would poison the weights and the optimizer's moments
    # for good: the step is skipped instead (every data-parallel rank sees the same sums).
    finite = all(math.isfinite(value) for value in result.values())
    if finite:
        optimizer.step()
    else:
        optimizer.zero_grad(set_to_none=True)
    result[NONFINITE_METRIC] = 0.0 if finite else 1.0
    return result


class _StepContext:
    """What every forward/backward pass of one optimizer step reads."""

    def __init__(self, state: ModelState, sub: Rollout, advantages: torch.Tensor,
                 old_logprobs: torch.Tensor | None, ref_logprobs: torch.Tensor | None,
                 rows: torch.Tensor, node: Any, use_kl: bool) -> None:
        self.state, self.sub, self.advantages = state, sub, advantages
        self.old_logprobs, self.ref_logprobs, self.rows = old_logprobs, ref_logprobs, rows
        self.node, self.use_kl = node, use_kl

    def backward(self, group: torch.Tensor | None, scale: float) -> dict[str, float]:
        """Loss of rows ``group`` of the sub-batch (None: all), backward of ``loss * scale``;
        returns the pass's own (unweighted) numbers."""
        device, node = self.state.device, self.node
        piece = self.sub if group is None else self.sub.select(group)
        local = slice(None) if group is None else group
        rows = self.rows[local]
        mask = piece.completion_mask.to(device).float()
        logprobs = completion_logprobs(self.state.module, piece, device)
        old = logprobs.detach() if self.old_logprobs is None else self.old_logprobs[rows].to(device)
        loss, stats = policy_loss(
            logprobs, old, self.advantages[local].to(device), mask, clip_eps=node.clip_eps, loss_agg=node.loss_agg
        )
        numbers = {f"actor/{key}": value for key, value in stats.items()}
        if self.use_kl:
            assert self.ref_logprobs is not None
            kl = kl_penalty(logprobs, self.ref_logprobs[rows].to(device), estimator=node.kl_estimator)
            kl_term = aggregate(kl, mask, node.loss_agg)
            loss = loss + node.kl_coef * kl_term
            numbers["actor/kl"] = float(kl_term.detach())
        numbers["actor/loss"] = float(loss.detach())
        (loss * scale if scale != 1.0 else loss).backward()
        return numbers


def _grad_norm(module: torch.nn.Module) -> torch.Tensor:
    norms = [p.grad.detach().norm() for p in module.parameters() if p.grad is not None]
    return torch.stack(norms).norm() if norms else torch.tensor(0.0)
