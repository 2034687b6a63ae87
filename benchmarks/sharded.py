"""A policy trained sharded (FSDP2) over two workers against the same job trained with a whole
trainable copy per worker: memory per worker, predicted and measured, step time, and the
losses of both, in one run.

    python benchmarks/sharded.py --model qwen2-0.4b --steps 4 --repeats 2 \
        --output benchmarks/results/sharded.json

Runs ``flowrl run pipelines/grpo_sharded.yaml models.actor.sharded=X`` for X = false, true
(``--repeats`` rounds, interleaved; each run a process of its own) with the actor and the
reference replaced by the builtin ``--model``, and a smaller batch so that a step of a
large model stays short on a small CPU machine. Per run: the plan's predicted peak memory per
device and the update node's predicted memory (``plan-0.json``), each worker's measured peak
resident memory per step (``profile.jsonl``: the sampler's peak RSS of the worker process,
sampled every 0.1 s), median seconds of the step and of each node after the first step, and
each step's losses. Writes JSON with the commit measured; never asserts.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from offload import median_timings  # noqa: E402
from vs_trl import machine  # noqa: E402

COMPARED = ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/score/mean")


def run_once(model: str, sharded: bool, steps: int, batch: tuple[int, int, int], output: Path) -> dict[str, Any]:
    prompts, samples, tokens = batch
    command = [sys.executable, "-m", "flowrl.cli.main", "run", str(HERE.parent / "pipelines" / "grpo_sharded.yaml"),
               "--plain", f"trainer.steps={steps}", f"trainer.output_dir={output}",
               f"models.actor.path=builtin:{model}", f"models.reference.path=builtin:{model}",
               f"models.actor.sharded={str(sharded).lower()}", f"data.batch_size={prompts}",
               f"nodes.rollout.n={samples}", f"nodes.rollout.max_new_tokens={tokens}",
               "profiler.sample_interval_s=0.1"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=HERE.parent)
    if done.returncode != 0:
        return {"sharded": sharded, "returncode": done.returncode, "stderr_tail": done.stderr[-3000:]}
    plan = json.loads((output / "plan-0.json").read_text())
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    profile = [json.loads(line) for line in (output / "profile.jsonl").read_text().splitlines()]
    measured: dict[str, float] = {}
    for sample in profile:
        if sample.get("type") == "device":
            measured[sample["device"]] = max(measured.get(sample["device"], 0.0), sample["memory_gb"])
    return {
        "sharded": sharded,
        "returncode": 0,
        "predicted_peak_gb": {device["device"]: device["peak_gb"] for device in plan["devices"]},
        "predicted_train_gb": next(node["memory_gb"] for node in plan["nodes"] if node["node"] == "train"),
        "predicted_train_s": next(node["predicted_s"] for node in plan["nodes"] if node["node"] == "train"),
        "measured_peak_rss_gb": measured,
        "median_s": median_timings(rows),
        "per_step": [{key: row.get(key) for key in COMPARED} for row in rows],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2-0.4b")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch", default="1,4,8", help="prompts per step, samples per prompt, new tokens")
    parser.add_argument("--output", type=Path, default=HERE / "results" / "sharded.json")
    args = parser.parse_args()
    prompts, samples, tokens = (int(value) for value in args.batch.split(","))
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(args.repeats):
            for sharded in (False, True):
                run = run_once(args.model, sharded, args.steps, (prompts, samples, tokens),
                               Path(folder) / f"{round_}-{sharded}")
                runs.append({"round": round_, **run})
                print(json.dumps(run)[:800], flush=True)
    report = {"benchmark": "sharded", "machine": machine(), "pipeline": "pipelines/grpo_sharded.yaml",
              "model": args.model, "steps": args.steps, "batch": {"prompts": prompts, "samples": samples,
                                                                   "new_tokens": tokens}, "runs": runs}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1) + "\n")
    print(f"written: {args.output}")


if __name__ == "__main__":
    main()
