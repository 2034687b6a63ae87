"""GRPO on one GPU: flowrl against TRL's GRPOTrainer in its fastest configurations, in one run.

    python benchmarks/gpu_grpo.py --model qwen2-0.4b --repeats 3 \
        --output benchmarks/results/gpu_grpo_h200.json

The job: a builtin model (``qwen2-0.4b``: Qwen2.5-0.5B's shape, 387 M parameters;
``qwen2-1.5b``: Qwen2.5-1.5B's shape, 1.36 B; both with a 32,000-token vocabulary and random
init), bf16, 32 prompts x 8 generations x 256 new tokens per step, temperature 1, k3 KL to the
reference with beta 0.04, AdamW lr 1e-6, one optimizer step per rollout, no activation
checkpointing.

Same micro-batches for memory: the update and the reference forward run in passes of
``--micro-batch`` sequences in both frameworks (TRL: ``per_device_train_batch_size`` with
gradient accumulation over the step; flowrl: ``micro_batch_tokens`` = that many sequences of
the longest prompt plus the completion length).

Variants (``--variants``, run interleaved: every variant once, then every variant again, for
``--repeats`` rounds, each run a process of its own on the same GPU):

- ``flowrl``: its default engine on a GPU (static KV cache + CUDA graphs);
- ``trl``: ``GRPOTrainer`` with plain ``generate()`` (``use_vllm=False``), dynamic cache;
- ``trl-static``: the same with ``cache_implementation="static"``;
- ``trl-liger``: ``trl-static`` plus Liger's kernels (``use_liger_kernel``);
- ``trl-one-pass``: ``trl-static`` with the update as one pass of all sequences (more memory);
- ``flowrl-lora`` and ``trl-lora``: LoRA adapters of rank 16 (alpha 32, no dropout) on every
  linear layer of the decoder layers (flowrl's ``lora``, TRL's ``peft_config``), the reference
  being the policy with its adapters off in both (no second model); TRL with a static cache.

Reported per variant: seconds per step (median of each run's steps after ``--warmup``, then
the median over runs), seconds per node (flowrl: its own per-node timings; TRL: generate(),
the reference forward, and the rest of the step = update and bookkeeping), peak GPU memory,
and per TRL variant the ratio TRL / flowrl of each round's medians (``trl-lora`` against
``flowrl-lora``). The commit measured and
any uncommitted files of ``flowrl/`` and ``benchmarks/`` are recorded. The file and its summary
are written after every run, so a command stopped from outside keeps what finished;
``--max-minutes`` starts no run that would end past it (estimated from its variant's longest
run so far) and lists the runs left out. Writes JSON; never asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from vs_trl import machine, run_child  # noqa: E402

VARIANTS: dict[str, dict[str, Any]] = {
    "flowrl": {"framework": "flowrl"},
    "trl": {"framework": "trl"},
    "trl-static": {"framework": "trl", "trl_cache": "static"},
    "trl-liger": {"framework": "trl", "trl_cache": "static", "trl_liger": True},
    "trl-one-pass": {"framework": "trl", "trl_cache": "static", "trl_micro_batch": None},
    "flowrl-lora": {"framework": "flowrl", "lora_rank": 16},
    "trl-lora": {"framework": "trl", "trl_cache": "static", "lora_rank": 16},
}


def row_width(model: str, prompts_per_step: int, steps: int, new_tokens: int, seed: int) -> int:
    """Tokens of the longest prompt of the run's steps plus the completion length."""
    from flowrl.backends.policy_tokenizer import load_tokenizer
    from flowrl.data import PromptSource

    tokenizer = load_tokenizer(f"builtin:{model}")
    source = PromptSource("builtin:digits", batch_size=prompts_per_step, seed=seed, base_dir=Path.cwd())
    prompts = [example.prompt for step in range(steps) for example in source.next_batch(step)]
    longest = max(len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) for prompt in prompts)
    return longest + new_tokens


