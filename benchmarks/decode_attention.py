"""The decode attention kernel's windows: cut into shares (merged by a second kernel) or not,
at the batch sizes of a GRPO step, alone and inside the whole decode step.

    python benchmarks/decode_attention.py --output benchmarks/results/decode_attention_h100.json

Qwen2.5-0.5B's attention shape (14 query heads over 2 KV heads of 64), bf16, prompts of
``--prompt-tokens`` and ``--new-tokens`` new tokens, so the decode steps attend over windows
of 64, 128, ... columns (the engine widens its window in blocks of 64) up to the whole cache.
Two sections:

- ``kernel``: per batch size and window, microseconds per layer of ``decode_attention`` (the
  attention kernel and, when the window is cut, the merge kernel) replayed in a CUDA graph,
  for the shares the engine chooses (``decode_attention.window_shares``), one share always,
  and shares of 128 columns always (the rule before the choice by the card's processors);
  and their mean over the decode steps of one generation.
- ``launches``: per batch size, the mean microseconds per decode step of the kernel (one
  share) for each launch of ``--launch-grid`` (columns per block, warps, pipeline stages).
- ``decode``: milliseconds per decode step of the static-cache engine (24 layers, the
  prefill included) with the chosen shares and with shares of 128 columns, interleaved
  ``--repeats`` times per batch size.

Writes JSON with the commit measured; never asserts. Needs a CUDA GPU with Triton.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from flowrl.backends import decode_attention as attention  # noqa: E402

KV_HEADS, GROUP, HEAD_DIM = 2, 7, 64
RULES = ("chosen", "one_share", "shares_of_128")


@contextlib.contextmanager
def rule(name: str) -> Iterator[None]:
    """The engine's own choice, or a fixed one through its constants."""
    saved = attention.CUT_BELOW, attention.FILL_PER_PROCESSOR, attention.MIN_SHARE_COLUMNS
    if name == "one_share":
        attention.CUT_BELOW = 0
    elif name == "shares_of_128":
        attention.CUT_BELOW, attention.FILL_PER_PROCESSOR, attention.MIN_SHARE_COLUMNS = 10 ** 6, 10 ** 6, 128
    try:
        yield
    finally:
        attention.CUT_BELOW, attention.FILL_PER_PROCESSOR, attention.MIN_SHARE_COLUMNS = saved


