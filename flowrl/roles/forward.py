"""Forward passes over a rollout's completion tokens: log-probabilities, and the window and
micro-batching that value heads share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from flowrl.algorithms.logprobs import token_logprobs
from flowrl.roles.batch import Rollout


@dataclass(frozen=True)
class CompletionWindow:
    """The columns of prompt + completion worth a forward pass.

    Trailing columns that are padding in every row (all samples stopped early) cost compute
    and give nothing: they are left out, and come back as zeros (masked downstream).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    prompt_length: int
    width: int
    """Completion columns computed."""
    num_columns: int
    """Completion columns of the rollout."""

    def completion_positions(self, per_position: torch.Tensor) -> torch.Tensor:
        """The outputs at the positions that predict each completion token (P-1 .. P+width-2)."""
        return per_position[:, self.prompt_length - 1 : self.prompt_length + self.width - 1]

    def pad(self, values: torch.Tensor) -> torch.Tensor:
        """[N, width] -> [N, num_columns], zeros on the columns left out."""
        if self.width < self.num_columns:
            values = torch.nn.functional.pad(values, (0, self.num_columns - self.width))
        return values


def completion_window(rollout: Rollout, device: torch.device) -> CompletionWindow:
    input_ids, attention_mask, position_ids = rollout.joined()
    prompt_length = rollout.prompt_ids.shape[1]
    width = max(int(rollout.completion_mask.sum(dim=1).max()), 1)
    end = prompt_length + width
    return CompletionWindow(
        input_ids=input_ids[:, :end].to(device),
        attention_mask=attention_mask[:, :end].to(device),
        position_ids=position_ids[:, :end].to(device),
        prompt_length=prompt_length,
        width=width,
        num_columns=rollout.completion_ids.shape[1],
    )


def in_micro_batches(
    rollout: Rollout, micro_batch_size: int | None, compute: Callable[[Rollout], torch.Tensor]
) -> torch.Tensor:
    """``compute`` over row chunks of ``micro_batch_size`` sequences, joined in order."""
    num_rows = rollout.num_sequences
    step = micro_batch_size or num_rows
    if step >= num_rows:
        return compute(rollout)
    parts = [compute(rollout.select(torch.arange(start, min(start + step, num_rows)))) for start in range(0, num_rows, step)]
    return torch.cat(parts, dim=0)


def completion_logprobs(
    module: torch.nn.Module,
    rollout: Rollout,
    device: torch.device,
    micro_batch_size: int | None = None,
) -> torch.Tensor:
    """[N, T] float32 log-probabilities of each completion token (padding included; mask it).

    Only the completion columns' logits become log-probabilities, and in row chunks, so the
    full-vocabulary float32 tensor of the whole batch never exists at once.
    """
    return in_micro_batches(rollout, micro_batch_size, lambda part: _logprobs(module, part, device))


def _logprobs(module: torch.nn.Module, rollout: Rollout, device: torch.device) -> torch.Tensor:
    window = completion_window(rollout, device)
    logits = module(
        input_ids=window.input_ids,
        attention_mask=window.attention_mask,
        position_ids=window.position_ids,
        use_cache=False,
    ).logits
    labels = rollout.completion_ids[:, : window.width].to(device)
    logprobs = token_logprobs(window.completion_positions(logits), labels, temperature=rollout.temperature)
    return window.pad(logprobs)
