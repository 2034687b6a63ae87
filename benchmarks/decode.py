"""Decode speed: flowrl's static-cache engine and its plain loop against ``transformers``
``generate()``, same model.

    python benchmarks/decode.py --batches 64,256 --new-tokens 128 \
        --output benchmarks/results/decode_h200.json

A random-init causal LM of Qwen2.5-0.5B's shape with a 32,000-token vocabulary (hidden 896,
24 layers, 14 heads, 2 KV heads, intermediate 4864, tied embeddings), bf16 on the GPU (fp32 on
a CPU, where it is slow: use a small ``--layers`` there). Prompts of ``--prompt-tokens`` random
tokens; sampling at temperature 1 with an end-of-sequence id outside the vocabulary (so every
run decodes exactly ``--new-tokens`` steps). Per engine and batch size: milliseconds per decode step (the whole
call divided by the number of new tokens, the prefill included), generated tokens/s, peak GPU
memory; the median of ``--repeats`` runs after one warm-up (timed: the first call compiles,
captures and, for the static engine, measures cuBLAS against the Triton products), and the
flowrl/transformers ratio of the medians with its range over the repeats; for the static engine,
the launch it chose for each product. ``flowrl_static_cublas`` is the static engine with every
product by cuBLAS. Writes JSON; never asserts.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from flowrl.backends.generation import generate_tokens  # noqa: E402
from flowrl.backends.static_decode import StaticDecoder, decoder_for  # noqa: E402

VOCAB = 32_000
EOS = VOCAB
"""Outside the vocabulary: never sampled, so every run decodes exactly --new-tokens steps."""


def build_model(layers: int, device: str) -> torch.nn.Module:
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=896, num_hidden_layers=layers, num_attention_heads=14,
        num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True,
        max_position_embeddings=4096, pad_token_id=0,
    )
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    return model.eval()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


_GENERATORS: dict[str, torch.Generator] = {}


def run_static(model: Any, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int) -> None:
    decoder = decoder_for(model)
    assert decoder is not None
    _decode(decoder, ids, mask, new_tokens, str(ids.device))


_CUBLAS: dict[int, StaticDecoder] = {}


def run_static_cublas(model: Any, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int) -> None:
    """The static engine with every product by cuBLAS (no Triton products measured or run)."""
    if id(model) not in _CUBLAS:
        _CUBLAS[id(model)] = StaticDecoder(model, triton_products=False)
    _decode(_CUBLAS[id(model)], ids, mask, new_tokens, f"{ids.device}-cublas")


def _decode(decoder: StaticDecoder, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, key: str) -> None:
    # One generator per decoder (``key``), re-seeded per call, as a generate node keeps its
    # own: the captured graphs replay with the generator they were captured with (a new one
    # means capturing again).
    generator = _GENERATORS.setdefault(key, torch.Generator(device=ids.device))
    decoder.generate(ids, mask, max_new_tokens=new_tokens, eos_token_id=EOS, pad_token_id=0,
                     generator=generator.manual_seed(0))


def launches(model: Any, batch: int) -> dict[str, Any] | None:
    """The launch the static engine chose for each product at ``batch`` rows (None: cuBLAS)."""
    decoder = decoder_for(model)
    chosen = decoder._launches.get(batch) if decoder is not None else None
    if chosen is None:
        return None
    return {kind: None if launch is None else dataclasses.asdict(launch) for kind, launch in chosen.items()}


def measured_products() -> list[dict[str, Any]]:
    """What the static engine's choices measured: per product and batch, milliseconds for
    every layer's product by each candidate (``cublas`` or a Triton launch)."""
    from flowrl.backends.decode_products import MEASURED

    return [{"kind": key[1], "rows": key[2], "weight": list(key[3]),  # type: ignore[call-overload]
             "ms": {"cublas" if launch is None else str(dataclasses.astuple(launch)): ms for launch, ms in times.items()}}
            for key, times in MEASURED.items()]


def run_loop(model: Any, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int) -> None:
    generate_tokens(model, ids, mask, max_new_tokens=new_tokens, eos_token_id=EOS, pad_token_id=0,
                    generator=torch.Generator(device=ids.device).manual_seed(0))


def run_hf(model: Any, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int) -> None:
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                   do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0, eos_token_id=EOS)


def measure(engine: Any, model: Any, batch: int, args: argparse.Namespace, device: str) -> dict[str, Any]:
    ids = torch.randint(1, VOCAB - 1, (batch, args.prompt_tokens), device=device)
    mask = torch.ones_like(ids)
    started = time.perf_counter()
    with torch.inference_mode():  # warm-up at full length: a short one leaves the first timed run 4x slower
        engine(model, ids, mask, args.new_tokens)
    sync(device)
    warm_up_s = time.perf_counter() - started
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.repeats):
        sync(device)
        started = time.perf_counter()
        with torch.inference_mode():
            engine(model, ids, mask, args.new_tokens)
        sync(device)
        times.append(time.perf_counter() - started)
    per_step = [t / args.new_tokens * 1e3 for t in times]
    return {
        "ms_per_decode_step": statistics.median(per_step),
        "ms_per_decode_step_all": per_step,
        "tokens_per_s": batch * args.new_tokens / statistics.median(times),
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else None,
        "warm_up_s": warm_up_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", default="flowrl_static,flowrl_loop,transformers",
                        help="comma-separated, from flowrl_static, flowrl_static_cublas (every product by "
                             "cuBLAS), flowrl_loop, transformers")
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks" / "results" / "decode.json")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(args.layers, device)
    rows = []
    every = {"flowrl_static": run_static, "flowrl_static_cublas": run_static_cublas, "flowrl_loop": run_loop,
             "transformers": run_hf}
    engines = {name: every[name] for name in args.engines.split(",")}
    for batch in [int(b) for b in args.batches.split(",")]:
        row: dict[str, Any] = {"batch": batch}
        for name, engine in engines.items():
            row[name] = measure(engine, model, batch, args, device)
        if "flowrl_static" in row:
            row["flowrl_static"]["launches"] = launches(model, batch)
        hf_times = row["transformers"]["ms_per_decode_step_all"] if "transformers" in row else []
        for name in [n for n in ("flowrl_static", "flowrl_static_cublas", "flowrl_loop") if n in row and hf_times]:
            ratios = [f / h for f, h in zip(row[name]["ms_per_decode_step_all"], hf_times)]
            row[f"ratio_{name}_over_transformers"] = {
                "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        rows.append(row)
        print(f"batch {batch:>4}: " + " | ".join(
            f"{name} {row[name]['ms_per_decode_step']:.2f} ms/step ({row[name]['tokens_per_s']:,.0f} tok/s)"
            for name in engines), flush=True)
    from vs_trl import machine

    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine(),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rows": rows,
        "products_measured": measured_products(),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written: {args.output}")


if __name__ == "__main__":
    main()
