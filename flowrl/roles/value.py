"""The ``value`` role: a critic's value estimate for every completion token of a rollout.

The value of completion token ``t`` is the critic's scalar at the position that *predicts*
it, ``P - 1 + t`` of the joined prompt + completion (``P`` = padded prompt width): the state
is everything before the token, as for its log-probability. This is how TRL's PPOTrainer and
OpenRLHF's critic slice their value heads, and what
:func:`flowrl.algorithms.token_advantages.gae_advantages` expects (``V_t`` = value of the state
before token ``t``).
"""

from __future__ import annotations

import torch

from flowrl.algorithms.losses import masked_mean
from flowrl.roles.batch import NodeOutput, Rollout
from flowrl.roles.state import ModelState


def completion_values(
    module: torch.nn.Module,
    rollout: Rollout,
    device: torch.device,
    micro_batch_size: int | None = None,
) -> torch.Tensor:
    """[N, T] float32 values of the states before each completion token (padding included; mask it).

    ``module`` is a :class:`~flowrl.backends.value_model.ScalarHeadModel` (per-position
    scalars). Gradients flow when called outside ``no_grad``, so the critic update uses it too.
    """
    num_rows = rollout.num_sequences
    step = micro_batch_size or num_rows
    parts = []
    for start in range(0, num_rows, step):
        rows = torch.arange(start, min(start + step, num_rows))
        parts.append(_forward(module, rollout.select(rows) if step < num_rows else rollout, device))
    return torch.cat(parts, dim=0)


def _forward(module: torch.nn.Module, rollout: Rollout, device: torch.device) -> torch.Tensor:
    input_ids, attention_mask, position_ids = rollout.joined()
    prompt_length = rollout.prompt_ids.shape[1]
    num_columns = rollout.completion_ids.shape[1]
    # As for log-probs: trailing columns that are padding in every row are not computed and
    # come back as zeros.
    width = max(int(rollout.completion_mask.sum(dim=1).max()), 1)
    end = prompt_length + width
    scalars = module(
        input_ids=input_ids[:, :end].to(device),
        attention_mask=attention_mask[:, :end].to(device),
        position_ids=position_ids[:, :end].to(device),
    )
    values = scalars[:, prompt_length - 1 : end - 1].float()
    if width < num_columns:
        values = torch.nn.functional.pad(values, (0, num_columns - width))
    return values


def run_value(
    state: ModelState, rollout: Rollout, micro_batch_size: int | None = None
) -> NodeOutput:
    """Values ``[N, T]`` float32 on the CPU, 0 on completion padding."""
    state.module.eval()
    with torch.inference_mode():
        values = completion_values(state.module, rollout, state.device, micro_batch_size).cpu()
    mask = rollout.completion_mask.bool()
    values = torch.where(mask, values, torch.zeros_like(values))
    metrics = {"critic/values/mean": float(masked_mean(values, mask))}
    return NodeOutput(
        value=values,
        metrics=metrics,
        tokens=rollout.num_prompt_tokens + rollout.num_completion_tokens,
    )
