"""Held-out accuracy before and after GRPO on the arithmetic task, for several seeds.

Runs ``flowrl run pipelines/grpo_arith.yaml trainer.seed=S`` once per seed, one after the
other, each as a fresh process, with a fresh cache folder for the first one so that its wall
time includes fitting ``builtin:arith-llama``. Greedy accuracy on the 500 held-out problems
is read from each run's ``metrics.jsonl`` (``val/reward/mean`` at step 0 and after the last
step). Writes ``benchmarks/results/grpo_arith.json``; never asserts.

    python benchmarks/grpo_arith.py --seeds 0,1,2
    python benchmarks/grpo_arith.py --seeds 0 --set models.actor.lora.rank=16 --set nodes.train.lr=2e-3 \
        --output benchmarks/results/grpo_arith_lora.json

``--set KEY=VALUE`` changes the pipeline as on ``flowrl run``'s command line (each run gets
them; the report records them).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLOWRL = str(Path(sys.executable).parent / "flowrl")
KEY = "val/reward/mean"


def run_seed(seed: int, output: Path, cache: Path, changes: list[str]) -> dict[str, object]:
    started = time.perf_counter()
    result = subprocess.run(
        [FLOWRL, "run", str(REPO / "pipelines" / "grpo_arith.yaml"), "--plain",
         f"trainer.seed={seed}", f"trainer.output_dir={output}", *changes],
        capture_output=True, text=True, env={**os.environ, "FLOWRL_CACHE": str(cache)},
    )
    wall_s = time.perf_counter() - started
    lines = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()] if result.returncode == 0 else []
    evaluated = [(line["step"], line[KEY]) for line in lines if KEY in line]
    steps = [line for line in lines if line["step"] > 0]
    return {
        "seed": seed,
        "returncode": result.returncode,
        "wall_s": round(wall_s, 1),
        "accuracy_start": evaluated[0][1] if evaluated else None,
        "accuracy_end": evaluated[-1][1] if evaluated else None,
        "accuracy_by_step": evaluated,
        "median_step_s": sorted(line["timing_s/step"] for line in steps)[len(steps) // 2] if steps else None,
        "stderr_tail": result.stderr[-2000:] if result.returncode else "",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "grpo_arith.json"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a change to the pipeline, as on flowrl run's command line (repeatable)")
    args = parser.parse_args()
    from vs_trl import machine  # the benchmarks folder is the script's: on sys.path

    measured = machine()  # the commit and files the runs start from, before they take minutes
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        cache = Path(folder) / "cache"  # fresh: the first run fits builtin:arith-llama
        for seed in [int(item) for item in args.seeds.split(",")]:
            run = run_seed(seed, Path(folder) / f"seed-{seed}", cache, args.set)
            runs.append(run)
            print(f"seed {seed}: accuracy {run['accuracy_start']} -> {run['accuracy_end']} "
                  f"in {run['wall_s']} s (median step {run['median_step_s']} s)", flush=True)
    report = {
        "benchmark": "grpo_arith",
        "command": " ".join(["flowrl run pipelines/grpo_arith.yaml trainer.seed=S", *args.set]),
        "changes": args.set,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": measured,
        "metric": f"{KEY}: greedy accuracy on the 500 held-out problems (math_answer)",
        "runs": runs,
    }
    Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
