"""Where a GRPO step's GPU time goes: decode, the log-prob forward and the update, measured
piece by piece with the variants worth comparing, in one run.

    python benchmarks/gpu_profile.py --model qwen2-0.4b --output benchmarks/results/gpu_profile_h200.json

Sections (``--sections``), each in a child process of its own so that a failing one (a
compiler error, a device-side assert) leaves the others standing:

- ``decode``: ms per decode step of the static-cache engine at ``--batch`` rows (CUDA graphs,
  the prefill included), and the kernels of five eager decode steps (the compiled element-wise
  steps and the products, no graph) from ``torch.profiler``: total kernel time per step and the top kernels.
- ``forward``: the reference forward over ``--batch`` rows of ``--prompt + --new-tokens``
  tokens in passes of ``--micro-batch`` rows: the model's full logits + chunked log-softmax,
  the fused head (``linear_token_logprobs``), and the fused head behind ``torch.compile`` of
  the backbone; seconds and peak memory each, and the top kernels of the run's variant (each
  layer compiled).
- ``update``: forward, backward and a fused AdamW step over the same passes, same variants,
  and the top kernels of one fused step.

The model is a builtin shape (``flowrl.backends.catalog``) with random weights, bf16 on a GPU
(fp32 and tiny with ``--small`` on a CPU, to check the program itself). Writes JSON with the
commit measured; never asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

SECTIONS = ("decode", "forward", "update")


def build(args: argparse.Namespace) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from flowrl.backends.catalog import lookup_builtin

    shape = lookup_builtin(args.model)
    layers = 2 if args.small else shape.num_layers
    config = Qwen2Config(
        vocab_size=shape.vocabulary, hidden_size=shape.hidden_size, num_hidden_layers=layers,
        num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
        intermediate_size=shape.intermediate_size, tie_word_embeddings=shape.tie_word_embeddings,
        max_position_embeddings=4096, pad_token_id=0,
    )
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if cuda else torch.float32)
    return model.to("cuda" if cuda else "cpu")


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def peak_gb(fn: Callable[[], Any]) -> float | None:
    import torch

    if not torch.cuda.is_available():
        fn()
        return None
    torch.cuda.reset_peak_memory_stats()
    fn()
    return torch.cuda.max_memory_allocated() / 1e9


def kernels(fn: Callable[[], Any], steps: int, rows: int = 15) -> dict[str, Any]:
    """Kernel time per call of ``fn`` and the ``rows`` costliest kernels (CPU ops on a CPU)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
        sync()
    events = prof.key_averages()
    key = "device_time_total" if cuda else "self_cpu_time_total"
    total_us = sum(getattr(event, key, 0.0) for event in events)
    top = sorted(events, key=lambda event: -getattr(event, key, 0.0))[:rows]
    return {
        "ms_per_call": total_us / steps / 1e3,
        "kernels_per_call": sum(event.count for event in events) / steps,
        "top": [{"name": event.key[:120], "calls_per_step": event.count / steps,
                 "ms_per_step": getattr(event, key, 0.0) / steps / 1e3} for event in top],
    }


