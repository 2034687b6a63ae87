"""The ``update`` role: one optimizer loop for a policy (PPO-clipped policy gradient with an
optional KL term) and for a value model (clipped regression on gae's returns).

One call consumes one rollout: ``ppo_epochs`` passes over it in shuffled mini-batches of
``mini_batch_size`` sequences, one optimizer step per mini-batch. A mini-batch runs in passes
of at most ``micro_batch_tokens`` padded tokens whose gradients add up (accumulation); over a
data-parallel group each rank computes its rows and the gradients are summed. A step whose
loss or gradient is not finite is skipped. What differs between a policy and a critic is only
the objective (``PolicyObjective``, ``ValueObjective``): its loss on a piece of the rollout and
what it computes once before the first step.

    rollout, advantages --> for epoch: for mini-batch: for pass: objective.loss -> backward
                                       (all-reduce) -> clip -> finite? optimizer.step
"""

from __future__ import annotations

import contextlib
import math
from typing import Protocol

import torch

from flowrl.algorithms.kl import kl_penalty
from flowrl.algorithms.losses import aggregate, masked_mean, policy_loss, value_loss
from flowrl.backends.transfer import to_device
from flowrl.errors import FlowrlError
from flowrl.roles.batch import NodeOutput, Rollout
from flowrl.roles.data_parallel import DataParallel, release, weighted_rows
from flowrl.roles.forward import completion_logprobs, completion_logprobs_and_entropy, micro_batches
from flowrl.roles.sharded import clip_sharded_gradients, set_gradient_sync
from flowrl.roles.state import ModelState
from flowrl.roles.value import completion_values
from flowrl.spec.schema import UpdateNode, pass_tokens


