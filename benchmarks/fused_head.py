"""The fused output head (``linear_token_logprobs``) at several chunk sizes, and with its
backward walking rows as the forward does: forward and backward of one training pass's head,
interleaved repeats in one process.

    python benchmarks/fused_head.py --output benchmarks/results/fused_head_h200.json

The head of a pass of the 0.4B GRPO job: per ``--rows`` count (the completion tokens of a
pass: 64 sequences of 256 by default, and a count that is no multiple of 64) and per
``--vocab`` size (32,000; Qwen's 151,936), that many hidden states of size 896 against the
head, bf16. Each ``--chunk-rows`` entry ("auto": the engine's own choice,
``fused_chunk_rows``; "half" and "double": half and twice its rows; a number; "rows": the
engine's chunks with the backward by chunks of rows, each adding its part of the weight
gradient to an fp32 [V, H] sum, as the engine did before its backward walked the vocabulary)
is timed for forward + backward (the update) and forward alone under ``no_grad`` (the
reference pass), in milliseconds per pass, as the median of CUDA-event timings; the entries
take turns ``--repeats`` times. Writes JSON with the commit measured; never asserts. Needs a
CUDA GPU.
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

from flowrl.algorithms import logprobs  # noqa: E402
from flowrl.algorithms.logprobs import fused_chunk_rows, linear_token_logprobs  # noqa: E402
from flowrl.backends.compiled_layers import CompiledFunction  # noqa: E402


def _rows_chunk_backward(*args: Any) -> Any:
    """The engine's chunk gradient under a compiled function of its own, so that the dynamic
    shapes its calls by rows bring do not change the engine's compiled version (nor the
    other way round)."""
    return logprobs._logits_backward(*args)


ROWS_CHUNK_BACKWARD = CompiledFunction(_rows_chunk_backward, "the backward by rows")


class RowsBackward(logprobs._LinearTokenLogprobs):
    """The fused head with its backward by chunks of rows (no entropy, no bias): each chunk's
    weight gradient is added to an fp32 sum of the whole weight's shape."""

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor | None, grad_entropy: torch.Tensor | None = None) -> Any:
        hidden, weight, _, labels, logsumexp, _ = ctx.saved_tensors
        assert grad_out is not None
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        upstream = grad_out.to(torch.float32)
        for start in range(0, hidden.shape[0], ctx.chunk_rows):
            rows = slice(start, start + ctx.chunk_rows)
            logits = torch.nn.functional.linear(hidden[rows], weight)
            grad_logits, _ = ROWS_CHUNK_BACKWARD(logits, logsumexp[rows], labels[rows, None],
                                                 upstream[rows, None], ctx.temperature, False)
            grad_hidden[rows] = grad_logits @ weight
            grad_weight += (grad_logits.t() @ hidden[rows]).to(torch.float32)
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None


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


def chunk_rows(name: str, vocab: int) -> int:
    if name in ("auto", "rows"):
        return fused_chunk_rows(vocab)
    if name in ("half", "double"):
        return max(1, fused_chunk_rows(vocab) // 2) if name == "half" else 2 * fused_chunk_rows(vocab)
    return int(name)


def measure(rows: int, hidden_size: int, vocab: int, names: list[str], repeats: int, calls: int) -> dict[str, Any]:
    """One shape: each chunk size's ms per pass, the sizes taking turns."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(rows, hidden_size, device="cuda", dtype=torch.bfloat16, generator=generator)
    weight = (torch.randn(vocab, hidden_size, device="cuda", dtype=torch.bfloat16, generator=generator)
              * hidden_size ** -0.5).requires_grad_(True)
    labels = torch.randint(0, vocab, (rows,), device="cuda", generator=generator)
    leaf = hidden.clone().requires_grad_(True)
    choices = {name: chunk_rows(name, vocab) for name in names}

    def training(name: str, size: int) -> Callable[[], None]:
        def call() -> None:
            leaf.grad = weight.grad = None
            if name == "rows":
                values = RowsBackward.apply(leaf, weight, None, labels, 1.0, size, False)[0]
            else:
                values = linear_token_logprobs(leaf, weight, labels, chunk_rows=size)
            values.sum().backward()
        return call

    def reference(size: int) -> Callable[[], None]:
        def call() -> None:
            with torch.no_grad():
                linear_token_logprobs(hidden, weight, labels, chunk_rows=size)
        return call

    timings: dict[str, dict[str, list[float]]] = {name: {"train": [], "forward": []} for name in choices}
    for name, size in choices.items():  # warm-up: cuBLAS picks its kernels per shape
        training(name, size)()
        reference(size)()
    for _ in range(repeats):
        for name, size in choices.items():
            timings[name]["train"].append(pass_ms(training(name, size), calls))
            timings[name]["forward"].append(pass_ms(reference(size), calls))
    medians = {name: {kind: statistics.median(values) for kind, values in kinds.items()}
               for name, kinds in timings.items()}
    for name, kinds in medians.items():
        print(f"rows {rows} vocab {vocab} {name} ({choices[name]} per chunk): train {kinds['train']:.2f} ms, "
              f"forward {kinds['forward']:.2f} ms", flush=True)
    return {"rows": rows, "vocab": vocab, "chunk_rows": choices, "ms_per_pass_median": medians,
            "ms_per_pass_all": timings}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="16384,16000", help="comma-separated token counts")
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--vocab", default="32000,151936", help="comma-separated vocabulary sizes")
    parser.add_argument("--chunk-rows", default="auto,rows,half,double",
                        help="comma-separated: auto (the engine's), rows (its chunks, the backward by rows), "
                        "half, double (of auto's rows), or numbers")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=5, help="passes per timing")
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks" / "results" / "fused_head.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    from vs_trl import commit_state, machine

    names = [name.strip() for name in args.chunk_rows.split(",") if name.strip()]
    commit, dirty = commit_state()
    report: dict[str, Any] = {
        "machine": machine(), "flowrl_commit": commit, "flowrl_uncommitted_files": dirty,
        "device": torch.cuda.get_device_name(), "settings": {k: v for k, v in vars(args).items() if k != "output"},
        "shapes": [],
    }
    for vocab in (int(v) for v in args.vocab.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            report["shapes"].append(measure(rows, args.hidden, vocab, names, args.repeats, args.calls))
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"written: {args.output}")


if __name__ == "__main__":
    main()
