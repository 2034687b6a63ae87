"""Training one model on several devices: every rank takes its share of each mini-batch.

Every rank holds the whole rollout and walks the same mini-batches in the same order (the
shuffle is a function of seed and update count). Within a mini-batch, rank r takes rows
``weighted_rows(n, r, shares)``, scales its loss by its share of the mini-batch's normaliser
(tokens for ``token_mean``, sequences with tokens for ``seq_mean``, sequences for
``token_sum_norm``), and the gradients are summed over
the ranks. The sum is then exactly the gradient of the whole mini-batch's loss, so the
optimizer steps, identical on every rank, are those of one device (to float rounding).

The gradient sum overlaps the last pass's backward: the parameters are cut into buckets of
about ``bucket_bytes`` (in reverse order, the order their gradients become final), and a
bucket's all-reduce starts as soon as each of its gradients is final and every bucket before
it has started. Every rank starts the buckets in the same order (the collectives must match),
a rank with no rows among them. Each parameter's gradient is a view into its bucket's one flat
tensor (:meth:`DataParallel.attach`, before the step's first backward): autograd adds into
the buckets and the all-reduce sums them in place, so the gradients are neither copied into
the buckets nor back, nor held twice. A flag per parameter (set when autograd adds to it)
travels too, so that a parameter no rank used keeps no gradient, as on one device.

A module's buckets outlive the update (a run makes a :class:`DataParallel` per call of the
node): their layout, flat tensors and hooks are made by the first data-parallel update and
reused by the next ones, which only zero the flat tensors. Between updates the hooks do
nothing; an update of the module without a group takes them off (:func:`release`).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass
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
        self.bucket_bytes = bucket_bytes
        self.buckets: list[list[int]] = []
        # One flat tensor per bucket, so one dtype and device per bucket: each kind of
        # parameter fills a bucket of its own kind (numbered as opened), and a model that
        # alternates kinds (fp32 norms between bf16 matrices) still gets full buckets.
        filling: dict[tuple[torch.dtype, torch.device], int] = {}
        sizes: list[int] = []
        for index in reversed(range(len(params))):
            nbytes = params[index].numel() * params[index].element_size()
            kind = (params[index].dtype, params[index].device)
            number = filling.get(kind)
            if number is None or sizes[number] + nbytes > bucket_bytes:
                number = filling[kind] = len(self.buckets)
                self.buckets.append([])
                sizes.append(0)
            self.buckets[number].append(index)
            sizes[number] += nbytes
        self.bucket_of = {index: number for number, bucket in enumerate(self.buckets) for index in bucket}
        # one flat tensor per bucket, and each parameter's view into its bucket's (attach)
        self.flats: list[torch.Tensor] | None = None
        self.views: list[torch.Tensor] = []
        self.hooks: list[Any] = []
        # the update whose step is running (attach to the end of sum_gradients); the hooks
        # do nothing while it is None
        self.owner: DataParallel | None = None
        self.reset()

    def reset(self) -> None:
        self.used = [False] * len(self.params)
        self.final = [False] * len(self.params)
        self.remaining = [len(bucket) for bucket in self.buckets]
        self.started: list[Pending] = []
        self.started_in_backward = 0
        self.last_pass = False

    def attach(self) -> None:
        """Zeroed flat tensors, one per bucket, and every parameter's gradient a view into
        its bucket's (replacing any other gradient it had). The flat tensors and views of an
        earlier update are zeroed in place and kept."""
        if self.flats is None:
            self.flats, self.views = [], [torch.empty(0)] * len(self.params)
            for bucket in self.buckets:
                first = self.params[bucket[0]]
                flat = torch.zeros(sum(self.params[i].numel() for i in bucket), dtype=first.dtype, device=first.device)
                offset = 0
                for index in bucket:
                    param = self.params[index]
                    self.views[index] = flat[offset : offset + param.numel()].view_as(param)
                    offset += param.numel()
                self.flats.append(flat)
        else:
            for flat in self.flats:
                flat.zero_()
        for param, view in zip(self.params, self.views):
            # A gradient left as None (a parameter no rank used, a skipped step) or replaced
            # (a step without the group) is pointed at its view again.
            if param.grad is not view:
                param.grad = view

    def hook_up(self) -> None:
        """A hook on each parameter, once: it notes that autograd added to the parameter and,
        in the last pass (:meth:`DataParallel.overlapping`), starts the buckets whose
        gradients are then final."""
        if self.hooks:
            return
        # The hooks reach the buckets weakly: a parameter's hooks are held on torch's side,
        # where Python's collector cannot see a cycle through them, so a strong reference
        # would keep the buckets, and through them the parameters, alive after the model.
        reach = weakref.ref(self)

        def added(index: int) -> Any:
            def hook(param: torch.Tensor) -> None:
                buckets = reach()
                owner = buckets.owner if buckets is not None else None
                if buckets is None or owner is None:
                    return
                buckets.used[index] = True
                if buckets.last_pass and not buckets.final[index]:
                    buckets.final[index] = True
                    buckets.remaining[buckets.bucket_of[index]] -= 1
                    owner._start_ready(buckets, in_backward=True)
            return hook

        self.hooks = [param.register_post_accumulate_grad_hook(added(index)) for index, param in enumerate(self.params)]

    def release(self) -> None:
        """Hooks off the parameters; the flat tensors go with the gradients that view them."""
        for handle in self.hooks:
            handle.remove()
        self.hooks = []
        self.flats, self.views, self.owner = None, [], None


_KEPT: weakref.WeakKeyDictionary[torch.nn.Module, _Buckets] = weakref.WeakKeyDictionary()
"""Each module's buckets, from one data-parallel update to the next (the module's lifetime)."""


def release(module: torch.nn.Module) -> None:
    """``module`` trains without a replicated group now: its buckets' hooks come off."""
    buckets = _KEPT.pop(module, None)
    if buckets is not None:
        buckets.release()


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
        """The module's kept buckets, made again when its trained parameters or the bucket
        size changed."""
        params = [p for p in module.parameters() if p.requires_grad]
        kept = _KEPT.get(module)
        if kept is not None and kept.bucket_bytes == self.bucket_bytes and len(kept.params) == len(params) \
                and all(a is b for a, b in zip(kept.params, params)):
            return kept
        release(module)
        _KEPT[module] = buckets = _Buckets(params, self.bucket_bytes)
        return buckets

    def attach(self, module: torch.nn.Module) -> None:
        """Before a step's first backward (see :meth:`attached`): every gradient of
        ``module`` a zeroed view into its bucket, and a hook on each parameter that notes
        that autograd added to it and, in the last pass (:meth:`overlapping`), starts the
        buckets whose gradients are then final.

        A parameter's gradient is final after autograd's first addition to it in the last
        pass's backward: autograd sums every use of a parameter in one graph (tied weights
        included) before adding it once. A parameter used by two regions that a backward
        recomputes separately (reentrant activation checkpointing of shared weights) would
        get a second addition after its bucket started: no model flowrl loads does that."""
        buckets = self._buckets_of(module)
        buckets.reset()
        buckets.attach()
        buckets.hook_up()
        buckets.owner = self

    @contextlib.contextmanager
    def attached(self, module: torch.nn.Module) -> Iterator[None]:
        """:meth:`attach` for the block; its hooks do nothing after it, an error included.
        After an error the buckets are let go: all-reduces started before it may still be
        writing into their flat tensors, which the next step must not zero and reuse."""
        self.attach(module)
        try:
            yield
        except BaseException:
            release(module)
            raise
        finally:
            buckets = _KEPT.get(module)
            if buckets is not None:
                buckets.owner = None

    def _start(self, buckets: _Buckets, number: int, in_backward: bool) -> None:
        """Start bucket ``number``'s all-reduce, in place on its flat tensor."""
        assert buckets.flats is not None
        buckets.started.append(self.collective.all_reduce_start(buckets.flats[number]))
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
        buckets.last_pass = True
        try:
            yield
        finally:
            buckets.last_pass = False

    def sum_gradients(self, module: torch.nn.Module, numbers: list[float]) -> list[float]:
        """Finish summing every gradient over the ranks: start the buckets not started yet
        (all of them without :meth:`overlapping`) and wait for all; the sums are then in
        the gradients themselves (views into the buckets, :meth:`attach`). Returns the sums
        of ``numbers`` (the step's loss terms), which travel in the same collective as the
        flags of the parameters autograd added to: a parameter no rank computed a gradient
        for keeps ``grad = None``, as on one device."""
        buckets = self._buckets_of(module)
        if buckets.owner is not self:
            raise RuntimeError("DataParallel.attach(module) must run before the step's first backward")
        buckets.owner = None
        started = time.perf_counter()
        while len(buckets.started) < len(buckets.buckets):
            self._start(buckets, len(buckets.started), in_backward=False)
        # float64 holds the 0/1 flags and the sums exactly enough for both
        summed = torch.tensor([*numbers, *(float(used) for used in buckets.used)], dtype=torch.float64)
        self.collective.all_reduce(summed)
        for pending in buckets.started:
            pending.wait()
        self.blocked_s += time.perf_counter() - started
        values = summed.tolist()
        for param, anywhere in zip(buckets.params, values[len(numbers):]):
            if anywhere == 0:
                param.grad = None
        buckets.reset()
        return values[: len(numbers)]

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