def job(args: argparse.Namespace, variant: str, micro_tokens: int) -> dict[str, Any]:
    num_sequences = args.prompts * args.generations
    return {
        "config": f"gpu-{args.model}",
        "model": args.model,
        "device": "cuda",
        "dtype": "bf16",
        "max_new_tokens": args.new_tokens,
        "steps": args.steps,
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
        "engine": "auto",
        "ref_micro_batch_tokens": micro_tokens,
        "update_micro_batch_tokens": micro_tokens,
        "trl_micro_batch": min(args.micro_batch, num_sequences),
        **{k: v for k, v in VARIANTS[variant].items() if k != "framework"},
    }


def timed(values: list[float], warmup: int) -> list[float]:
    return values[warmup:] if len(values) > warmup else values


def summary(result: dict[str, Any], warmup: int) -> dict[str, Any]:
    if "error" in result:
        return {"error": result["error"]}
    steps = timed(result["step_s"], warmup)
    tokens = timed(result["completion_tokens"], warmup)
    out: dict[str, Any] = {
        "step_s_median": statistics.median(steps),
        "step_s_timed": steps,
        "completion_tokens_per_s": sum(tokens) / sum(steps),
        "launch_to_first_step_s": result.get("launch_to_first_step_s"),
    }
    if result["framework"] == "trl":
        generate = timed(result["generate_s"], warmup)
        reference = timed(result.get("reference_s", []), warmup)
        nodes = {"generate": statistics.median(generate)}
        if reference:
            nodes["reference"] = statistics.median(reference)
        rest = [s - g - (reference[i] if i < len(reference) else 0.0) for i, (s, g) in enumerate(zip(steps, generate))]
        nodes["update_and_rest"] = statistics.median(rest)
        out["node_s_median"] = nodes
        out["peak_gpu_memory_gb"] = result.get("peak_gpu_memory_gb")
        out["settings"] = result.get("settings")
    else:
        metrics = result["metrics"]
        node_series = {
            key.removeprefix("timing_s/"): timed(values, warmup)
            for key, values in metrics.items()
            if key.startswith("timing_s/") and key != "timing_s/step" and all(v is not None for v in values)
        }
        out["node_s_median"] = {node: statistics.median(values) for node, values in node_series.items()}
        # every timed step's node times: which node a slow step (a late compile) spent its time in
        out["node_s_timed"] = node_series
        engine = metrics.get("perf/generate_engine_s")
        if engine and all(v is not None for v in engine):
            # the decode engine's own time inside the generate node (the rest: the hand-off)
            out["generate_engine_s_median"] = statistics.median(timed(engine, warmup))
        peaks = metrics.get("perf/max_memory_allocated_gb")
        out["peak_gpu_memory_gb"] = max(peaks) if peaks else None
    out["reward_mean"] = result.get("reward_mean")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2-0.4b", choices=["qwen2-0.4b", "qwen2-1.5b"])
    parser.add_argument("--steps", type=int, default=5, help="steps per run (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of each run's median (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every variant (default 3)")
    parser.add_argument("--variants", default="flowrl,trl-static", help=f"comma-separated, from: {', '.join(VARIANTS)}")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=64, help="sequences per forward/backward pass (default 64)")
    parser.add_argument("--max-minutes", type=float, default=0.0,
                        help="start no run that would end past this many minutes (its variant's longest run so "
                             "far sets the estimate); 0: no limit")
    parser.add_argument("--output", type=Path, default=HERE / "results" / "gpu_grpo.json")
    args = parser.parse_args()
    variants = [name.strip() for name in args.variants.split(",") if name.strip()]
    unknown = [name for name in variants if name not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from flowrl.backends.builtin import builtin_model_dir

    builtin_model_dir(args.model)  # built once, outside every clock
    width = row_width(args.model, args.prompts, args.steps, args.new_tokens, 0)
    micro_tokens = args.micro_batch * width
    report: dict[str, Any] = {
        "machine": machine(), "warmup_steps": args.warmup, "repeats": args.repeats,
        "micro_batch": {"sequences": args.micro_batch, "row_width_tokens": width, "flowrl_micro_batch_tokens": micro_tokens},
        "jobs": {name: job(args, name, micro_tokens) for name in variants},
        "runs": {name: [] for name in variants},
    }
    try:
        import torch

        report["machine"]["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except Exception:  # a machine without CUDA still writes its report
        report["machine"]["gpu"] = None

    def write() -> None:
        report["summary"] = summarize(report, variants)
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2, default=str) + "\n")

    # A run that would not end inside --max-minutes is not started: the file then holds every
    # finished run and its summary, and says what was left out.
    started = time.monotonic()
    longest: dict[str, float] = {}
    for round_index in range(args.repeats):
        for name in variants:
            elapsed = time.monotonic() - started
            if args.max_minutes and elapsed + longest.get(name, 0.0) > args.max_minutes * 60:
                report.setdefault("left_out", []).append(
                    {"round": round_index, "variant": name,
                     "why": f"its last run took {longest[name]:.0f} s and {elapsed:.0f} s of --max-minutes "
                            f"{args.max_minutes:g} had passed"})
                print(f"round {round_index} {name}: left out (--max-minutes)", flush=True)
                write()
                continue
            run_started = time.monotonic()
            raw = run_child(VARIANTS[name]["framework"], report["jobs"][name])
            longest[name] = max(longest.get(name, 0.0), time.monotonic() - run_started)
            result = summary(raw, args.warmup)
            result["round"] = round_index
            if "error" in raw:
                result["logs_tail"] = str(raw)[-2000:]
            report["runs"][name].append(result)
            short = {k: result.get(k) for k in ("step_s_median", "node_s_median", "generate_engine_s_median",
                                                "peak_gpu_memory_gb", "error")}
            print(f"round {round_index} {name}: {json.dumps(short, default=str)}", flush=True)
            write()

    write()
    print(json.dumps(report["summary"], indent=1, default=str), flush=True)
    print(f"written: {args.output}")