def section_decode(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from flowrl.backends.static_decode import StaticDecoder, _Sampling

    model = build(args).eval()
    device = next(model.parameters()).device
    eos = model.config.vocab_size  # outside the vocabulary: every row decodes every step
    ids = torch.randint(1, eos - 1, (args.batch, args.prompt), device=device)
    mask = torch.ones_like(ids)
    generator = torch.Generator(device=device)
    decoder = StaticDecoder(model)

    def generate() -> None:
        decoder.generate(ids, mask, max_new_tokens=args.new_tokens, eos_token_id=eos, pad_token_id=0,
                         generator=generator.manual_seed(0))

    out: dict[str, Any] = {"ms_per_decode_step": timed(generate, args.repeats) / args.new_tokens * 1e3}
    out["peak_gb"] = peak_gb(generate)
    eager = StaticDecoder(model, use_graphs=False)
    eager._set_kernels(device.type == "cuda")
    with torch.inference_mode():
        eager.generate(ids, mask, max_new_tokens=args.new_tokens, eos_token_id=eos, pad_token_id=0)
        buffers = eager._buffers
        assert buffers is not None
        middle = args.prompt + args.new_tokens // 2
        sampling = _Sampling(False, 0, 1.0, (eos,), 0)
        window = min(-(-(middle + 1) // 64) * 64, args.prompt + args.new_tokens)

        def step() -> None:
            # The same step again and again: the column, position and output slot reset first.
            buffers.column.fill_(middle)
            buffers.out_column.fill_(args.new_tokens // 2)
            buffers.positions[: args.batch] = middle
            buffers.unfinished.fill_(True)
            eager._decode_step(args.batch, window, sampling, None)

        step()
        out["eager_step_kernels"] = kernels(step, steps=5)
    return out


def _passes(args: argparse.Namespace) -> list[slice]:
    return [slice(start, start + args.micro_batch) for start in range(0, args.batch, args.micro_batch)]


def _variants(args: argparse.Namespace, model: Any) -> dict[str, Callable[[slice, bool], Any]]:
    import torch

    from flowrl.algorithms.logprobs import linear_token_logprobs, token_logprobs

    device = next(model.parameters()).device
    length = args.prompt + args.new_tokens
    ids = torch.randint(1, model.config.vocab_size - 1, (args.batch, length), device=device)
    positions = torch.arange(length, device=device).expand(args.batch, length)
    mask = torch.ones_like(ids)
    labels = ids[:, args.prompt:]
    head = model.get_output_embeddings()
    first, last = args.prompt - 1, length - 1

    def full_logits(rows: slice, backward: bool) -> None:
        logits = model(input_ids=ids[rows], attention_mask=mask[rows], position_ids=positions[rows], use_cache=False).logits
        result = token_logprobs(logits[:, first:last], labels[rows])
        if backward:
            result.sum().backward()

    def fused(backbone: Any) -> Callable[[slice, bool], None]:
        def run(rows: slice, backward: bool) -> None:
            hidden = backbone(input_ids=ids[rows], attention_mask=mask[rows], position_ids=positions[rows],
                              use_cache=False).last_hidden_state[:, first:last]
            result = linear_token_logprobs(hidden.reshape(-1, hidden.shape[-1]), head.weight, labels[rows].reshape(-1))
            if backward:
                result.sum().backward()
        return run

    def layers_compiled() -> Callable[[slice, bool], None]:
        # Each decoder layer compiled, as a run's log-prob passes do (flowrl.backends.compiled_layers:
        # one compiled version for every layer, active only inside the pass, so the other
        # variants stay eager).
        from flowrl.backends.compiled_layers import run_compiled

        eager = fused(model.model)

        def run(rows: slice, backward: bool) -> None:
            run_compiled(model.model, lambda: eager(rows, backward), force=True)
        return run

    return {
        "full_logits": full_logits,
        "fused_head": fused(model.model),
        "fused_head_compiled": fused(torch.compile(model.model, dynamic=False)),
        "fused_head_layers_compiled": layers_compiled(),
    }


def section_forward(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    model = build(args).eval()
    out: dict[str, Any] = {}
    for name, run in _variants(args, model).items():
        try:
            def call() -> None:
                with torch.inference_mode():
                    for rows in _passes(args):
                        run(rows, False)
            out[name] = {"s": timed(call, args.repeats), "peak_gb": peak_gb(call)}
            if name == "fused_head_layers_compiled":  # the run's reference pass
                out[name]["kernels"] = kernels(call, steps=1, rows=25)
        except Exception:  # noqa: BLE001 - one variant's failure is a result too
            out[name] = {"error": traceback.format_exc()[-1500:]}
    return out


def section_update(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    model = build(args).train()
    fused_kernel = torch.cuda.is_available()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=fused_kernel, foreach=not fused_kernel)
    out: dict[str, Any] = {}
    for name, run in _variants(args, model).items():
        try:
            def call(run: Callable[[slice, bool], Any] = run) -> None:
                for rows in _passes(args):
                    run(rows, True)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            out[name] = {"s": timed(call, args.repeats), "peak_gb": peak_gb(call)}
            if name in ("fused_head", "fused_head_layers_compiled"):
                out[name]["kernels"] = kernels(call, steps=1, rows=25)
        except Exception:  # noqa: BLE001 - one variant's failure is a result too
            out[name] = {"error": traceback.format_exc()[-1500:]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2-0.4b")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--batch", type=int, default=256, help="rows (default 256)")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per row (default 32)")
    parser.add_argument("--new-tokens", type=int, default=256, help="completion tokens per row (default 256)")
    parser.add_argument("--micro-batch", type=int, default=64, help="rows per forward/backward pass (default 64)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="2 layers and small sizes: checks the program on a CPU")
    parser.add_argument("--section", help=argparse.SUPPRESS)
    parser.add_argument("--output", type=Path, default=HERE / "results" / "gpu_profile.json")
    args = parser.parse_args()
    if args.small:
        args.batch, args.prompt, args.new_tokens, args.micro_batch = 8, 8, 24, 4
    if args.section:  # a child: one section, its result as JSON on the last line
        result = {"decode": section_decode, "forward": section_forward, "update": section_update}[args.section](args)
        print(json.dumps(result, default=str))
        return
    from vs_trl import commit_state, machine

    commit, dirty = commit_state()
    report: dict[str, Any] = {"machine": machine(), "flowrl_commit": commit, "flowrl_uncommitted_files": dirty,
                              "settings": {k: str(v) for k, v in vars(args).items()}}
    for section in args.sections.split(","):
        child = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--section", section],
                               capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        lines = child.stdout.strip().splitlines()
        try:
            report[section] = json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            report[section] = {"error": f"exit {child.returncode}", "stderr_tail": child.stderr[-3000:]}
        print(f"{section}: {json.dumps(report[section], default=str)[:1500]}", flush=True)
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"written: {args.output}")


if __name__ == "__main__":
    main()
