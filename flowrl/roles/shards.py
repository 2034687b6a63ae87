"""Data-parallel inference: one node's batch split by rows over several devices, then joined.

A ``score``, ``reference_logprob`` or ``value`` node planned on k devices runs k calls; call
i reads rows ``shard_rows(N, i, k)`` of the rollout (contiguous, in order), and the first
call joins the k results in row order and computes the node's metrics on the whole batch,
so consumers see exactly what one device would have produced.
"""

from __future__ import annotations

from typing import Any

import torch

from flowrl.roles.batch import Rollout, Scores
from flowrl.roles.data_parallel import weighted_rows
from flowrl.roles.score import score_metrics
from flowrl.roles.value import value_metrics
from flowrl.spec.schema import SHARDABLE_ROLES



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


def join_shards(role: str, parts: list[Any], rollout: Rollout, with_failures: bool) -> tuple[Any, dict[str, float]]:
    """The joined output of a sharded node (parts in shard order) and its whole-batch metrics."""
    if role == "score":
        scores = Scores(torch.cat([part.values for part in parts]), sum(part.num_failed for part in parts))
        return scores, score_metrics(scores, with_failures)
    if role == "reference_logprob":
        return torch.cat(parts), {}
    if role == "value":
        values = torch.cat(parts)
        return values, value_metrics(values, rollout)
    raise ValueError(f"'{role}' nodes cannot be split over devices (only {', '.join(SHARDABLE_ROLES)})")
