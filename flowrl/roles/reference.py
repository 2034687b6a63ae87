"""The ``reference_logprob`` role: log-probabilities under a frozen model."""

from __future__ import annotations

import torch

from flowrl.roles.batch import NodeOutput, Rollout
from flowrl.roles.forward import completion_logprobs
from flowrl.roles.state import ModelState


def run_reference_logprob(state: ModelState, rollout: Rollout, micro_batch_tokens: int | None = None) -> NodeOutput:
    state.module.eval()
    with torch.inference_mode():
        logprobs = completion_logprobs(state.module, rollout, state.device, micro_batch_tokens)
    return NodeOutput(
        value=logprobs.cpu(),
        tokens_in=rollout.num_prompt_tokens + rollout.num_completion_tokens,
        tokens_out=rollout.num_completion_tokens,
    )
