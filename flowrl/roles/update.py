"""The ``update`` role for a policy: PPO-clipped GRPO loss with an optional KL term.

One call consumes one rollout: ``ppo_epochs`` passes over it in shuffled mini-batches of
``mini_batch_size`` sequences, one optimizer step per mini-batch. The "old" log-probs of
the ratio are computed once per rollout, before the first step; when there is a single
step (one epoch, one mini-batch) they equal the current ones, so the forward pass that
computes the loss provides them (detached) and no extra pass is made.
"""

from __future__ import annotations

from typing import Any

import torch

from flowrl.algorithms.kl import kl_penalty
from flowrl.algorithms.losses import aggregate, policy_loss
from flowrl.roles.batch import NodeOutput, Rollout
from flowrl.roles.forward import completion_logprobs
from flowrl.roles.state import ModelState


def run_update(
    state: ModelState,
    rollout: Rollout,
    advantages: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    node: Any,
    seed: int,
) -> NodeOutput:
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
            old_logprobs = completion_logprobs(module, rollout, state.device).detach()

    # The shuffle of mini-batches is a function of (seed, update count): resumable.
    shuffle = torch.Generator().manual_seed(seed * 1_000_003 + state.num_updates)
    totals: dict[str, float] = {}
    num_steps = 0
    for _ in range(node.ppo_epochs):
        order = torch.randperm(num_rows, generator=shuffle) if not single_step else torch.arange(num_rows)
        for start in range(0, num_rows, mini_batch):
            rows = order[start : start + mini_batch]
            part = rollout if single_step else rollout.select(rows)
            stats = _step(state, optimizer, part, advantages[rows], old_logprobs, ref_logprobs, rows, node)
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + value
            num_steps += 1
    state.num_updates += 1
    metrics = {key: value / num_steps for key, value in totals.items()}
    metrics["actor/lr"] = node.lr
    metrics["actor/num_optimizer_steps"] = float(num_steps)
    return NodeOutput(value=None, metrics=metrics, tokens_in=rollout.num_prompt_tokens + rollout.num_completion_tokens)


def _step(
    state: ModelState,
    optimizer: torch.optim.Optimizer,
    part: Rollout,
    advantages: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    rows: torch.Tensor,
    node: Any,
) -> dict[str, float]:
    device = state.device
    mask = part.completion_mask.to(device).float()
    logprobs = completion_logprobs(state.module, part, device)
    old = logprobs.detach() if old_logprobs is None else old_logprobs[rows].to(device)
    loss, stats = policy_loss(
        logprobs, old, advantages.to(device), mask, clip_eps=node.clip_eps, loss_agg=node.loss_agg
    )
    result = {f"actor/{key}": float(value) for key, value in stats.items()}
    if ref_logprobs is not None and node.kl_coef > 0:
        kl = kl_penalty(logprobs, ref_logprobs[rows].to(device), estimator=node.kl_estimator)
        kl_term = aggregate(kl, mask, node.loss_agg)
        loss = loss + node.kl_coef * kl_term
        result["actor/kl"] = float(kl_term.detach())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if node.max_grad_norm > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(state.module.parameters(), node.max_grad_norm)
    else:
        grad_norm = _grad_norm(state.module)
    optimizer.step()
    result["actor/loss"] = float(loss.detach())
    result["actor/grad_norm"] = float(grad_norm)
    return result


def _grad_norm(module: torch.nn.Module) -> torch.Tensor:
    norms = [p.grad.detach().norm() for p in module.parameters() if p.grad is not None]
    return torch.stack(norms).norm() if norms else torch.tensor(0.0)
