"""The decode step's matrix products: which GEMM implementation serves them fastest on this card.

    python benchmarks/decode_gemms.py --output benchmarks/results/decode_gemms_h200.json
    python benchmarks/decode_gemms.py --sections products --batches 256
    python benchmarks/decode_gemms.py --sections splits --repeats 5 --output benchmarks/results/decode_splits_h100.json
    python benchmarks/decode_gemms.py --sections layouts --output benchmarks/results/decode_layouts_h100.json

At batch 256 the layers' four matrix products (q/k/v stacked, attention output, gate/up
stacked, down) are about half of a 0.4B model's decode step (``gpu_profile.py``'s kernel
table). Sections, each writing what it measured:

- ``products``: each product alone at the decode shapes of ``decode.py``'s model (hidden 896,
  2 KV heads of 64, MLP 4864), as ``F.linear`` through cuBLAS, through cuBLASLt
  (``torch.backends.cuda.preferred_blas_library``) and compiled by inductor with
  ``max-autotune-no-cudagraphs`` (Triton templates benchmarked against cuBLAS). Timed as 48
  products captured in one CUDA graph, replayed: microseconds per product, launch cost aside.
- ``steps``: the whole static-cache decode (``decode.py``'s model and measure: milliseconds per
  decode step over 128 new tokens, prefill included) with the engine's compiled steps built
  by default, with cuBLASLt preferred, and with ``max-autotune-no-cudagraphs``; the default is
  measured again last, so that drift over the run shows. The engine's products now run
  outside its compiled steps (cuBLAS or its Triton product, ``decode_products``), so
  ``max-autotune`` tunes only the element-wise kernels; the results in
  ``benchmarks/results/decode_gemms_h100.json`` are from when the compiled halves held the
  products.
- ``layouts``: each product as the decode step meets it (24 layers' weights in turn: the
  gate/up and down weights, 418 and 209 MB, come from memory; the q/k/v and output ones, 50
  and 39 MB, may partly stay in an H100's 50 MB cache) in four memory layouts cuBLAS treats
  differently: ``x @ W.T`` with W [out, in] (``F.linear``, the engine's), ``x @ W`` with W
  stored [in, out], and the transposed output ``W @ x.T`` with W stored either way (timed
  alone: what reading a transposed output costs its consumer is not counted).
- ``splits``: the products cut along their inner dimension into 2, 4 and 8 partial sums
  (``static_decode._split_product``, one batched product over strided slices) against whole,
  alone as above (at the 0.4B shape and the 1.5B one: hidden 1536, MLP 8960); and the whole
  decode step with the down projection whole and in the engine's default parts, interleaved
  ``--repeats`` times per batch size.

Needs a CUDA device. Writes JSON with the commit measured; never asserts.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import decode as decode_bench  # noqa: E402
from vs_trl import machine  # noqa: E402

from flowrl.backends.static_decode import DEFAULT_DOWN_SPLITS, StaticDecoder, _split_product, decoder_for  # noqa: E402

PRODUCTS = {"qkv": (896, 896 + 2 * 2 * 64), "o": (896, 896), "gate_up": (896, 2 * 4864), "down": (4864, 896)}
"""Each product's (in, out) features at the shape of ``decode.py``'s model."""
SPLIT_PRODUCTS = {**PRODUCTS, "gate_up_1.5b": (1536, 2 * 8960), "down_1.5b": (8960, 1536)}
STEP_VARIANTS = (("default", None, "cublas"), ("cublaslt", None, "cublaslt"),
                 ("max_autotune", "max-autotune-no-cudagraphs", "cublas"), ("default_again", None, "cublas"))


def graph_us(call: Callable[[], Any], per_graph: int = 48, replays: int = 20, rounds: int = 5) -> float:
    """Microseconds per ``call()``: ``per_graph`` calls captured in one CUDA graph, replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(per_graph):
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end) * 1e3 / (per_graph * replays))
    return statistics.median(times)


