"""Data-parallel inference: one node's batch split by rows over several devices, then joined.

A ``score``, ``reference_logprob`` or ``value`` node planned on k devices runs k calls; call
i reads its rows of the rollout (contiguous, in order; ``weighted_rows``), and the first call
joins the k results in row order (its role's ``join`` in ``flowrl.roles.registry``) and computes
the node's metrics on the whole batch, so consumers see exactly what one device would have
produced. A ``generate`` node splits its
prompts the same way (whole prompts, so each prompt's samples stay together) and its parts
are joined into one rollout.
"""

from __future__ import annotations


import torch

from flowrl.roles.batch import Rollout
from flowrl.roles.data_parallel import weighted_rows
from flowrl.roles.texts import joined


def shard_rows(num_rows: int, index: int, count: int) -> slice:
    """Rows of shard ``index`` of ``count`` equal shards: consecutive, the first
    ``num_rows % count`` shards one row longer."""
    if not 0 <= index < count:
        raise ValueError(f"shard {index} of {count}")
    return weighted_rows(num_rows, index, tuple(1.0 for _ in range(count)))


def shard_of(rollout: Rollout, index: int, shares: tuple[float, ...]) -> Rollout:
    """Shard ``index``'s rows when shard r gets ``shares[r]`` of them."""
    rows = weighted_rows(rollout.num_sequences, index, shares)
    return rollout.select(torch.arange(rows.start, rows.stop))


def join_rollouts(parts: list[Rollout]) -> Rollout:
    """Rollouts of consecutive prompt shares as one: prompts left-padded and completions
    right-padded to the widest part, rows in part order."""
    prompt_width = max(part.prompt_ids.shape[1] for part in parts)
    completion_width = max(part.completion_ids.shape[1] for part in parts)
    pad = parts[0].pad_token_id

    def widen(tensor: torch.Tensor, width: int, value: float, left: bool) -> torch.Tensor:
        extra = width - tensor.shape[1]
        if extra == 0:
            return tensor
        filler = torch.full((tensor.shape[0], extra), value, dtype=tensor.dtype)
        return torch.cat([filler, tensor] if left else [tensor, filler], dim=1)

    logprobs = None
    if all(part.sampled_logprobs is not None for part in parts):
        logprobs = torch.cat([widen(p.sampled_logprobs, completion_width, 0.0, False) for p in parts])  # type: ignore[arg-type]
    first = parts[0]
    return Rollout(
        prompt_ids=torch.cat([widen(p.prompt_ids, prompt_width, pad, True) for p in parts]),
        prompt_mask=torch.cat([widen(p.prompt_mask, prompt_width, 0, True) for p in parts]),
        completion_ids=torch.cat([widen(p.completion_ids, completion_width, pad, False) for p in parts]),
        completion_mask=torch.cat([widen(p.completion_mask, completion_width, 0, False) for p in parts]),
        group_size=first.group_size,
        prompts=[text for p in parts for text in p.prompts],
        completions=joined([p.completions for p in parts]),
        answers=[answer for p in parts for answer in p.answers],
        max_new_tokens=first.max_new_tokens,
        temperature=first.temperature,
        sampled_logprobs=logprobs,
        meta=dict(first.meta),
        pad_token_id=pad,
        data_prompts=[item for p in parts for item in p.data_prompts] if all(p.data_prompts for p in parts) else [],
        columns={name: [value for p in parts for value in p.columns[name]] for name in first.columns},
        chat=first.chat,
        truncated=(torch.cat([p.truncated for p in parts])  # type: ignore[misc]
                   if all(p.truncated is not None for p in parts) else None),
    )
