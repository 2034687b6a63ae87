"""The ``reference_logprob`` role: log-probabilities under a frozen model (or a trained
policy's frozen weights under its adapters)."""

from __future__ import annotations

import torch

from flowrl.backends.lora import adapters_off
from flowrl.roles.batch import NodeOutput, Rollout
from flowrl.roles.forward import completion_logprobs
from flowrl.roles.state import ModelState


def run_reference_logprob(state: ModelState, rollout: Rollout, micro_batch_tokens: int | None = None) -> NodeOutput:
    """Of a model with adapters (a policy trained through them), the log-probs of the frozen
    model under them: the policy as it was loaded, with no second copy of it."""
    state.module.eval()
    with adapters_off(state.module), torch.inference_mode():
        logprobs = completion_logprobs(state.module, rollout, state.device, micro_batch_tokens)
    return NodeOutput(
        value=logprobs.cpu(),
        tokens_in=rollout.num_prompt_tokens + rollout.num_completion_tokens,
        tokens_out=rollout.num_completion_tokens,
    )
