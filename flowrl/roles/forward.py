"""Log-probabilities of a rollout's completion tokens under a model."""

from __future__ import annotations

import torch

from flowrl.algorithms.logprobs import token_logprobs
from flowrl.roles.batch import Rollout


def completion_logprobs(
    module: torch.nn.Module,
    rollout: Rollout,
    device: torch.device,
    micro_batch_size: int | None = None,
) -> torch.Tensor:
    """[N, T] float32 log-probabilities of each completion token (padding included; mask it).

    The logits of position ``P - 1 + t`` predict completion token ``t``; only those
    columns are turned into log-probabilities, and in row chunks, so the full-vocabulary
    float32 tensor of the whole batch never exists at once.
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
    # Drop trailing columns that are padding in every row (all samples stopped early):
    # they cost compute and give nothing. They come back as zeros, masked downstream.
    width = max(int(rollout.completion_mask.sum(dim=1).max()), 1)
    end = prompt_length + width
    logits = module(
        input_ids=input_ids[:, :end].to(device),
        attention_mask=attention_mask[:, :end].to(device),
        position_ids=position_ids[:, :end].to(device),
        use_cache=False,
    ).logits
    predicting = logits[:, prompt_length - 1 : end - 1, :]
    labels = rollout.completion_ids[:, :width].to(device)
    logprobs = token_logprobs(predicting, labels, temperature=rollout.temperature)
    if width < num_columns:
        logprobs = torch.nn.functional.pad(logprobs, (0, num_columns - width))
    return logprobs
