"""A CPU slot's overheads (``planner.cost.Overheads``), measured on tiny Llama models.

A small model on a CPU spends most of a pass in Python and operator dispatch, not in its
FLOPs. On this project's 2-core machine a decoder layer of a hidden-64 Llama took about
0.3 ms per forward pass, 1.1 ms per forward and backward and 0.19 ms per decode step, where
its FLOPs take microseconds; the cost model's fixed 20 us per layer priced the tiny
pipelines' first plans at a fifth to a third of their measured steps. The probe times
models of one and of three layers: the difference per added layer is a layer's overhead,
what is left of the one-layer time the pass's (or the step's). A layer's overhead grows
with the rows: here a hidden-64 layer took 0.33 ms per forward pass of 4 rows of 16 tokens
and 1.18 ms of 32 rows, of which its added FLOPs take about 0.3 ms. So both models run at 4
and at 32 rows, and the growth is charged per token of a pass (per row of a decode step).
That part holds the probe model's own FLOPs (about a third of it for a forward), which the
cost model charges again for the real model: small next to the small operations' costs it
measures. The passes run on one thread and are timed by that thread's CPU time, so that
other processes on the machine (a busy CI runner, another run) do not count; the models and
row counts take turns, a first round warms up, and the best of ``repeats`` more is kept,
with the garbage collector off. The global random state and the thread count are left as they were.

A run measures on one of its CPU workers, which load models anyway (``Cluster.cpu_overheads``),
so the driver imports neither torch nor transformers for it; ``flowrl plan`` and ``flowrl
simulate`` measure in their own process. A probe that fails leaves the defaults
(``CPU_OVERHEADS``), with a warning.
"""

from __future__ import annotations

import functools
import gc
import time
import warnings
from typing import Any

from flowrl.planner.cost import CPU_OVERHEADS, Overheads

PROBE_LAYERS = (1, 3)
"""Decoder layers of the two probe models."""
PROBE_ROWS = (4, 32)
PROBE_TOKENS = 16
"""Rows of the probe's passes and generations, a few and many, and tokens of a pass (and of a
decode's prompt: PROBE_TOKENS // 4)."""
DECODE_STEPS = 16
"""Decode steps timed beyond a first short generation (whose prefill they leave out)."""


def cpu_overheads_or_defaults(repeats: int = 5) -> Overheads:
    """:func:`measure_cpu_overheads`, or ``CPU_OVERHEADS`` with a warning when it fails."""
    try:
        return measure_cpu_overheads(repeats)
    except Exception as error:  # noqa: BLE001 - any failure leaves a plan on the defaults
        warnings.warn(f"the CPU overhead probe failed ({type(error).__name__}: {error}); "
                      "planning with the default per-layer overheads", RuntimeWarning, stacklevel=2)
        return CPU_OVERHEADS


@functools.lru_cache(maxsize=4)
def measure_cpu_overheads(repeats: int = 5) -> Overheads:
    """The overheads of a pass and of a decode step on this machine's CPU, per layer, per
    token of a pass or row of a step, and per pass or step (about 0.5 s once torch and
    transformers are imported; measured once per process and ``repeats``)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            timings = _timings([_tiny_llama(layers) for layers in PROBE_LAYERS], max(1, repeats))
    finally:
        torch.set_num_threads(threads)
    return overheads_from(timings)


def overheads_from(timings: dict[tuple[int, int], tuple[float, float, float]]) -> Overheads:
    """Overheads from the probe's (forward, forward and backward, decode step) seconds per
    (layers, rows): a layer's time is the difference per added layer; it grows with the rows
    by a part per token of a pass (``PROBE_TOKENS`` per row) or per row of a step, and what is
    left at no rows is the layer's own; what is left of the one-layer model at a few rows,
    beyond its layer, is the pass's (or step's)."""
    (few_layers, many_layers), (few_rows, many_rows) = PROBE_LAYERS, PROBE_ROWS
    added = many_layers - few_layers

    def layer_s(rows: int) -> list[float]:
        return [max(0.0, (more - less) / added)
                for less, more in zip(timings[few_layers, rows], timings[many_layers, rows])]

    narrow, wide = layer_s(few_rows), layer_s(many_rows)
    per_row = [max(0.0, (w - n) / (many_rows - few_rows)) for n, w in zip(narrow, wide)]
    per_unit = [per_row[0] / PROBE_TOKENS, per_row[1] / PROBE_TOKENS, per_row[2]]  # tokens of a pass, rows of a step
    units = [few_rows * PROBE_TOKENS, few_rows * PROBE_TOKENS, few_rows]
    own = [max(0.0, n - count * unit) for n, count, unit in zip(narrow, units, per_unit)]
    rest = [max(0.0, total - few_layers * layer) for total, layer in zip(timings[few_layers, few_rows], narrow)]
    return Overheads(forward_layer_s=own[0], train_layer_s=own[1], decode_layer_s=own[2],
                     forward_pass_s=rest[0], train_pass_s=rest[1], decode_step_s=rest[2],
                     forward_token_s=per_unit[0], train_token_s=per_unit[1], decode_row_s=per_unit[2])


def _tiny_llama(layers: int) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(config)


def _timings(models: list[Any], repeats: int) -> dict[tuple[int, int], tuple[float, float, float]]:
    """Per (model's layers, rows): (forward pass, forward and backward pass, decode step)
    seconds of this thread's CPU time, the best of ``repeats`` rounds in which the models and
    the row counts take turns."""
    import torch

    from flowrl.backends.static_decode import StaticDecoder

    decoders = [StaticDecoder(model.eval()) for model in models]

    def timed(call: Any) -> float:
        start = time.thread_time()
        call()
        return time.thread_time() - start

    def calls(model: Any, decoder: Any, rows: int) -> list[Any]:
        ids = torch.ones((rows, PROBE_TOKENS), dtype=torch.long)
        prompt = ids[:, : PROBE_TOKENS // 4]

        def forward() -> None:
            with torch.no_grad():
                model(input_ids=ids, use_cache=False)

        def train() -> None:
            with torch.enable_grad():
                model(input_ids=ids, use_cache=False).logits.sum().backward()

        def generate(steps: int) -> Any:
            return lambda: decoder.generate(prompt, torch.ones_like(prompt), steps, eos_token_id=64, pad_token_id=0,
                                            greedy=True)

        return [forward, train, generate(2 + DECODE_STEPS), generate(2)]

    keys = [(model.config.num_hidden_layers, rows) for model in models for rows in PROBE_ROWS]
    work = [calls(model, decoder, rows) for model, decoder in zip(models, decoders) for rows in PROBE_ROWS]
    best = [[float("inf")] * 4 for _ in work]
    collecting = gc.isenabled()
    gc.disable()
    try:
        for round_ in range(repeats + 1):
            for index, model_calls in enumerate(work):
                for kind, call in enumerate(model_calls):
                    seconds = timed(call)
                    if round_ > 0:  # the first round warms up
                        best[index][kind] = min(best[index][kind], seconds)
    finally:
        if collecting:
            gc.enable()
    return {key: (forward, train, (long - short) / DECODE_STEPS) for key, (forward, train, long, short) in zip(keys, best)}
