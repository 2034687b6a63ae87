"""The ``update`` role for a value model (critic): clipped value regression on the returns.

One call consumes one rollout like the policy update: ``ppo_epochs`` passes in shuffled
mini-batches of ``mini_batch_size`` sequences, one optimizer step per mini-batch. The old
values of the clip are the value node's output for this rollout (the critic before this
update); the targets are the advantage node's returns.
"""

from __future__ import annotations

from typing import Any

import torch

from flowrl.algorithms.losses import masked_mean, value_loss
from flowrl.roles.batch import NodeOutput, Rollout
from flowrl.roles.state import ModelState
from flowrl.roles.value import completion_values

DEFAULT_CLIP_RANGE_VALUE = 0.2
"""Value clip range (reward units) when the node declares no ``clip_range_value`` (TRL's and
OpenRLHF's default, suited to rewards of order 1)."""


def run_critic_update(
    state: ModelState,
    rollout: Rollout,
    returns: torch.Tensor,
    old_values: torch.Tensor | None,
    node: Any,
    seed: int = 0,
) -> NodeOutput:
    """Train the critic toward ``returns`` ``[N, T]``.

    ``old_values`` ``[N, T]`` are the value node's output for this rollout (None: computed here).
    """
    optimizer = state.ensure_optimizer(node.lr, tuple(node.betas), node.weight_decay)
    for group in optimizer.param_groups:
        group["lr"] = node.lr
    module = state.module
    mask = rollout.completion_mask.bool()
    if old_values is None:
        module.eval()
        with torch.no_grad():
            old_values = completion_values(module, rollout, state.device).cpu()
    clip_range = getattr(node, "clip_range_value", DEFAULT_CLIP_RANGE_VALUE)
    module.train()
    num_rows = rollout.num_sequences
    mini_batch = min(node.mini_batch_size or num_rows, num_rows)
    single_step = node.ppo_epochs == 1 and mini_batch == num_rows
    # Shuffles are a function of (seed, update count), so a resumed run repeats them.
    shuffle = torch.Generator().manual_seed(seed * 1_000_003 + state.num_updates)
    totals: dict[str, float] = {}
    num_steps = 0
    for _ in range(node.ppo_epochs):
        order = (
            torch.arange(num_rows) if single_step else torch.randperm(num_rows, generator=shuffle)
        )
        for start in range(0, num_rows, mini_batch):
            rows = order[start : start + mini_batch]
            part = rollout if single_step else rollout.select(rows)
            stats = _step(state, optimizer, part, returns[rows], old_values[rows], clip_range, node)
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + value
            num_steps += 1
    state.num_updates += 1
    metrics = {key: value / num_steps for key, value in totals.items()}
    metrics["critic/lr"] = node.lr
    metrics["critic/num_optimizer_steps"] = float(num_steps)
    metrics["critic/explained_variance"] = _explained_variance(old_values, returns, mask)
    return NodeOutput(
        value=None,
        metrics=metrics,
        tokens_in=rollout.num_prompt_tokens + rollout.num_completion_tokens,
    )


def _step(
    state: ModelState,
    optimizer: torch.optim.Optimizer,
    part: Rollout,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    clip_range: float | None,
    node: Any,
) -> dict[str, float]:
    device = state.device
    mask = part.completion_mask.to(device).bool()
    values = completion_values(state.module, part, device)
    loss, stats = value_loss(
        values,
        old_values.to(device),
        returns.to(device),
        mask,
        clip_range_value=clip_range,
        loss_agg=node.loss_agg,
    )
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    parameters = [p for p in state.module.parameters() if p.grad is not None]
    if node.max_grad_norm > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(parameters, node.max_grad_norm)
    else:
        grad_norm = (
            torch.stack([p.grad.detach().norm() for p in parameters if p.grad is not None]).norm()
            if parameters
            else torch.tensor(0.0)
        )
    optimizer.step()
    return {
        "critic/vf_loss": stats["vf_loss"],
        "critic/vf_clipfrac": stats["vf_clipfrac"],
        "critic/values_mean": stats["values_mean"],
        "critic/grad_norm": float(grad_norm),
    }


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