def windows(prompt: int, new_tokens: int) -> dict[int, int]:
    """Window -> decode steps that attend over it, for one generation."""
    columns = prompt + new_tokens
    steps: dict[int, int] = {}
    for position in range(prompt, columns):
        window = min(-(-(position + 1) // 64) * 64, columns)
        steps[window] = steps.get(window, 0) + 1
    return steps


def kernel_us(batch: int, window: int, columns: int) -> Callable[[], Any]:
    """A call of decode_attention at the last position of ``window`` (every column valid)."""
    generator = torch.Generator(device="cuda").manual_seed(0)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device="cuda", dtype=torch.bfloat16)

    qkv = draw(batch, (KV_HEADS * GROUP + 2 * KV_HEADS) * HEAD_DIM)
    cos, sin = draw(batch, HEAD_DIM), draw(batch, HEAD_DIM)
    keys, values = draw(batch, KV_HEADS, columns, HEAD_DIM), draw(batch, KV_HEADS, columns, HEAD_DIM)
    position = min(window, columns) - 1
    column = torch.tensor([position], device="cuda")
    valid = torch.zeros(batch, window, dtype=torch.bool, device="cuda")
    valid[:, : position + 1] = True
    return lambda: attention.decode_attention(qkv, cos, sin, keys[:, :, :window], values[:, :, :window], column,
                                              valid, HEAD_DIM ** -0.5)


def section_kernel(args: argparse.Namespace) -> list[dict[str, Any]]:
    from triton.testing import do_bench_cudagraph

    steps = windows(args.prompt_tokens, args.new_tokens)
    columns = args.prompt_tokens + args.new_tokens
    rows = []
    for batch in args.batch_list:
        row: dict[str, Any] = {"batch": batch, "windows": steps}
        for name in RULES:
            with rule(name):
                times = {}
                shares = {}
                for window in steps:
                    call = kernel_us(batch, window, columns)
                    call()
                    times[window] = do_bench_cudagraph(call, rep=args.rep_ms) * 1e3
                    shares[window] = attention.window_shares(window, batch * KV_HEADS,
                                                             attention.processor_count(torch.device("cuda")))[0]
            mean = sum(times[w] * n for w, n in steps.items()) / sum(steps.values())
            row[name] = {"us_per_window": times, "shares_per_window": shares, "us_per_step_mean": mean}
        rows.append(row)
        print(f"kernel batch {batch}: " + " | ".join(f"{name} {row[name]['us_per_step_mean']:.2f} us" for name in RULES),
              flush=True)
    return rows


@contextlib.contextmanager
def launch(block_columns: int, warps: int, stages: int) -> Iterator[None]:
    saved = attention.BLOCK_COLUMNS, attention.NUM_WARPS, attention.NUM_STAGES
    attention.BLOCK_COLUMNS, attention.NUM_WARPS, attention.NUM_STAGES = block_columns, warps, stages
    try:
        yield
    finally:
        attention.BLOCK_COLUMNS, attention.NUM_WARPS, attention.NUM_STAGES = saved


def section_launches(args: argparse.Namespace) -> list[dict[str, Any]]:
    from triton.testing import do_bench_cudagraph

    steps = windows(args.prompt_tokens, args.new_tokens)
    columns = args.prompt_tokens + args.new_tokens
    grid = [tuple(int(v) for v in item.split("/")) for item in args.launch_grid.split(",")]
    rows = []
    for batch in args.batch_list:
        results = {}
        for block_columns, warps, stages in grid:
            times = {}
            with rule("one_share"), launch(block_columns, warps, stages):
                for window in steps:
                    call = kernel_us(batch, window, columns)
                    call()
                    times[window] = do_bench_cudagraph(call, rep=args.rep_ms) * 1e3
            mean = sum(times[w] * n for w, n in steps.items()) / sum(steps.values())
            results[f"{block_columns}/{warps}/{stages}"] = {"us_per_window": times, "us_per_step_mean": mean}
        best = min(results, key=lambda name: results[name]["us_per_step_mean"])
        rows.append({"batch": batch, "windows": steps, "launches": results, "fastest": best})
        print(f"launches batch {batch}: fastest {best} {results[best]['us_per_step_mean']:.2f} us; "
              + " | ".join(f"{name} {item['us_per_step_mean']:.2f}" for name, item in results.items()), flush=True)
    return rows


def section_decode(args: argparse.Namespace) -> list[dict[str, Any]]:
    from decode import EOS, VOCAB, build_model

    from flowrl.backends.static_decode import StaticDecoder

    model = build_model(24, "cuda")
    rows = []
    compared = ("chosen", "shares_of_128")
    for batch in args.batch_list:
        ids = torch.randint(1, VOCAB - 1, (batch, args.prompt_tokens), device="cuda")
        mask = torch.ones_like(ids)
        decoders = {}
        for name in compared:
            with rule(name):  # the shares are fixed when a window's graph is captured
                decoders[name] = StaticDecoder(model)
                with torch.inference_mode():
                    decoders[name].generate(ids, mask, max_new_tokens=args.new_tokens, eos_token_id=EOS,
                                            pad_token_id=0)
        times: dict[str, list[float]] = {name: [] for name in compared}
        for _ in range(args.repeats):
            for name in compared:
                torch.cuda.synchronize()
                started = time.perf_counter()
                with torch.inference_mode():
                    decoders[name].generate(ids, mask, max_new_tokens=args.new_tokens, eos_token_id=EOS,
                                            pad_token_id=0)
                torch.cuda.synchronize()
                times[name].append((time.perf_counter() - started) / args.new_tokens * 1e3)
        ratios = [c / o for c, o in zip(times["chosen"], times["shares_of_128"])]
        row = {"batch": batch, "ms_per_decode_step": times,
               "median_ms": {name: statistics.median(values) for name, values in times.items()},
               "chosen_over_shares_of_128": {"median": statistics.median(ratios), "min": min(ratios),
                                             "max": max(ratios)}}
        rows.append(row)
        print(f"decode batch {batch}: " + " | ".join(f"{n} {row['median_ms'][n]:.3f} ms" for n in compared), flush=True)
        del decoders
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="64,128,256")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rep-ms", type=int, default=20, help="milliseconds of replays per kernel timing")
    parser.add_argument("--sections", default="kernel,decode", help="of kernel, launches, decode")
    parser.add_argument("--launch-grid", default="64/4/2,64/2/2,64/8/2,64/4/1,64/4/3,32/2/2,32/4/3,128/4/2,128/8/2,"
                        "128/8/3", help="columns per block / warps / stages, comma-separated")
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks" / "results" / "decode_attention.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    args.batch_list = [int(b) for b in args.batches.split(",")]
    from vs_trl import commit_state, machine

    commit, dirty = commit_state()
    report: dict[str, Any] = {
        "machine": machine(), "flowrl_commit": commit, "flowrl_uncommitted_files": dirty,
        "device": torch.cuda.get_device_name(), "settings": {k: v for k, v in vars(args).items() if k != "output"},
        "constants": {name: getattr(attention, name) for name in (
            "BLOCK_COLUMNS", "NUM_WARPS", "NUM_STAGES", "MIN_SHARE_COLUMNS", "CUT_BELOW", "FILL_PER_PROCESSOR",
            "MAX_SPLITS")},
    }
    sections = {"kernel": section_kernel, "launches": section_launches, "decode": section_decode}
    for name in args.sections.split(","):
        report[name] = sections[name](args)
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"written: {args.output}")


if __name__ == "__main__":
    main()