def section_products(batches: list[int]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for batch in batches:
        for name, (features_in, features_out) in PRODUCTS.items():
            x = torch.randn(batch, features_in, device="cuda", dtype=torch.bfloat16)
            weight = torch.randn(features_out, features_in, device="cuda", dtype=torch.bfloat16) * 0.02
            row: dict[str, Any] = {}
            for library in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(library)
                row[library] = graph_us(lambda: F.linear(x, weight))
            torch.backends.cuda.preferred_blas_library("cublas")
            try:
                torch._dynamo.reset()
                compiled = torch.compile(lambda a, b: F.linear(a, b), mode="max-autotune-no-cudagraphs", dynamic=False)
                compiled(x, weight)
                row["inductor_max_autotune"] = graph_us(lambda: compiled(x, weight))
            except Exception as error:  # noqa: BLE001 - reported, the others still measured
                row["inductor_max_autotune"] = f"{type(error).__name__}: {str(error)[:200]}"
            results[f"{name}_batch{batch}"] = row
            print(name, batch, {key: round(value, 2) if isinstance(value, float) else value
                                for key, value in row.items()}, flush=True)
    return results


def section_layouts(batches: list[int], layers: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for batch in batches:
        for name, (features_in, features_out) in PRODUCTS.items():
            x = torch.randn(batch, features_in, device="cuda", dtype=torch.bfloat16)
            weights = [torch.randn(features_out, features_in, device="cuda", dtype=torch.bfloat16) * 0.02
                       for _ in range(layers)]
            stored_in_out = [weight.t().contiguous() for weight in weights]
            variants: dict[str, Callable[[int], Any]] = {
                "linear": lambda i: F.linear(x, weights[i]),
                "weight_in_out": lambda i: torch.mm(x, stored_in_out[i]),
                "output_transposed": lambda i: torch.mm(weights[i], x.t()),
                "output_transposed_weight_in_out": lambda i: torch.mm(stored_in_out[i].t(), x.t()),
            }
            row: dict[str, Any] = {}
            for variant, product in variants.items():
                def every_layer(product: Callable[[int], Any] = product) -> None:
                    for index in range(layers):
                        product(index)
                row[variant] = graph_us(every_layer, per_graph=2) / layers
            results[f"{name}_batch{batch}"] = row
            print("layouts", name, batch, {key: round(value, 2) for key, value in row.items()}, flush=True)
    return results


def step_variant(mode: str | None, library: str, batches: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """ms per decode step of a fresh model whose engine compiled its steps with ``mode``."""
    torch._dynamo.reset()
    torch.backends.cuda.preferred_blas_library(library)
    plain_compile = torch.compile
    if mode is not None:
        torch.compile = functools.partial(plain_compile, mode=mode)
    try:
        model = decode_bench.build_model(args.layers, "cuda")
        decoder = decoder_for(model)  # compiles its steps with torch.compile as set now
    finally:
        torch.compile = plain_compile
    assert decoder is not None
    results: dict[str, Any] = {}
    try:
        for batch in batches:
            ids = torch.randint(1, decode_bench.VOCAB - 1, (batch, args.prompt_tokens), device="cuda")
            mask = torch.ones_like(ids)
            generator = torch.Generator(device="cuda")

            def generate() -> None:
                decoder.generate(ids, mask, max_new_tokens=args.new_tokens, eos_token_id=decode_bench.EOS,
                                 pad_token_id=0, generator=generator.manual_seed(0))

            started = time.perf_counter()
            generate()
            torch.cuda.synchronize()
            first_s = time.perf_counter() - started
            per_step = []
            for _ in range(args.repeats):
                torch.cuda.synchronize()
                started = time.perf_counter()
                generate()
                torch.cuda.synchronize()
                per_step.append((time.perf_counter() - started) / args.new_tokens * 1e3)
            results[str(batch)] = {"ms_per_decode_step": statistics.median(per_step), "all": per_step,
                                   "first_call_s": first_s}
            print(mode or "default", library, batch, results[str(batch)], flush=True)
    finally:
        torch.backends.cuda.preferred_blas_library("cublas")
        del decoder, model
        torch.cuda.empty_cache()
    return results


def section_splits(batches: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """Products in 1, 2, 4 and 8 parts alone; the decode step with the down projection whole
    and in the default parts, interleaved."""
    products: dict[str, Any] = {}
    for batch in batches:
        for name, (features_in, features_out) in SPLIT_PRODUCTS.items():
            x = torch.randn(batch, features_in, device="cuda", dtype=torch.bfloat16)
            weight = torch.randn(features_out, features_in, device="cuda", dtype=torch.bfloat16) * 0.02
            row: dict[str, Any] = {"1": graph_us(lambda: F.linear(x, weight))}
            exact = x.float() @ weight.float().T
            row["1_max_error"] = (F.linear(x, weight).float() - exact).abs().max().item()
            for splits in (2, 4, 8):
                row[str(splits)] = graph_us(functools.partial(_split_product, x, weight, splits))
                row[f"{splits}_max_error"] = (_split_product(x, weight, splits).float().sum(0) - exact).abs().max().item()
            products[f"{name}_batch{batch}"] = row
            print(name, batch, {key: round(value, 3) for key, value in row.items()}, flush=True)
    model = decode_bench.build_model(args.layers, "cuda")
    variants = {"down_whole": 1, f"down_in_{DEFAULT_DOWN_SPLITS}": DEFAULT_DOWN_SPLITS}
    decoders = {name: StaticDecoder(model, down_splits=splits) for name, splits in variants.items()}
    generator = torch.Generator(device="cuda")
    steps: dict[str, Any] = {}
    for batch in batches:
        ids = torch.randint(1, decode_bench.VOCAB - 1, (batch, args.prompt_tokens), device="cuda")
        mask = torch.ones_like(ids)
        runs: dict[str, list[float]] = {name: [] for name in decoders}
        for round_index in range(args.repeats + 1):  # round 0 compiles and captures: not counted
            for name, decoder in decoders.items():
                torch.cuda.synchronize()
                started = time.perf_counter()
                decoder.generate(ids, mask, max_new_tokens=args.new_tokens, eos_token_id=decode_bench.EOS,
                                 pad_token_id=0, generator=generator.manual_seed(0))
                torch.cuda.synchronize()
                if round_index:
                    runs[name].append((time.perf_counter() - started) / args.new_tokens * 1e3)
        whole, split = runs.values()
        ratios = [b / a for a, b in zip(whole, split)]
        steps[str(batch)] = {**{name: {"ms_per_decode_step": statistics.median(times), "all": times}
                                for name, times in runs.items()},
                             "split_over_whole": {"median": statistics.median(ratios), "min": min(ratios),
                                                  "max": max(ratios), "per_round": ratios}}
        print("step", batch, steps[str(batch)], flush=True)
    return {"products_us": products, "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="products,steps")
    parser.add_argument("--batches", default="256,64")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks" / "results" / "decode_gemms.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_gemms.py measures GPU kernels: it needs a CUDA device")
    batches = [int(item) for item in args.batches.split(",")]
    report: dict[str, Any] = {"benchmark": "decode_gemms", "machine": machine(),
                              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "settings": {key: str(value) for key, value in vars(args).items()}}
    args.output.parent.mkdir(parents=True, exist_ok=True)

    def write() -> None:  # after each part: a call cut short keeps what it measured
        args.output.write_text(json.dumps(report, indent=1) + "\n")

    sections = args.sections.split(",")
    if "products" in sections:
        report["products_us"] = section_products(batches)
        write()
    if "steps" in sections:
        report["steps"] = {}
        for name, mode, library in STEP_VARIANTS:
            try:
                report["steps"][name] = step_variant(mode, library, batches, args)
            except Exception as error:  # noqa: BLE001 - reported, the next variant still runs
                report["steps"][name] = f"{type(error).__name__}: {str(error)[:300]}"
            write()
    if "layouts" in sections:
        report["layouts_us"] = section_layouts(batches, args.layers)
        write()
    if "splits" in sections:
        report["splits"] = section_splits(batches, args)
    write()
    print(f"written: {args.output}")


if __name__ == "__main__":
    main()
