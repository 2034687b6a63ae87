"""The matrix products of a decode step, each run by cuBLAS or by a Triton kernel, whichever
this card runs faster at this shape.

A decode step multiplies one row per sequence (256 at most in a GRPO batch) by each weight of
every layer. On an H100 at the 0.4B shape and 256 rows, cuBLAS took 12 us for the stacked
gate/up product, 10 us for the down projection and 5 us each for the q/k/v and output
projections, two to eight times what reading their weights from memory takes
(``benchmarks/results/gpu_profile_decode_h100_8df35a9.json``): with so few rows a product has
few output blocks, each walking the whole inner dimension. The Triton kernel
(``decode_kernels.product_kernel``) may cut the inner dimension into slices (``splits``) whose
partial sums, [splits, B, N], the consumer adds, as ``static_decode._split_product``'s; and
the gated product of the MLP is one kernel that stores silu(gate) * up, so the [B, 2I] product
is never written nor read back.

Which one runs is measured once per card, product shape and batch size
(:func:`choose_launch`): every candidate runs the product of every layer in turn, so the
weights come from memory as in a step, not from the cache of a product repeated on one weight;
rounds alternate the candidates; the fastest Triton launch wins where its median is at most
95 % of cuBLAS's (``MARGIN``). Only the product is timed: the partial sums of a launch cut into
more slices than cuBLAS's cost the norm that adds them a little more, which the choice does not
see.
"""

from __future__ import annotations

import statistics
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from flowrl.backends.decode_attention import has_triton

KINDS = ("qkv", "o", "gated", "down")
"""A layer's products: the stacked q/k/v projection (with Qwen2's biases), the attention's
output projection, the stacked gate/up projection with silu(gate) * up, the down projection."""


