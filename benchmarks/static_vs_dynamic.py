"""Static vs dynamic placement, side by side: on the simulator and for real on this machine.

    python benchmarks/static_vs_dynamic.py --part both \
        --output benchmarks/results/static_vs_dynamic.json

Part ``sim``: ``pipelines/ppo.yaml`` on every shipped GPU inventory under every shipped drift
scenario, both policies on the same noise stream, for several seeds. The spread of a ratio is
its range over the seeds.

Part ``real``: the default GRPO pipeline on this machine's two CPU slots, each slot's worker
pinned to its own half of the cores (``runtime.pin_cpus``). Part-way through the run
(``--hog-at``) the benchmark starts a CPU-hungry process pinned to the cores of the slot that
holds the actor, and leaves it running to the end. The static policy keeps the actor there;
the dynamic one is free to move it. Both policies run in this one invocation, alternating,
``--repeats`` times each; the ratio's spread is its range over the repeats.

Reported per policy: throughput (steps/s; for ``real`` also after the contention starts), mean
device utilisation, step latency mean and standard deviation, peak memory, failures and moves.
The table is printed and everything is written as JSON. It never asserts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from flowrl.api.run import run  # noqa: E402
from flowrl.devices.files import load_inventory  # noqa: E402
from flowrl.errors import FlowrlError  # noqa: E402
from flowrl.records import RunEvent, StepRecord  # noqa: E402
from flowrl.scheduler.policy import settings_from_spec  # noqa: E402
from flowrl.simulator.run import compare_policies  # noqa: E402
from flowrl.simulator.scenario import load_scenario  # noqa: E402
from flowrl.spec.loader import load_pipeline, pipeline_from_dict  # noqa: E402

DEFAULT_OUTPUT = HERE / "results" / "static_vs_dynamic.json"
SIM_PIPELINE = REPO / "pipelines" / "ppo.yaml"
SIM_INVENTORIES = ("mixed-4gpu", "a100-4x40gb", "h200-8x", "cluster-2node")
SCENARIOS = ("steady", "unbalanced", "throttle", "device_lost", "device_added")
REAL_PIPELINE = REPO / "pipelines" / "grpo_tiny.yaml"
SPIN = "while True: pass"


# ---- simulator ---------------------------------------------------------------------------


def simulate_all(steps: int, seeds: list[int]) -> list[dict[str, Any]]:
    graph = load_pipeline(SIM_PIPELINE)
    settings = settings_from_spec(graph.spec.scheduler)
    rows = []
    for inventory_name in SIM_INVENTORIES:
        inventory = load_inventory(REPO / "devices" / f"{inventory_name}.yaml")
        for scenario_name in SCENARIOS:
            row: dict[str, Any] = {"inventory": inventory_name, "scenario": scenario_name}
            try:
                scenario = load_scenario(scenario_name, inventory)
                runs = [
                    compare_policies(graph, inventory, scenario, ["static", "dynamic"], steps, seed, settings,
                                     base_dir=SIM_PIPELINE.parent)
                    for seed in seeds
                ]
            except FlowrlError as error:
                row["skipped"] = " ".join(line.strip() for line in str(error).splitlines()[:2])
                rows.append(row)
                continue
            for policy in ("static", "dynamic"):
                summaries = [result[policy].summary for result in runs]
                peak = max(
                    device.peak_gb
                    for result in runs
                    for plan in (result[policy].first_plan, result[policy].last_plan)
                    for device in plan.devices
                )
                row[policy] = {
                    "throughput_steps_per_s": statistics.fmean(s.throughput_steps_per_s for s in summaries),
                    "mean_utilization": statistics.fmean(s.mean_utilization for s in summaries),
                    "step_s_mean": statistics.fmean(s.mean_step_s for s in summaries),
                    "step_s_std": statistics.fmean(s.std_step_s for s in summaries),
                    "peak_memory_gb": peak,
                    "failures": sum(s.num_failures for s in summaries) / len(summaries),
                    "moves": sum(s.num_moves for s in summaries) / len(summaries),
                }
            ratios = [
                result["dynamic"].summary.throughput_steps_per_s / result["static"].summary.throughput_steps_per_s
                for result in runs
            ]
            row["ratio"] = _spread(ratios)
            # from the first event on: what the policy does about it, without the steps before
            first = min((event.step for event in scenario.events), default=1)
            row["from_step"] = first
            pairs = [(_throughput_from(result["dynamic"], first), _throughput_from(result["static"], first)) for result in runs]
            # None when static completed no step from the event on (a lost device it needs)
            row["ratio_from_event"] = _spread([d / s for d, s in pairs]) if all(s > 0 for _, s in pairs) else None
            rows.append(row)
    return rows


def _throughput_from(result: Any, step: int) -> float:
    steps = [item for item in result.steps if item.step >= step]
    total = sum(item.step_s for item in steps)
    return sum(1 for item in steps if not item.failed) / total if total > 0 else 0.0


# ---- real ---------------------------------------------------------------------------------


class Contention:
    """Starts one spinning process per core of a slot when the run reaches ``at_step``."""

    def __init__(self, at_step: int, cores: tuple[int, ...]) -> None:
        self.at_step = at_step
        self.cores = cores
        self.processes: list[subprocess.Popen[bytes]] = []
        self.events: list[RunEvent] = []

    def on_step(self, record: StepRecord) -> None:
        if record.step == self.at_step and not self.processes:
            for core in self.cores:
                self.processes.append(
                    subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-c", SPIN])
                )

    def on_event(self, event: RunEvent) -> None:
        self.events.append(event)

    def stop(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait()
        self.processes = []


def real_once(policy: str, steps: int, hog_at: int | None, every_steps: int, workdir: Path) -> dict[str, Any]:
    """One run; ``hog_at`` None: no contention (the control)."""
    graph = load_pipeline(REAL_PIPELINE)
    spec = graph.spec.model_dump(mode="json", exclude_unset=True)
    spec["trainer"] = {**spec.get("trainer", {}), "steps": steps, "output_dir": str(workdir / policy)}
    spec["scheduler"] = {"policy": policy, "every_steps": every_steps}
    spec["runtime"] = {"pin_cpus": True}
    cores = sorted(os.sched_getaffinity(0))
    # cpu-0 holds the actor in the first plan; with pinning it owns the first share of cores
    contention = Contention(hog_at if hog_at is not None else steps + 1, tuple(cores[: max(1, len(cores) // 2)]))
    failed = None
    try:
        result = run(pipeline_from_dict(spec), observer=contention, base_dir=REPO)
        records = result.records
    except FlowrlError as error:
        failed, records = str(error), []
    finally:
        contention.stop()
    step_s = [r.metrics["timing_s/step"] for r in records]
    after = [r for r in records if r.step > (hog_at or 0)]
    util = [d.utilization for r in records for d in r.devices]
    moves = [e for e in contention.events if e.kind == "move"]
    return {
        "policy": policy,
        "failed": failed,
        "steps_completed": len(records),
        "throughput_steps_per_s": len(records) / sum(step_s) if step_s else 0.0,
        "throughput_after_contention": len(after) / sum(r.metrics["timing_s/step"] for r in after) if after else 0.0,
        "mean_utilization": statistics.fmean(util) if util else 0.0,
        "step_s_mean": statistics.fmean(step_s) if step_s else float("nan"),
        "step_s_std": statistics.pstdev(step_s) if step_s else float("nan"),
        "peak_memory_gb": max((d.memory_gb for r in records for d in r.devices), default=0.0),
        "moves": [e.message for e in moves],
        "move_steps": [e.step for e in moves],
        "final_reward": statistics.fmean(r.metrics["critic/score/mean"] for r in records[-10:]) if records else None,
    }


def real_all(steps: int, hog_at: int | None, every_steps: int, repeats: int) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(repeats):
            order = ("static", "dynamic") if repeat % 2 == 0 else ("dynamic", "static")
            for policy in order:
                what = "control, no contention" if hog_at is None else f"contention from step {hog_at}"
                print(f"real ({what}): repeat {repeat + 1}/{repeats}, {policy} ...", flush=True)
                runs.append({"repeat": repeat, **real_once(policy, steps, hog_at, every_steps, Path(tmp) / str(repeat))})
    by_repeat: dict[int, dict[str, dict[str, Any]]] = {}
    for item in runs:
        by_repeat.setdefault(item["repeat"], {})[item["policy"]] = item
    ratio_all = [r["dynamic"]["throughput_steps_per_s"] / r["static"]["throughput_steps_per_s"] for r in by_repeat.values()]
    ratio_after = [
        r["dynamic"]["throughput_after_contention"] / r["static"]["throughput_after_contention"] for r in by_repeat.values()
    ]
    return {
        "steps": steps,
        "hog_at_step": hog_at,
        "every_steps": every_steps,
        "runs": runs,
        "ratio_whole_run": _spread(ratio_all),
        "ratio_after_contention": _spread(ratio_after),
    }


# ---- report ------------------------------------------------------------------------------


def _spread(values: list[float]) -> dict[str, Any]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "values": values}


def _ratio_text(spread: dict[str, Any] | None) -> str:
    if spread is None:
        return "static completed no step"
    return f"{spread['mean']:.2f}x ({spread['min']:.2f}-{spread['max']:.2f})"


def print_sim(rows: list[dict[str, Any]]) -> None:
    header = f"{'inventory':<14}{'scenario':<14}{'policy':<9}{'steps/s':>9}{'util':>7}{'step ms':>10}{'+-':>7}{'peak GB':>9}{'fail':>6}{'moves':>7}  dynamic/static: run, from event"
    print("\nsimulator (pipelines/ppo.yaml; means over seeds; ratio range over seeds)")
    print(header)
    for row in rows:
        if "skipped" in row:
            print(f"{row['inventory']:<14}{row['scenario']:<14}skipped: {row['skipped']}")
            continue
        for policy in ("static", "dynamic"):
            s = row[policy]
            ratio = (
                f"{_ratio_text(row['ratio'])}, {_ratio_text(row['ratio_from_event'])} (step {row['from_step']}+)"
                if policy == "dynamic"
                else ""
            )
            print(
                f"{row['inventory']:<14}{row['scenario']:<14}{policy:<9}{s['throughput_steps_per_s']:>9.2f}"
                f"{s['mean_utilization']:>7.0%}{s['step_s_mean'] * 1e3:>10.1f}{s['step_s_std'] * 1e3:>7.1f}"
                f"{s['peak_memory_gb']:>9.1f}{s['failures']:>6.1f}{s['moves']:>7.1f}  {ratio}"
            )


def print_real(real: dict[str, Any]) -> None:
    contention = (
        "no contention (control)"
        if real["hog_at_step"] is None
        else f"a CPU-hungry process on the actor's slot from step {real['hog_at_step']}"
    )
    print(f"\nthis machine: {real['steps']} steps of pipelines/grpo_tiny.yaml on 2 pinned CPU slots, {contention}")
    print(f"{'repeat':<8}{'policy':<9}{'steps/s':>9}{'after':>8}{'util':>7}{'step ms':>9}{'+-':>7}{'peak GB':>9}{'fail':>6}  moves")
    for item in real["runs"]:
        print(
            f"{item['repeat'] + 1:<8}{item['policy']:<9}{item['throughput_steps_per_s']:>9.2f}"
            f"{item['throughput_after_contention']:>8.2f}{item['mean_utilization']:>7.0%}"
            f"{item['step_s_mean'] * 1e3:>9.1f}{item['step_s_std'] * 1e3:>7.1f}{item['peak_memory_gb']:>9.2f}"
            f"{(1 if item['failed'] else 0):>6}  {'; '.join(item['moves']) or '-'}"
        )
    print(f"dynamic / static throughput: whole run {_ratio_text(real['ratio_whole_run'])}, "
          f"after the contention starts {_ratio_text(real['ratio_after_contention'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("sim", "real", "both"), default="both")
    parser.add_argument("--sim-steps", type=int, default=200)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=150, help="steps of each real run")
    parser.add_argument("--hog-at", type=int, default=40, help="step after which the contention starts")
    parser.add_argument("--every-steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--control", action="store_true", help="also run both policies without contention")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args()
    from vs_trl import machine  # the benchmarks folder is the script's: on sys.path

    report: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine(),
    }
    if args.part in ("sim", "both"):
        report["simulator"] = simulate_all(args.sim_steps, [int(s) for s in args.seeds.split(",")])
        print_sim(report["simulator"])
    if args.part in ("real", "both"):
        report["real"] = real_all(args.steps, args.hog_at, args.every_steps, args.repeats)
        print_real(report["real"])
        if args.control:
            report["real_control"] = real_all(args.steps, None, args.every_steps, args.repeats)
            print_real(report["real_control"])
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwritten: {args.output}")


if __name__ == "__main__":
    main()
