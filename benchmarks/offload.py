"""A model offloaded to CPU memory between its calls: the planner's predicted peak device memory
against the measured one, with and without the offload, in one run.

    python benchmarks/offload.py --pipeline pipelines/grpo_0.4b_gpu.yaml --model reference \
        --output benchmarks/results/offload_h200.json

Runs ``flowrl run PIPELINE models.MODEL.offload_to_cpu=X`` for X = false, true (``--repeats``
rounds, interleaved; each run a process of its own, ``--steps`` steps). Per run: the plan's
predicted peak memory of each device (``plan-0.json``) and of each node, the measured peak of
each step (``perf/max_memory_allocated_gb``: the largest ``torch.cuda.max_memory_allocated``
of the step's node calls, reset before each call), and the step and per-node times after the
first step. Writes JSON with the commit measured; never asserts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from vs_trl import machine  # noqa: E402


def run_once(pipeline: Path, model: str, offload: bool, steps: int, output: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", "flowrl.cli.main", "run", str(pipeline), "--plain",
               f"trainer.steps={steps}", f"trainer.output_dir={output}",
               f"models.{model}.offload_to_cpu={str(offload).lower()}"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=HERE.parent)
    if done.returncode != 0:
        return {"offload_to_cpu": offload, "returncode": done.returncode, "stderr_tail": done.stderr[-3000:]}
    plan = json.loads((output / "plan-0.json").read_text())
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    return {
        "offload_to_cpu": offload,
        "returncode": 0,
        "planned_offloaded_nodes": plan["offloaded"],
        "predicted_peak_gb": {device["device"]: device["peak_gb"] for device in plan["devices"]},
        "predicted_node_gb": {node["node"]: node["memory_gb"] for node in plan["nodes"]},
        "measured_peak_gb_per_step": [row.get("perf/max_memory_allocated_gb") for row in rows],
        "median_s": median_timings(rows),
    }


def median_timings(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Median seconds of the step and of each node (``timing_s/*``) over a run's metric rows,
    the first step (warm-up) left out."""
    timed = rows[1:] or rows
    timings = sorted({key for row in timed for key in row if key.startswith("timing_s/")})
    return {key.removeprefix("timing_s/"): statistics.median(row[key] for row in timed if key in row)
            for key in timings}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", type=Path, default=HERE.parent / "pipelines" / "grpo_0.4b_gpu.yaml")
    parser.add_argument("--model", default="reference")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--output", type=Path, default=HERE / "results" / "offload.json")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(args.repeats):
            for offload in (False, True):
                run = run_once(args.pipeline.resolve(), args.model, offload, args.steps,
                               Path(folder) / f"{round_}-{offload}")
                runs.append({"round": round_, **run})
                print(json.dumps(run)[:600], flush=True)
    report = {"benchmark": "offload", "machine": machine(), "pipeline": str(args.pipeline), "model": args.model,
              "steps": args.steps, "runs": runs}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1) + "\n")
    print(f"written: {args.output}")


if __name__ == "__main__":
    main()
