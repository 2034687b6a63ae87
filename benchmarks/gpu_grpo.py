"""GRPO on one GPU at 0.4B scale: flowrl against TRL's GRPOTrainer, side by side in one run.

    python benchmarks/gpu_grpo.py --output benchmarks/results/gpu_grpo_h200.json

The job: ``builtin:qwen2-0.4b`` (Qwen2.5-0.5B's shape, 32,000-token vocabulary, 387 M
parameters, random init), bf16, 32 prompts x 8 generations x 256 new tokens per step,
temperature 1, k3 KL to the reference with beta 0.04, AdamW lr 1e-6, one optimizer step
per rollout, no activation checkpointing. TRL runs with ``use_vllm=False`` (plain
``generate()``); flowrl with its default engine on a GPU (static KV cache + CUDA graphs) and
length-sorted micro-batches for the reference forward and the update. Each framework runs
in its own process, one after the other, on the same GPU.

Reported per framework: seconds per step (median over the steps after ``--warmup``),
completion tokens/s, peak GPU memory, and for flowrl the time per node (generate, reference,
update) from its own metrics with decode ms per token; plus the TRL/flowrl ratio of the
median step time with its range over the timed steps. Writes JSON; never asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from vs_trl import machine, run_child  # noqa: E402


def job(steps: int, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "config": "gpu-0.4b",
        "model": "qwen2-0.4b",
        "device": "cuda",
        "dtype": "bf16",
        "max_new_tokens": args.new_tokens,
        "steps": steps,
        "seed": 0,
        "prompts_per_step": args.prompts,
        "num_generations": args.generations,
        "temperature": 1.0,
        "top_p": 1.0,
        "lr": 1e-6,
        "betas": [0.9, 0.999],
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "epsilon": 0.2,
        "beta": 0.04,
        "advantage_epsilon": 1e-4,
        "cpu_slots": 2,
        "engine": args.engine,
        "ref_micro_batch_tokens": args.ref_tokens,
        "update_micro_batch_tokens": args.update_tokens,
    }


def timed(values: list[float], warmup: int) -> list[float]:
    return values[warmup:] if len(values) > warmup else values


def summary(result: dict[str, Any], warmup: int, num_sequences: int, new_tokens: int) -> dict[str, Any]:
    if "error" in result:
        return {"error": result["error"]}
    steps = timed(result["step_s"], warmup)
    tokens = timed(result["completion_tokens"], warmup)
    out: dict[str, Any] = {
        "step_s_median": statistics.median(steps),
        "step_s_timed": steps,
        "completion_tokens_per_s": sum(tokens) / sum(steps),
        "reward_mean": result["reward_mean"],
    }
    if result["framework"] == "trl":
        generate = timed(result["generate_s"], warmup)
        out["generate_s_median"] = statistics.median(generate)
        out["decode_ms_per_token"] = statistics.median(generate) / new_tokens * 1e3
        out["peak_gpu_memory_gb"] = result.get("peak_gpu_memory_gb")
    else:
        metrics = result["metrics"]
        nodes = {}
        for key, values in metrics.items():
            if key.startswith("timing_s/") and key != "timing_s/step":
                nodes[key] = statistics.median(timed(values, warmup))
        out["node_s_median"] = nodes
        generate = timed(metrics.get("timing_s/gen", []), warmup)
        if generate:
            out["decode_ms_per_token"] = statistics.median(generate) / new_tokens * 1e3
        peaks = metrics.get("perf/max_memory_allocated_gb")
        out["peak_gpu_memory_gb"] = max(peaks) if peaks else None
        headroom = metrics.get("perf/memory_headroom_gb")
        out["memory_headroom_gb"] = min(headroom) if headroom else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--engine", default="auto", choices=["auto", "static", "loop"])
    parser.add_argument("--ref-tokens", type=int, default=None, help="reference micro-batch tokens (None: whole batch)")
    parser.add_argument("--update-tokens", type=int, default=16384, help="update micro-batch tokens")
    parser.add_argument("--frameworks", default="flowrl,trl")
    parser.add_argument("--output", type=Path, default=HERE / "results" / "gpu_grpo.json")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from flowrl.backends.builtin import builtin_model_dir

    builtin_model_dir("qwen2-0.4b")  # built once, outside both clocks
    the_job = job(args.steps, args)
    num_sequences = args.prompts * args.generations
    report: dict[str, Any] = {"machine": machine(), "job": the_job, "warmup_steps": args.warmup}
    try:
        import torch

        report["machine"]["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except Exception:  # a machine without CUDA still writes its report
        report["machine"]["gpu"] = None
    for framework in args.frameworks.split(","):
        raw = run_child(framework, the_job)
        report[framework] = summary(raw, args.warmup, num_sequences, args.new_tokens)
        report[f"{framework}_raw"] = {k: v for k, v in raw.items() if k not in ("logs",)}
        print(f"{framework}: {json.dumps(report[framework], default=str)[:600]}", flush=True)
    if "error" not in report.get("flowrl", {"error": 1}) and "error" not in report.get("trl", {"error": 1}):
        ratios = [t / f for t, f in zip(report["trl"]["step_s_timed"], report["flowrl"]["step_s_timed"])]
        report["speedup_trl_over_flowrl"] = {
            "median_of_medians": report["trl"]["step_s_median"] / report["flowrl"]["step_s_median"],
            "min": min(ratios), "max": max(ratios),
        }
        print(f"TRL / flowrl seconds per step: {report['speedup_trl_over_flowrl']}", flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"written: {args.output}")


if __name__ == "__main__":
    main()