class Objective(Protocol):
    prefix: str
    """Metric prefix: ``actor`` or ``critic``."""
    keys: tuple[str, ...]
    """The loss's numbers, in order (without the prefix)."""
    token_means: tuple[str, ...]
    """Those of ``keys`` that are token means whatever the loss aggregation."""

    def prepare(self, state: ModelState, rollout: Rollout, dp: DataParallel | None, single_step: bool) -> None:
        """Compute what every step reads from the model before any step changes it."""

    def loss(
        self, state: ModelState, piece: Rollout, rows: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of ``piece`` (rows ``rows`` of the rollout) and its numbers by key: 0-dim
        detached tensors on the device, read once per optimizer step, not after each pass."""
        ...

    def finish(self, metrics: dict[str, float]) -> None:
        """Add numbers of the whole call."""


class PolicyObjective:
    """PPO's clipped surrogate on the advantages, plus ``kl_coef`` x KL to the reference,
    minus ``entropy_coef`` x the policy's entropy."""

    prefix = "actor"
    token_means: tuple[str, ...] = ("pg_clipfrac", "ratio_mean", "ppo_kl", "entropy")

    def __init__(self, node: UpdateNode, advantages: torch.Tensor, ref_logprobs: torch.Tensor | None,
                 sampled: bool = False) -> None:
        self.node, self.advantages, self.ref_logprobs = node, advantages, ref_logprobs
        self.use_kl = ref_logprobs is not None and node.kl_coef > 0
        # the sampling engine's log-probs (``sampled``: the rollout has them): their drift from
        # the training forward is measured, and with rollout_is_cap corrected
        self.sampled = sampled
        drift: tuple[str, ...] = ()
        if sampled:  # the weight's mean only where it weighs (unbounded without the cap)
            drift = ("rollout_logprob_diff", "rollout_is_weight") if node.rollout_is_cap is not None \
                else ("rollout_logprob_diff",)
        self.keys: tuple[str, ...] = (
            "pg_clipfrac", "ratio_mean", "ppo_kl", "entropy", *drift, "pg_loss",
            *(("kl_loss",) if self.use_kl else ()), "loss")
        self.token_means = (*PolicyObjective.token_means, *drift)
        self.old_logprobs: torch.Tensor | None = None

    def prepare(self, state: ModelState, rollout: Rollout, dp: DataParallel | None, single_step: bool) -> None:
        # The "old" log-probs of the ratio are those before the first step; with a single step
        # they equal the current ones, which the loss's own forward pass gives (detached).
        if not single_step:
            with torch.no_grad():
                self.old_logprobs = _old_logprobs(state, rollout, dp, pass_tokens(self.node.micro_batch_tokens))

    def loss(
        self, state: ModelState, piece: Rollout, rows: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        device, node = state.device, self.node
        mask = to_device(piece.completion_mask, device).float()
        bonus = node.entropy_coef > 0
        logprobs, entropy = completion_logprobs_and_entropy(state.training_module, piece, device, entropy_grad=bonus)
        old = logprobs.detach() if self.old_logprobs is None else to_device(self.old_logprobs[rows], device)
        weights: torch.Tensor | None = None
        drift: dict[str, torch.Tensor] = {}
        if self.sampled:
            assert piece.sampled_logprobs is not None
            # both engines return a log-prob per completion column, and joins pad both alike
            weights, drift = _rollout_weights(old, to_device(piece.sampled_logprobs, device), mask, node.rollout_is_cap)
        loss, stats = policy_loss(
            logprobs, old, to_device(self.advantages[rows], device), mask, clip_eps=node.clip_eps,
            loss_agg=node.loss_agg, clip_eps_high=node.clip_eps_high, norm_tokens=piece.max_new_tokens,
            token_weights=weights,
        )
        numbers = {**stats, **drift}
        numbers["entropy"] = masked_mean(entropy.detach(), mask.bool())
        if bonus:
            entropy_term = aggregate(entropy, mask, node.loss_agg, piece.max_new_tokens)
            loss = loss - node.entropy_coef * entropy_term
        if self.use_kl:
            assert self.ref_logprobs is not None
            kl = kl_penalty(logprobs, to_device(self.ref_logprobs[rows], device), estimator=node.kl_estimator)
            kl_term = aggregate(kl, mask, node.loss_agg, piece.max_new_tokens)
            loss = loss + node.kl_coef * kl_term
            numbers["kl_loss"] = kl_term.detach()
        numbers["loss"] = loss.detach()
        return loss, numbers

    def finish(self, metrics: dict[str, float]) -> None:
        pass


def _rollout_weights(old: torch.Tensor, sampled: torch.Tensor, mask: torch.Tensor,
                     cap: float | None) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """Per-token ``min(exp(old - sampled), cap)`` (None without a cap) and, as token means,
    the absolute log-prob drift between the two engines and (with a cap) the weight."""
    selected = mask.bool()
    diff = torch.where(selected, old - sampled, torch.zeros_like(old))
    numbers = {"rollout_logprob_diff": masked_mean(diff.abs(), selected)}
    if cap is None:
        return None, numbers
    weights = torch.exp(diff).clamp(max=cap)
    numbers["rollout_is_weight"] = masked_mean(weights, selected)
    return weights, numbers


class ValueObjective:
    """Clipped value regression towards the returns; the clip is around the values the value
    node gave this rollout (the critic before this update)."""

    prefix = "critic"
    keys: tuple[str, ...] = ("vf_loss", "vf_clipfrac", "vpred_mean")
    token_means: tuple[str, ...] = ("vf_clipfrac", "vpred_mean")

    def __init__(self, node: UpdateNode, returns: torch.Tensor, old_values: torch.Tensor | None) -> None:
        self.node, self.returns, self.old_values = node, returns, old_values
        self.mask: torch.Tensor | None = None

    def prepare(self, state: ModelState, rollout: Rollout, dp: DataParallel | None, single_step: bool) -> None:
        self.mask = rollout.completion_mask.bool()
        if self.old_values is None:  # no value node read: the critic's values before this update
            # the whole copy (current before this update, also when training is sharded)
            was_training = state.module.training
            state.module.eval()
            with torch.no_grad():
                self.old_values = completion_values(state.module, rollout, state.device,
                                                    pass_tokens(self.node.micro_batch_tokens)).cpu()
            state.module.train(was_training)

    def loss(
        self, state: ModelState, piece: Rollout, rows: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert self.old_values is not None
        device = state.device
        values = completion_values(state.training_module, piece, device)
        return value_loss(
            values,
            to_device(self.old_values[rows], device),
            to_device(self.returns[rows], device),
            to_device(piece.completion_mask, device).bool(),
            clip_range_value=self.node.clip_range_value,
            loss_agg=self.node.loss_agg,
            norm_tokens=piece.max_new_tokens,
        )

    def finish(self, metrics: dict[str, float]) -> None:
        assert self.old_values is not None and self.mask is not None
        metrics["critic/vf_explained_var"] = _explained_variance(self.old_values, self.returns, self.mask)


def update_policy(
    state: ModelState, rollout: Rollout, advantages: torch.Tensor, ref_logprobs: torch.Tensor | None,
    node: UpdateNode, seed: int, dp: DataParallel | None = None, lr: float | None = None,
) -> NodeOutput:
    """Train a policy on ``advantages`` (``[N]`` or ``[N, T]``) at rate ``lr`` (this step's
    rate of the node's schedule; None: ``node.lr``)."""
    if node.mask_truncated_completions:
        if rollout.truncated is None:
            raise FlowrlError("mask_truncated_completions needs to know which completions were cut, and this "
                              "rollout came without it; remove mask_truncated_completions")
        rollout = rollout.without_rows(rollout.truncated)
    sampled = rollout.sampled_logprobs is not None
    if node.rollout_is_cap is not None and not sampled:
        raise FlowrlError("rollout_is_cap weighs each token by the sampling engine's probability, and this "
                          "rollout came without its log-probs; remove rollout_is_cap")
    objective = PolicyObjective(node, advantages, ref_logprobs, sampled)
    return run_update(state, rollout, objective, node, seed, dp, lr)


def update_critic(
    state: ModelState, rollout: Rollout, returns: torch.Tensor, old_values: torch.Tensor | None,
    node: UpdateNode, seed: int, dp: DataParallel | None = None, lr: float | None = None,
) -> NodeOutput:
    """Train a value model towards ``returns`` ``[N, T]``; ``old_values`` are the value node's
    output for this rollout (None: computed here, before the first step)."""
    return run_update(state, rollout, ValueObjective(node, returns, old_values), node, seed, dp, lr)


def run_update(
    state: ModelState,
    rollout: Rollout,
    objective: Objective,
    node: UpdateNode,
    seed: int,
    dp: DataParallel | None = None,
    lr: float | None = None,
) -> NodeOutput:
    """One update from one rollout at rate ``lr`` (None: ``node.lr``); with ``dp``, this rank's part of a data-parallel update
    (see :mod:`flowrl.roles.data_parallel`; sharded when ``dp.mesh`` is set,
    :mod:`flowrl.roles.sharded`): every rank returns the same whole-batch metrics."""
    if dp is not None and dp.sharded and state.sharded is None:
        state.shard_training(dp.mesh)
    if dp is None or dp.sharded:
        release(state.module)  # a replicated group's buckets, if one trained it before
    rate = node.lr if lr is None else lr
    optimizer = state.ensure_optimizer(rate, node.betas, node.weight_decay)
    for group in optimizer.param_groups:  # the node's settings, also over a restored state's
        group.update(lr=rate, betas=tuple(node.betas), weight_decay=node.weight_decay)
    state.training_module.train()
    num_rows = rollout.num_sequences
    mini_batch = min(node.mini_batch_size or num_rows, num_rows)
    single_step = node.ppo_epochs == 1 and mini_batch == num_rows
    objective.prepare(state, rollout, dp, single_step)

    # The shuffle of mini-batches is a function of (seed, update count): resumable.
    shuffle = torch.Generator().manual_seed(seed * 1_000_003 + state.num_updates)
    totals: dict[str, float] = {}
    num_steps = 0
    for _ in range(node.ppo_epochs):
        order = torch.arange(num_rows) if single_step else torch.randperm(num_rows, generator=shuffle)
        for start in range(0, num_rows, mini_batch):
            rows = order[start : start + mini_batch]
            part = rollout if single_step else rollout.select(rows)
            if not bool(part.completion_mask.any()):
                # no token in the loss (every completion masked out): no step, whose zero
                # gradient AdamW would still follow along its moments, and no numbers
                continue
            stats = _step(state, optimizer, objective, part, rows, node, dp)
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + value
            num_steps += 1
    state.num_updates += 1
    if dp is not None and dp.sharded:
        state.refresh_whole()  # every rank gathers the new weights into its whole copy
    prefix = objective.prefix
    metrics = {f"{prefix}/{key}": value / max(num_steps, 1) for key, value in totals.items()}
    metrics[f"{prefix}/lr"] = rate
    metrics[f"{prefix}/num_optimizer_steps"] = float(num_steps)
    objective.finish(metrics)
    mine = dp.rows(num_rows) if dp is not None else slice(0, num_rows)
    tokens = int(rollout.prompt_mask[mine].sum() + rollout.completion_mask[mine].sum())
    blocked = dp.blocked_s if dp is not None else 0.0
    return NodeOutput(value=None, metrics=metrics, tokens_in=tokens, blocked_s=blocked)


def _old_logprobs(state: ModelState, rollout: Rollout, dp: DataParallel | None,
                  micro_batch_tokens: int | None) -> torch.Tensor:
    """Log-probs of the rollout before any step; with ``dp`` each rank computes its rows. The
    passes keep to the update's own budget: no pass of the node holds more tokens than the
    planner fitted."""
    if dp is None:
        return completion_logprobs(state.module, rollout, state.device, micro_batch_tokens).detach().cpu()
    mine = dp.rows(rollout.num_sequences)
    width = rollout.completion_ids.shape[1]
    local = torch.zeros((0, width))
    if mine.stop > mine.start:
        # the whole copy: a sharded model's one is current before the update
        part = rollout.select(torch.arange(mine.start, mine.stop))
        local = completion_logprobs(state.module, part, state.device, micro_batch_tokens).detach().float().cpu()
    return dp.gather_rows(local, rollout.num_sequences)


def _share(mask: torch.Tensor, mine: slice | torch.Tensor, loss_agg: str) -> float:
    """The share of rows ``mine`` in a batch loss's normaliser: tokens (token_mean),
    sequences with tokens (seq_mean) or sequences (token_sum_norm). A data-parallel rank's part
    and a micro-batch are both weighted by it, so that their weighted losses add up to the
    whole batch's loss."""
    if loss_agg == "seq_mean":
        counted = mask.bool().any(dim=-1).float()
    elif loss_agg == "token_sum_norm":
        counted = torch.ones(mask.shape[0])
    else:
        counted = mask.float()
    total = float(counted.sum())
    return float(counted[mine].sum()) / total if total > 0 else 0.0


def _step(
    state: ModelState,
    optimizer: torch.optim.Optimizer,
    objective: Objective,
    part: Rollout,
    rows: torch.Tensor,
    node: UpdateNode,
    dp: DataParallel | None,
) -> dict[str, float]:
    """One optimizer step on mini-batch ``part`` (rows ``rows`` of the rollout)."""
    mine = dp.rows(part.num_sequences) if dp is not None else slice(0, part.num_sequences)
    weight = _share(part.completion_mask, mine, node.loss_agg) if dp is not None else 1.0
    # token means (clip fractions, means of ratios and values) whatever the loss aggregation
    token_weight = _share(part.completion_mask, mine, "token_mean") if dp is not None else 1.0
    keys = objective.keys
    # Each pass's numbers stay on the device with their factors beside them until the passes
    # are done: reading them after each pass would make the host wait for the device there,
    # and the device would then idle while the host prepares the next pass. (Replicated data
    # parallel, the read comes after the last backward, before the last buckets start.)
    passes_numbers: list[torch.Tensor] = []
    passes_factors: list[list[float]] = []
    sharded = dp is not None and dp.sharded
    # Replicated, the gradients are views into the all-reduce buckets while the passes run
    # (the hooks that start the buckets do nothing after them, an error included); the
    # buckets zero them, kept from the last step.
    replicated = dp is not None and not sharded
    if not replicated:
        optimizer.zero_grad(set_to_none=True)
    sub = part if dp is None else part.select(torch.arange(mine.start, mine.stop))
    sub_rows = rows[mine]
    groups = micro_batches(sub, pass_tokens(node.micro_batch_tokens)) if mine.stop > mine.start else []
    # Sharded, every rank runs as many passes as the rank with the most: each pass's
    # collectives (the gather of each layer, the last backward's reduce-scatter) meet their
    # peers. A pass past this rank's own runs one row of the mini-batch with a zero loss.
    passes = _most_passes(part, node, dp) if sharded and dp is not None else len(groups)
    with dp.attached(state.module) if replicated and dp is not None else contextlib.nullcontext():
        for number in range(passes):
            last = number == passes - 1
            if sharded:
                set_gradient_sync(state.training_module, last)
            if number >= len(groups):
                loss, _ = objective.loss(state, part.select(torch.tensor([0])), rows[:1])
                (loss * 0.0).backward()
                continue
            group = groups[number]
            # Each pass's loss, weighted by its share of the mini-batch's normaliser: the
            # gradients of the passes add up to the gradient of the whole mini-batch's loss.
            whole = len(groups) == 1
            share = 1.0 if whole else _share(sub.completion_mask, group, node.loss_agg)
            tokens_share = 1.0 if whole else _share(sub.completion_mask, group, "token_mean")
            piece = sub if whole else sub.select(group)
            loss, numbers = objective.loss(state, piece, sub_rows if whole else sub_rows[group])
            scale = share * weight
            # Replicated, the last pass's backward makes the gradients final: their sum over the
            # ranks starts bucket by bucket while it runs.
            with dp.overlapping(state.module) if replicated and last and dp is not None else contextlib.nullcontext():
                (loss * scale if scale != 1.0 else loss).backward()
            # float64 holds each number exactly, whatever its dtype, as float() did
            passes_numbers.append(torch.stack([numbers[key].double() for key in keys]))
            passes_factors.append([tokens_share * token_weight if key in objective.token_means else share * weight
                                   for key in keys])
        values = _weighted_sums(passes_numbers, passes_factors, len(keys))
        if replicated and dp is not None:
            # the whole mini-batch's gradient and numbers: each rank's part, weighted, summed
            values = dp.sum_gradients(state.module, values)
    if dp is not None and dp.sharded:
        # the reduce-scatters summed the gradients; the numbers are summed here
        values = dp.sum_numbers(values)
        grad_norm = clip_sharded_gradients(list(state.training_module.parameters()), node.max_grad_norm,
                                           dp.sum_numbers)
    elif node.max_grad_norm > 0:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(state.module.parameters(), node.max_grad_norm))
    else:
        grad_norm = float(_grad_norm(state.module))
    result = dict(zip(keys, values))
    result["grad_norm"] = grad_norm
    # A NaN or infinite loss or gradient would poison the weights and the optimizer's moments
    # for good: the step is skipped instead (every data-parallel rank sees the same sums).
    finite = all(math.isfinite(value) for value in result.values())
    if finite:
        optimizer.step()
    else:
        optimizer.zero_grad(set_to_none=True)
    result["nonfinite_skipped"] = 0.0 if finite else 1.0
    return result


def _weighted_sums(numbers: list[torch.Tensor], factors: list[list[float]], count: int) -> list[float]:
    """Per key, the sum over the passes of number x factor, read from the device at once."""
    values = [0.0] * count
    rows = torch.stack(numbers).tolist() if numbers else []
    for row, row_factors in zip(rows, factors):
        for index, (number, factor) in enumerate(zip(row, row_factors)):
            values[index] += number * factor
    return values


def _most_passes(part: Rollout, node: UpdateNode, dp: DataParallel) -> int:
    """The most passes any rank runs on mini-batch ``part``: every rank holds the whole
    mini-batch, so each counts every rank's passes itself, without a collective."""
    counts = []
    for rank in range(dp.collective.world):
        rows = weighted_rows(part.num_sequences, rank, dp.shares)
        empty = rows.stop <= rows.start
        counts.append(0 if empty else len(micro_batches(part.select(torch.arange(rows.start, rows.stop)),
                                                         pass_tokens(node.micro_batch_tokens))))
    return max(counts)


def _grad_norm(module: torch.nn.Module) -> torch.Tensor:
    norms = [p.grad.detach().norm() for p in module.parameters() if p.grad is not None]
    return torch.stack(norms).norm() if norms else torch.tensor(0.0)


def _explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(returns - values) / Var(returns)`` over unmasked tokens.

    1 = a perfect critic, 0 or less = no better than predicting the mean return.
    """
    values = torch.where(mask, values.float(), torch.zeros_like(values, dtype=torch.float32))
    returns = torch.where(mask, returns.float(), torch.zeros_like(returns, dtype=torch.float32))
    residual = returns - values
    residual_var = masked_mean((residual - masked_mean(residual, mask)) ** 2, mask)
    returns_var = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    if float(returns_var) == 0.0:
        return 0.0
    return float(1.0 - residual_var / returns_var)
