"""Training one model on several devices: every rank takes its share of each mini-batch.

Every rank holds the whole rollout and walks the same mini-batches in the same order (the
shuffle is a function of seed and update count). Within a mini-batch, rank r takes rows
``weighted_rows(n, r, shares)``, scales its loss by its share of the mini-batch's normaliser
(tokens for ``token_mean``, sequences for ``seq_mean``), and the gradients are summed over
the ranks. The sum is then exactly the gradient of the whole mini-batch's loss, so the
optimizer steps, identical on every rank, are those of one device (to float rounding).

The gradient sum overlaps the last pass's backward: the parameters are cut into buckets of
about ``bucket_bytes`` (in reverse order, the order their gradients become final), and a
bucket's all-reduce starts as soon as each of its gradients is final and every bucket before
it has started. Every rank starts the buckets in the same order (the collectives must match),
a rank with no rows among them; what a rank never computed goes as zeros at the end, with a
flag per parameter so that a parameter no rank used keeps no gradient, as on one device.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol

import torch

BUCKET_BYTES = 25 * 2**20
"""Gradient bytes per all-reduce bucket, default 25 MiB: large enough that a collective's
fixed cost is small, small enough that the first buckets start early in the backward."""


class Pending(Protocol):
    def wait(self) -> Any:
        """Block until the collective has finished."""


class Collective(Protocol):
    rank: int
    world: int

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum over the ranks, in place."""
        ...

    def all_reduce_start(self, tensor: torch.Tensor) -> Pending:
        """Start summing ``tensor`` over the ranks in place; ``wait()`` on the result."""
        ...


class _Buckets:
    """The parameters of one module cut into buckets, and the all-reduces under way."""

    def __init__(self, params: list[torch.nn.Parameter], bucket_bytes: int) -> None:
        self.params = params
        self.buckets: list[list[int]] = []
        size = bucket_bytes + 1
        for index in reversed(range(len(params))):
            nbytes = params[index].numel() * params[index].element_size()
            if size + nbytes > bucket_bytes and (not self.buckets or self.buckets[-1]):
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(index)
            size += nbytes
        self.bucket_of = {index: number for number, bucket in enumerate(self.buckets) for index in bucket}
        self.reset()

    def reset(self) -> None:
        self.final = [False] * len(self.params)
        self.remaining = [len(bucket) for bucket in self.buckets]
        self.started: list[tuple[torch.Tensor, Pending]] = []
        self.started_in_backward = 0


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
    bucket_bytes: int = BUCKET_BYTES
    """Gradient bytes per all-reduce bucket."""
    buckets_started_in_backward: int = 0
    """Buckets whose all-reduce started while a backward was still running (all calls)."""
    mesh: Any = None
    """A ``DeviceMesh`` over the group: the model is then sharded over it (FSDP2,
    :mod:`flowrl.roles.sharded`) instead of whole on every rank with summed gradients."""
    _buckets: dict[int, _Buckets] = field(default_factory=dict, repr=False)


    def _all_reduce(self, tensor: torch.Tensor) -> None:
        started = time.perf_counter()
        self.collective.all_reduce(tensor)
        self.blocked_s += time.perf_counter() - started

    @property
    def rank(self) -> int:
        return self.collective.rank

    @property
    def sharded(self) -> bool:
        return self.mesh is not None

    def rows(self, num_rows: int) -> slice:
        return weighted_rows(num_rows, self.rank, self.shares)

    def _buckets_of(self, module: torch.nn.Module) -> _Buckets:
        if id(module) not in self._buckets:
            params = [p for p in module.parameters() if p.requires_grad]
            self._buckets[id(module)] = _Buckets(params, self.bucket_bytes)
        return self._buckets[id(module)]

    def _start(self, buckets: _Buckets, number: int, in_backward: bool) -> None:
        """Start bucket ``number``'s all-reduce (gradients not computed here go as zeros)."""
        grads = []
        for index in buckets.buckets[number]:
            grad = buckets.params[index].grad
            grads.append(grad.reshape(-1) if grad is not None else torch.zeros(
                buckets.params[index].numel(), dtype=buckets.params[index].dtype,
                device=buckets.params[index].device))
        flat = torch.cat(grads)
        buckets.started.append((flat, self.collective.all_reduce_start(flat)))
        if in_backward:
            buckets.started_in_backward += 1
            self.buckets_started_in_backward += 1

    def _start_ready(self, buckets: _Buckets, in_backward: bool) -> None:
        """Start, in order, every bucket whose gradients are all final and whose predecessors
        have started."""
        while len(buckets.started) < len(buckets.buckets) and buckets.remaining[len(buckets.started)] == 0:
            self._start(buckets, len(buckets.started), in_backward)

    @contextlib.contextmanager
    def overlapping(self, module: torch.nn.Module) -> Iterator[None]:
        """Around the last pass's backward: each gradient is final when autograd has added
        this pass into it, and full buckets start their all-reduce at once."""
        buckets = self._buckets_of(module)
        buckets.reset()

        def final(index: int) -> Any:
            def hook(param: torch.Tensor) -> None:
                if not buckets.final[index]:
                    buckets.final[index] = True
                    buckets.remaining[buckets.bucket_of[index]] -= 1
                    self._start_ready(buckets, in_backward=True)
            return hook

        handles = [param.register_post_accumulate_grad_hook(final(index))
                   for index, param in enumerate(buckets.params)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def sum_gradients(self, module: torch.nn.Module) -> None:
        """Finish summing every gradient over the ranks: start the buckets not started yet
        (all of them without :meth:`overlapping`), wait for all, write the sums back.

        One flag per parameter travels too: a parameter no rank computed a gradient for
        keeps ``grad = None``, as on one device, so the optimizer leaves it alone."""
        buckets = self._buckets_of(module)
        if not any(buckets.final):
            buckets.reset()  # no overlapped backward on this rank for this step
        used = [p.grad is not None for p in buckets.params]
        started = time.perf_counter()
        while len(buckets.started) < len(buckets.buckets):
            self._start(buckets, len(buckets.started), in_backward=False)
        flags = torch.tensor(used, dtype=torch.float32)
        self.collective.all_reduce(flags)
        for number, (flat, pending) in enumerate(buckets.started):
            pending.wait()
            offset = 0
            for index in buckets.buckets[number]:
                param = buckets.params[index]
                count = param.numel()
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                param.grad.copy_(flat[offset : offset + count].view_as(param.grad))
                offset += count
        self.blocked_s += time.perf_counter() - started
        for param, anywhere in zip(buckets.params, flags.tolist()):
            if anywhere == 0:
                param.grad = None
        buckets.reset()

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