@dataclass(frozen=True)
class Launch:
    """A launch of the Triton product: output blocks of ``block_m`` rows by ``block_n``
    columns, the inner dimension walked ``block_k`` at a time and cut into ``splits`` slices;
    ``warps`` per program, ``stages`` loads in flight."""

    block_m: int
    block_n: int
    block_k: int
    splits: int = 1
    warps: int = 4
    stages: int = 4

    def fits(self, inner: int) -> bool:
        """Every slice of the inner dimension is a whole number of blocks."""
        return inner % self.splits == 0 and (inner // self.splits) % self.block_k == 0


CANDIDATES: dict[str, tuple[Launch, ...]] = {
    # inner dimension = hidden size (896 at 0.4B): short. The attention reads q/k/v whole: no
    # slices; the output projection's partial sums go to the norm after it.
    "qkv": (Launch(64, 64, 64), Launch(64, 32, 128), Launch(128, 64, 64, warps=8, stages=3),
            Launch(64, 128, 64, warps=8, stages=3)),
    "o": (Launch(64, 64, 64), Launch(64, 64, 64, splits=2), Launch(64, 32, 128), Launch(64, 64, 32, splits=4)),
    # two accumulators per block (gate and up); thousands of outputs: no splits
    "gated": (Launch(64, 64, 64), Launch(128, 64, 64, warps=8, stages=3), Launch(64, 128, 64, warps=8, stages=3),
              Launch(128, 32, 64), Launch(64, 32, 128)),
    # inner dimension = MLP size (4,864 at 0.4B): long against its outputs
    "down": (Launch(64, 64, 64, splits=4), Launch(64, 32, 64, splits=4), Launch(128, 64, 64, splits=4, warps=8, stages=3),
             Launch(64, 64, 32, splits=8), Launch(64, 64, 64, splits=2), Launch(64, 64, 128)),
}
"""The Triton launches tried for each product (those that ``fit`` its inner dimension); every
one compiles once per process, the first time it is timed."""

SLICED = ("o", "down")
"""The products whose consumer adds partial sums (the norm after each): only these are cut."""


def most_splits() -> int:
    """The most slices a down projection's Triton launch cuts its inner dimension into: its
    partial sums are what the next layer's norm adds."""
    return max(launch.splits for launch in CANDIDATES["down"])


MARGIN = 0.95
"""A Triton launch replaces cuBLAS only when it takes at most this share of cuBLAS's time: a
launch measured a little faster alone may not be faster in the step (the choice times the
products alone; a run of the step's kernels is not timed)."""

ROUNDS = 5
"""Timed rounds per candidate; each round runs the product of every layer once."""

_CHOSEN: dict[tuple[object, ...], Launch | None] = {}
"""Choices made in this process, by (device, kind, rows, weight shape, dtype, bias, variant)."""
MEASURED: dict[tuple[object, ...], dict[Launch | None, float]] = {}
"""What each choice measured: milliseconds for the product of every layer, per candidate."""


def triton_usable(x: torch.Tensor) -> bool:
    """True where the Triton product can run: a CUDA tensor of a floating dtype, Triton installed."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and has_triton()


def triton_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, launch: Launch,
                   gated: bool = False) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for [B, K] ``x`` and [N, K] ``weight``: [B, N], or its
    [splits, B, N] partial sums when ``launch`` cuts K. ``gated``: ``weight`` stacks the gate
    and up rows ([2I, K]) and the result is silu(gate) * up, [B, I] (one slice only)."""
    rows, inner = x.shape
    outputs = weight.shape[0] // 2 if gated else weight.shape[0]
    if weight.shape[1] != inner or not launch.fits(inner) or (gated and (launch.splits > 1 or bias is not None)):
        raise ValueError(f"launch {launch} does not fit a product of [{rows}, {inner}] by {tuple(weight.shape)}"
                         f"{' (gated)' if gated else ''}")
    from flowrl.backends.decode_kernels import product_kernel

    x, weight = x.contiguous(), weight.contiguous()
    shape = (launch.splits, rows, outputs) if launch.splits > 1 else (rows, outputs)
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    grid = (-(-outputs // launch.block_n), launch.splits, -(-rows // launch.block_m))
    product_kernel[grid](
        x, weight, weight if bias is None else bias, out, rows, outputs, inner // launch.splits,
        x.stride(0), weight.stride(0), rows * outputs, outputs,
        HAS_BIAS=bias is not None, GATED=gated, EXACT=x.dtype == torch.float32,
        BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
        num_warps=launch.warps, num_stages=launch.stages,
    )
    return out


Product = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
"""A product's plain form: (x, weight, bias) -> output."""
Run = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]
"""A candidate timed: (weight, bias) -> output, for the input chosen for."""


def choose_launch(kind: str, x: torch.Tensor, weights: Sequence[torch.Tensor],
                  biases: Sequence[torch.Tensor | None], plain: Product, variant: object = None,
                  stream: torch.cuda.Stream | None = None) -> Launch | None:
    """The faster way to run product ``kind`` (``KINDS``) for input ``x`` [B, K] on this card:
    a Triton launch, or None for ``plain`` (cuBLAS). ``weights`` / ``biases``: the product's
    operand in every layer, in order; ``variant``: what else sets what ``plain`` runs (its
    slices, a compiled step); ``stream``: the stream the timing runs on (cuBLAS keeps a
    workspace for each stream it runs on; by default a new one). Made once per process for
    each card, kind, row count, weight shape, dtype and variant. A Triton candidate that fails
    to compile, run or be captured is left out with a warning."""
    key = (x.device, kind, x.shape[0], tuple(weights[0].shape), x.dtype, biases[0] is not None, variant)
    if key in _CHOSEN:
        return _CHOSEN[key]
    if not triton_usable(x):
        return None
    gated = kind == "gated"
    if any(launch.splits > 1 for launch in CANDIDATES[kind]) and kind not in SLICED:
        raise ValueError(f"the {kind} product's consumer does not add partial sums")

    def run_with(launch: Launch | None) -> Run:
        if launch is None:
            return lambda weight, bias: plain(x, weight, bias)
        return lambda weight, bias: triton_product(x, weight, bias, launch, gated)

    fitting = [launch for launch in CANDIDATES[kind] if launch.fits(x.shape[1])]
    runs = {launch: run_with(launch) for launch in [None, *fitting]}
    times = MEASURED[key] = _timed(kind, runs, weights, biases, stream or torch.cuda.Stream(x.device))
    best = pick(times)
    _CHOSEN[key] = best
    return best


def pick(times: dict[Launch | None, float]) -> Launch | None:
    """The fastest Triton launch where it takes at most ``MARGIN`` of cuBLAS's time (None),
    else cuBLAS."""
    launches = [launch for launch in times if launch is not None]
    if not launches:
        return None
    fastest = min(launches, key=lambda launch: times[launch])
    return fastest if None not in times or times[fastest] <= MARGIN * times[None] else None


def _timed(kind: str, runs: dict[Launch | None, Run], weights: Sequence[torch.Tensor],
           biases: Sequence[torch.Tensor | None], stream: torch.cuda.Stream) -> dict[Launch | None, float]:
    """Median milliseconds of each run over every layer's operands. Each run is captured in a
    CUDA graph and replayed, as the decode step is (launched one by one from Python, the small
    products would time their launches); rounds alternate the runs, and the card's cache is
    overwritten before each replay, as a step's other layers do. A Triton run that fails is
    left out; the plain run's failure is raised."""
    device = weights[0].device
    graphs = {}
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for launch, run in runs.items():
            try:
                for weight, bias in zip(weights, biases):  # set-up and compiles outside the capture
                    run(weight, bias)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    for weight, bias in zip(weights, biases):
                        run(weight, bias)
                graphs[launch] = graph
            except Exception as error:  # noqa: BLE001 - a launch this card or Triton cannot run
                if launch is None:
                    raise
                warnings.warn(f"the Triton decode product {launch} failed for {kind} ({type(error).__name__}: "
                              f"{str(error)[:200]}); it is not used", stacklevel=2)
    torch.cuda.current_stream(device).wait_stream(stream)
    flush = torch.empty(_cache_bytes(device) * 2, dtype=torch.uint8, device=device)
    times: dict[Launch | None, list[float]] = {launch: [] for launch in graphs}
    order = list(graphs)
    for round_index in range(ROUNDS):
        for launch in order[round_index % len(order):] + order[:round_index % len(order)]:
            flush.fill_(round_index)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs[launch].replay()
            end.record()
            end.synchronize()
            times[launch].append(start.elapsed_time(end))
    return {launch: statistics.median(values) for launch, values in times.items()}


def _cache_bytes(device: torch.device) -> int:
    properties = torch.cuda.get_device_properties(device)
    return int(getattr(properties, "L2_cache_size", 0) or 64 * 2**20)
