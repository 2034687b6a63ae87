"""The planner's placement of a pipeline against placements given by hand, each run for real,
interleaved, in one run: is the plan's choice the faster?

    python benchmarks/placements.py --pipeline pipelines/grpo_0.4b_gpu.yaml --steps 12 --repeats 2 \
        --variant planned= \
        --variant reward_on_gpu=nodes.reward.device_group=gpu_group,nodes.adv.device_group=gpu_group \
        --output benchmarks/results/placements_0.4b.json

Each ``--variant NAME=OVERRIDE,OVERRIDE`` is ``flowrl run PIPELINE --plain OVERRIDE...`` (an
empty list: the planner's own placement). Every round runs every variant once, the order
turning by one each round, each run a process of its own with empty compile caches (as
``planner_accuracy.py``). Per run: the placement, the plan's predicted step, the measured
median step and node times (``plan-N.json``'s measured side), the peak memory per device; per
variant: the median over its runs, and per round each variant's step over the first
variant's. Writes JSON with the commit measured; never asserts.
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
sys.path.insert(0, str(HERE))

from planner_accuracy import run_once  # noqa: E402
from vs_trl import machine  # noqa: E402


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, _, overrides = text.partition("=")
    if not name:
        raise SystemExit(f"--variant {text!r}: expected NAME=OVERRIDE,OVERRIDE (or NAME= for none)")
    return name, [item for item in overrides.split(",") if item]


def summary(runs: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """Per variant the median step over its runs; per round each variant over the first."""
    steps = {name: [run["measured_step_s"] for run in runs if run["variant"] == name and run.get("measured_step_s")]
             for name in names}
    result: dict[str, Any] = {name: {"step_s_median": statistics.median(values) if values else None,
                                     "step_s_per_run": values} for name, values in steps.items()}
    first = names[0]
    for name in names[1:]:
        ratios = []
        for round_ in sorted({run["round"] for run in runs}):
            here = {run["variant"]: run.get("measured_step_s") for run in runs if run["round"] == round_}
            if here.get(name) and here.get(first):
                ratios.append(here[name] / here[first])
        result[f"{name}_over_{first}"] = {"per_round": ratios,
                                          "median": statistics.median(ratios) if ratios else None}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", type=Path, required=True)
    parser.add_argument("--variant", action="append", required=True, help="NAME=OVERRIDE,OVERRIDE")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    variants = dict(parse_variant(text) for text in args.variant)
    names = list(variants)
    runs: list[dict[str, Any]] = []
    report: dict[str, Any] = {"benchmark": "placements", "machine": machine(), "pipeline": str(args.pipeline),
                              "steps": args.steps, "variants": variants, "runs": runs}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(args.repeats):
            order = names[round_ % len(names):] + names[: round_ % len(names)]
            for name in order:
                output = Path(folder) / f"{round_}-{name}"
                run = run_once(args.pipeline.resolve(), args.steps, output, variants[name])
                run = {"variant": name, "round": round_, **run}
                runs.append(run)
                print(json.dumps({key: run.get(key) for key in ("variant", "round", "returncode", "placement",
                                                               "predicted_step_s", "measured_step_s")}), flush=True)
                # written after every run: a command stopped from outside keeps what finished
                report["summary"] = summary(runs, names)
                args.output.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["summary"], indent=1))
    print(f"written: {args.output}")


if __name__ == "__main__":
    main()
