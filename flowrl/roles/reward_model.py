"""The ``score`` role backed by a reward model: one scalar per completion, read at its end.

The reward model (a :class:`~flowrl.backends.value_model.ScalarHeadModel`) reads the
rollout's token ids, so it must share the policy's tokenizer (true of the builtin models).
Its score is the scalar at the last real token of prompt + completion, the end-of-sequence
token when generation stopped there: prompts are left-padded and completions right-padded,
so that is the last column where the joined attention mask is 1, whatever the padding.
"""

from __future__ import annotations

import torch

from flowrl.roles.batch import NodeOutput, Rollout, Scores
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
    micro_batch_size: int | None = None,
) -> torch.Tensor:
    """``[N]`` float32 reward-model scores of a rollout, on the CPU."""
    input_ids, attention_mask, position_ids = rollout.joined()
    num_rows = input_ids.shape[0]
    step = micro_batch_size or num_rows
    parts = []
    for start in range(0, num_rows, step):
        rows = slice(start, min(start + step, num_rows))
        mask = attention_mask[rows]
        # Columns after the longest row's last real token are padding everywhere.
        end = int(last_token_index(mask).max()) + 1
        scalars = module(
            input_ids=input_ids[rows, :end].to(device),
            attention_mask=mask[:, :end].to(device),
            position_ids=position_ids[rows, :end].to(device),
        ).float()
        last = last_token_index(mask[:, :end]).to(scalars.device)
        parts.append(scalars[torch.arange(scalars.shape[0], device=scalars.device), last].cpu())
    return torch.cat(parts)


def run_reward_model(
    state: ModelState, rollout: Rollout, weight: float, micro_batch_size: int | None = None
) -> NodeOutput:
    """Scores times ``weight``, as :func:`flowrl.roles.score.run_score` returns them."""
    state.module.eval()
    with torch.inference_mode():
        values = sequence_scores(state.module, rollout, state.device, micro_batch_size)
    scores = Scores(values=values.clone() * weight, num_failed=0)
    return NodeOutput(
        value=scores,
        metrics=score_metrics(scores, with_failures=False),
        tokens_in=rollout.num_prompt_tokens + rollout.num_completion_tokens,
    )
