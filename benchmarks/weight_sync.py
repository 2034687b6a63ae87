"""Seconds per GB of a weight push after each update: a worker call against a collective broadcast.

    python benchmarks/weight_sync.py --model qwen2-0.4b --repeats 2 \
        --output benchmarks/results/weight_sync.json

The job: GRPO with generation on one worker and the update on another (so every update pushes
the new weights to the generating worker), a builtin model in the chosen dtype, a tiny rollout
(4 prompts x 2 completions x 4 tokens) so that the push is a large part of each step. Modes
(``runtime.weight_sync``): ``call``, the trainer's worker sends the weights to the other
worker in a Dask call; ``collective``, a broadcast over a process group of the two (gloo on
CPU workers, NCCL on GPU workers). Each run is a ``flowrl.api.run`` of its own; modes
alternate for ``--repeats`` rounds. Reported per run: ``perf/weight_sync_s`` and
``perf/weight_sync_mb`` of each step after the first, their seconds per GB, and the step
time. Writes JSON with the commit measured; never asserts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from vs_trl import machine  # noqa: E402

from flowrl.api.run import run  # noqa: E402
from flowrl.spec.loader import pipeline_from_dict  # noqa: E402


def pipeline(model: str, dtype: str, mode: str, steps: int, output: Path) -> dict[str, Any]:
    return {
        "name": f"weight-sync-{mode}",
        "models": {"actor": {"path": f"builtin:{model}", "device_group": "train_group", "dtype": dtype}},
        "devices": {"train_group": {"type": "cpu"}, "gen_group": {"type": "cpu"}},
        "nodes": {
            "rollout": {"role": "generate", "model": "actor", "inputs": ["prompts"], "n": 2, "max_new_tokens": 4,
                        "device_group": "gen_group"},
            "reward": {"role": "score", "fn": "digits", "inputs": ["rollout"]},
            "adv": {"role": "advantage", "estimator": "grpo", "inputs": ["reward"]},
            "train": {"role": "update", "model": "actor", "inputs": ["rollout", "adv"], "lr": 1.0e-6},
        },
        "data": {"source": "builtin:digits", "batch_size": 4},
        "trainer": {"steps": steps, "output_dir": str(output), "seed": 0},
        "runtime": {"weight_sync": mode},
    }


def one_run(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        result = run(pipeline_from_dict(pipeline(args.model, args.dtype, mode, args.steps, Path(folder) / "out")))
    seconds = result.metric("perf/weight_sync_s")[1:]
    megabytes = result.metric("perf/weight_sync_mb")[1:]
    ends = [record.elapsed_s for record in result.records]
    steps = [later - earlier for earlier, later in zip(ends, ends[1:])]
    return {
        "mode": mode,
        "collective": result.metric("perf/weight_sync_collective")[1:],
        "sync_s": seconds,
        "sync_mb": megabytes,
        "s_per_gb": [s / (mb / 1e3) for s, mb in zip(seconds, megabytes)],
        "s_per_gb_median": statistics.median(s / (mb / 1e3) for s, mb in zip(seconds, megabytes)),
        "step_s": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2-0.4b")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--steps", type=int, default=4, help="steps per run; the first is left out")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--modes", default="call,collective")
    parser.add_argument("--output", type=Path, default=HERE / "results" / "weight_sync.json")
    args = parser.parse_args()
    report: dict[str, Any] = {"machine": machine(), "settings": {k: str(v) for k, v in vars(args).items()}, "runs": []}
    for round_index in range(args.repeats):
        for mode in args.modes.split(","):
            entry = {"round": round_index, **one_run(args, mode)}
            report["runs"].append(entry)
            print(f"round {round_index} {mode}: {entry['s_per_gb_median']:.3f} s/GB "
                  f"({statistics.median(entry['sync_mb']):.0f} MB)", flush=True)
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps(report, indent=2) + "\n")
    report["summary"] = {
        mode: statistics.median(run["s_per_gb_median"] for run in report["runs"] if run["mode"] == mode)
        for mode in args.modes.split(",")
    }
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["summary"]), f"written: {args.output}")


if __name__ == "__main__":
    main()
