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
from flowrl.roles.forward import completion_window, in_micro_batches
from flowrl.roles.state import ModelState


def completion_values(
    module: torch.nn.Module,
    rollout: Rollout,
    device: torch.device,
    micro_batch_tokens: int | None = None,
) -> torch.Tensor:
    """[N, T] float32 values of the states before each completion token (padding included; mask it).

    ``module`` is a :class:`~flowrl.backends.value_model.ScalarHeadModel` (per-position
    scalars). Gradients flow when called outside ``no_grad``, so the critic update uses it too.
    """
    return in_micro_batches(rollout, micro_batch_tokens, lambda part: _values(module, part, device))


def _values(module: torch.nn.Module, rollout: Rollout, device: torch.device) -> torch.Tensor:
    window = completion_window(rollout, device)
    scalars = module(
        input_ids=window.input_ids, attention_mask=window.attention_mask, position_ids=window.position_ids
    )
    return window.pad(window.completion_positions(scalars).float())


def value_metrics(values: torch.Tensor, rollout: Rollout) -> dict[str, float]:
    return {"critic/values/mean": float(masked_mean(values, rollout.completion_mask.bool()))}


def run_value(
    state: ModelState, rollout: Rollout, micro_batch_tokens: int | None = None
) -> NodeOutput:
    """Values ``[N, T]`` float32 on the CPU, 0 on completion padding."""
    state.module.eval()
    with torch.inference_mode():
        values = completion_values(state.module, rollout, state.device, micro_batch_tokens).cpu()
    mask = rollout.completion_mask.bool()
    values = torch.where(mask, values, torch.zeros_like(values))
    return NodeOutput(
        value=values,
        metrics=value_metrics(values, rollout),
        tokens_in=rollout.num_prompt_tokens + rollout.num_completion_tokens,
        tokens_out=rollout.num_completion_tokens,
    )
