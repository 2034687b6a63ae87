"""The fused output head (``linear_token_logprobs``) at several chunk sizes: forward and
backward of one training pass's head, interleaved repeats in one process.

    python benchmarks/fused_head.py --output benchmarks/results/fused_head_h200.json

A pass of the 0.4B GRPO job: ``--rows`` tokens (64 sequences of 512 columns by default) of
hidden size 896 against a 32,000-token head, bf16. Each ``--chunk-rows`` entry ("auto" is the
engine's own choice, ``fused_chunk_rows``) is timed for forward + backward (the update) and
forward alone under ``no_grad`` (the reference pass), in milliseconds per pass, as the median
of CUDA-event timings; the entries take turns ``--repeats`` times. Writes JSON with the
commit measured; never asserts. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from flowrl.algorithms.logprobs import fused_chunk_rows, linear_token_logprobs  # noqa: E402


def pass_ms(call: Callable[[], Any], calls: int) -> float:
    """Milliseconds per call of ``call``, ``calls`` calls between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64 * 512)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--chunk-rows", default="auto,1048,2048,512", help="comma-separated; auto: the engine's")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=5, help="passes per timing")
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks" / "results" / "fused_head.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    from vs_trl import commit_state, machine

    generator = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(args.rows, args.hidden, device="cuda", dtype=torch.bfloat16, generator=generator)
    weight = (torch.randn(args.vocab, args.hidden, device="cuda", dtype=torch.bfloat16, generator=generator)
              * args.hidden ** -0.5).requires_grad_(True)
    labels = torch.randint(0, args.vocab, (args.rows,), device="cuda", generator=generator)
    leaf = hidden.clone().requires_grad_(True)
    choices = {name: fused_chunk_rows(args.vocab) if name == "auto" else int(name)
               for name in args.chunk_rows.split(",")}

    def training(rows: int) -> Callable[[], None]:
        def call() -> None:
            leaf.grad = weight.grad = None
            linear_token_logprobs(leaf, weight, labels, chunk_rows=rows).sum().backward()
        return call

    def reference(rows: int) -> Callable[[], None]:
        def call() -> None:
            with torch.no_grad():
                linear_token_logprobs(hidden, weight, labels, chunk_rows=rows)
        return call

    timings: dict[str, dict[str, list[float]]] = {name: {"train": [], "forward": []} for name in choices}
    for name, rows in choices.items():  # warm-up: cuBLAS picks its kernels per shape
        training(rows)()
        reference(rows)()
    for _ in range(args.repeats):
        for name, rows in choices.items():
            timings[name]["train"].append(pass_ms(training(rows), args.calls))
            timings[name]["forward"].append(pass_ms(reference(rows), args.calls))
    commit, dirty = commit_state()
    report = {
        "machine": machine(), "flowrl_commit": commit, "flowrl_uncommitted_files": dirty,
        "device": torch.cuda.get_device_name(), "settings": {k: v for k, v in vars(args).items() if k != "output"},
        "chunk_rows": choices,
        "ms_per_pass": {name: {kind: {"median": statistics.median(values), "all": values}
                               for kind, values in kinds.items()} for name, kinds in timings.items()},
    }
    for name, kinds in report["ms_per_pass"].items():
        print(f"{name} ({choices[name]} rows): train {kinds['train']['median']:.2f} ms, "
              f"forward {kinds['forward']['median']:.2f} ms", flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"written: {args.output}")


if __name__ == "__main__":
    main()
