"""The ``score`` role backed by a reward model: one scalar per completion, read at its end.

The reward model (a :class:`~flowrl.backends.value_model.ScalarHeadModel`) reads the
rollout's token ids, so it must share the policy's tokenizer (true of the builtin models).
Its score is the scalar at the last real token of prompt + completion, the end-of-sequence
token when generation stopped there: prompts are left-padded and completions right-padded,
so that is the last column where the joined attention mask is 1, whatever the padding.
"""

from __future__ import annotations

import torch

from flowrl.backends.transfer import to_device
from flowrl.roles.batch import NodeOutput, Rollout, Scores
from flowrl.roles.forward import in_micro_batches
from flowrl.roles.score import score_metrics
from flowrl.roles.state import ModelState


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[N]`` column of each row's last 1 in ``attention_mask`` (0 for a row of zeros)."""
    columns = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (attention_mask.bool() * (columns + 1)).amax(dim=1).sub(1).clamp(min=0)


def sequence_scores(
    module: torch.nn.Module,
    rollout: Rollout,
    device: torch.device,
    micro_batch_tokens: int | None = None,
) -> torch.Tensor:
    """``[N]`` float32 reward-model scores of a rollout, on the CPU; passes of at most
    ``micro_batch_tokens`` padded tokens (length-sorted rows, ``flowrl.roles.forward.micro_batches``)."""
    return in_micro_batches(rollout, micro_batch_tokens, lambda part: _scores(module, part, device)).cpu()


def _scores(module: torch.nn.Module, rollout: Rollout, device: torch.device) -> torch.Tensor:
    input_ids, attention_mask, position_ids = rollout.joined()
    # Columns before the first and after the last real token of any row are padding
    # everywhere (positions are explicit, so the rest compute the same values): a pass of
    # length-sorted rows holds about the tokens its budget counted.
    start = int(attention_mask.bool().any(dim=0).long().argmax())
    end = int(last_token_index(attention_mask).max()) + 1
    columns = slice(start, end)
    scalars = module(
        input_ids=to_device(input_ids[:, columns], device),
        attention_mask=to_device(attention_mask[:, columns], device),
        position_ids=to_device(position_ids[:, columns], device),
    ).float()
    last = to_device(last_token_index(attention_mask[:, columns]), scalars.device)
    return scalars[torch.arange(scalars.shape[0], device=scalars.device), last]


def run_reward_model(
    state: ModelState, rollout: Rollout, weight: float, micro_batch_tokens: int | None = None
) -> NodeOutput:
    """Scores times ``weight``, as :func:`flowrl.roles.score.run_score` returns them."""
    state.module.eval()
    with torch.inference_mode():
        values = sequence_scores(state.module, rollout, state.device, micro_batch_tokens)
    scores = Scores(values=values.clone() * weight, num_failed=0)
    return NodeOutput(
        value=scores,
        metrics=score_metrics(scores, with_failures=False),
        tokens_in=rollout.num_prompt_tokens + rollout.num_completion_tokens,
    )
