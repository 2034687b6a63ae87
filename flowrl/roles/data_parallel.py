"""Training one model on several devices: every rank takes its share of each mini-batch.

Every rank holds the whole rollout and walks the same mini-batches in the same order (the
shuffle is a function of seed and update count). Within a mini-batch, rank r takes rows
``weighted_rows(n, r, shares)``, scales its loss by its share of the mini-batch's normaliser
(tokens for ``token_mean``, sequences for ``seq_mean``), and the gradients are summed over
the ranks. The sum is then exactly the gradient of the whole mini-batch's loss, so the
optimizer steps, identical on every rank, are those of one device (to float rounding).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch


class Collective(Protocol):
    rank: int
    world: int

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum over the ranks, in place."""
        ...


def weighted_rows(num_rows: int, index: int, shares: tuple[float, ...]) -> slice:
    """Rank ``index``'s consecutive rows when rank r should get ``shares[r]`` of them
    (largest remainders; equal shares give the first ranks one row more)."""
    total = sum(shares)
    exact = [num_rows * share / total for share in shares]
    counts = [int(value) for value in exact]
    order = sorted(range(len(shares)), key=lambda r: (-(exact[r] - counts[r]), r))
    for rank in order[: num_rows - sum(counts)]:
        counts[rank] += 1
    start = sum(counts[:index])
    return slice(start, start + counts[index])


@dataclass
class DataParallel:
    collective: Collective
    shares: tuple[float, ...]
    """Relative share of rows per rank (faster devices get more); equal by default."""
    blocked_s: float = 0.0
    """Seconds spent in collectives: mostly waiting for slower ranks. Not this device's work,
    so it is reported as waiting, and the device's speed is judged without it."""

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        started = time.perf_counter()
        self.collective.all_reduce(tensor)
        self.blocked_s += time.perf_counter() - started

    @property
    def rank(self) -> int:
        return self.collective.rank

    def rows(self, num_rows: int) -> slice:
        return weighted_rows(num_rows, self.rank, self.shares)

    def sum_gradients(self, module: torch.nn.Module) -> None:
        """All-reduce every gradient as one flat buffer (a rank with no rows sends zeros).

        One flag per parameter travels with it: a parameter no rank computed a gradient for
        keeps ``grad = None``, as on one device, so the optimizer leaves it alone."""
        params = [p for p in module.parameters() if p.requires_grad]
        used = [p.grad is not None for p in params]
        grads = []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        flags = torch.tensor(used, dtype=grads[0].dtype if grads else torch.float32)
        flat = torch.cat([*(grad.reshape(-1) for grad in grads), flags.to(grads[0].device) if grads else flags])
        self._all_reduce(flat)
        offset = 0
        for grad in grads:
            count = grad.numel()
            grad.copy_(flat[offset : offset + count].view_as(grad))
            offset += count
        for p, anywhere in zip(params, flat[offset:].tolist()):
            if anywhere == 0:
                p.grad = None

    def sum_numbers(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64)
        self._all_reduce(tensor)
        return tensor.tolist()

    def gather_rows(self, local: torch.Tensor, num_rows: int) -> torch.Tensor:
        """The ``[num_rows, ...]`` tensor whose rows ``self.rows(num_rows)`` are ``local``,
        assembled from every rank's part (a sum of zero-padded parts)."""
        whole = torch.zeros((num_rows, *local.shape[1:]), dtype=local.dtype)
        rows = self.rows(num_rows)
        whole[rows] = local.to(whole.device)
        self._all_reduce(whole)
        return whole