def summarize(report: dict[str, Any], variants: list[str]) -> dict[str, Any]:
    """Per variant: medians over its finished runs; per TRL variant, TRL / flowrl per round
    where both ran."""
    out: dict[str, Any] = {}
    for name in variants:
        good = [run for run in report["runs"][name] if "error" not in run]
        if not good:
            out[name] = {"error": report["runs"][name][0].get("error") if report["runs"][name] else "no run"}
            continue
        nodes = sorted({key for run in good for key in run["node_s_median"]})
        out[name] = {
            "runs": len(good),
            "step_s_median": statistics.median(run["step_s_median"] for run in good),
            "step_s_per_round": [run["step_s_median"] for run in good],
            "node_s_median": {key: statistics.median(run["node_s_median"][key] for run in good if key in run["node_s_median"])
                              for key in nodes},
            "peak_gpu_memory_gb": max((run["peak_gpu_memory_gb"] or 0.0) for run in good),
        }
        engines = [run["generate_engine_s_median"] for run in good if run.get("generate_engine_s_median") is not None]
        if engines:
            out[name]["generate_engine_s_median"] = statistics.median(engines)
    for name in variants:
        # each TRL variant against flowrl at the same work: its LoRA variant against flowrl's
        baseline = "flowrl-lora" if name.endswith("-lora") else "flowrl"
        if name.startswith("flowrl") or baseline not in variants:
            continue
        baseline_by_round = {run["round"]: run for run in report["runs"][baseline] if "error" not in run}
        ratios = [run["step_s_median"] / baseline_by_round[run["round"]]["step_s_median"]
                  for run in report["runs"][name] if "error" not in run and run["round"] in baseline_by_round]
        if ratios:
            out[f"{name}_over_{baseline}"] = {
                "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "per_round": ratios}
    return out


if __name__ == "__main__":
    main()
