"""The planner against measurement: predicted vs measured per node, per step and per device's
peak memory, and whether the planner's placement is the measured fastest of its candidates.

    python benchmarks/planner_accuracy.py --pipelines grpo_tiny,ppo_tiny,grpo_data_parallel \
        --candidates grpo_tiny,ppo_tiny --output benchmarks/results/planner_accuracy_cpu.json
    python benchmarks/planner_accuracy.py --pipelines grpo_tiny_gpu,grpo_0.4b_gpu --steps 12 \
        --output benchmarks/results/planner_accuracy_h200.json

Per pipeline, one ``flowrl run`` (a process of its own) writes ``plan-0.json``: the first plan's
prediction (per node and the step), what was measured over the run (``measured``), and the
calibrated prediction (``calibrated``: per-node factors learned on the first half of the steps
after the first, the plan simulated again with them, set beside the second half's medians).
Memory: the plan's predicted peak per device (without the CUDA context the planner adds, since
``torch.cuda.max_memory_allocated`` does not see it) against the largest measured peak of the
node calls on it, over the whole run and over the steps after the first (which compiles). Each
run starts with empty compile caches, as a first run on a machine does.

Candidates (``--candidates``): every way of putting the pipeline's device groups on the CPU
slots (``devices.G.device_ids``, the first group on slot 0) is run for real, ``--repeats``
rounds interleaved; the planner's own choice (the default run's placement of each group) is
marked, and its measured median step is compared with the fastest candidate's, and within each
round with every other candidate's (``per_round``: the median over rounds of the ratio; a
machine whose speed drifts between rounds moves the medians, not a round's ratio). Each
candidate is also predicted by the planner (``flowrl plan`` with the same pins) before it runs.
Picking the fastest of several candidates from noisy timings favours whichever was lucky (on
2 cores the same layout's step moves by 10-25 % between rounds), so the comparison is checked
on fresh runs: the choice and the candidate it did worst against (its runner-up when it won)
run ``--confirm`` more rounds, the two alternating which goes first, and ``confirmed`` holds the
median of choice / candidate over those rounds alone. ``--summarize FILE`` prints the per-round comparison of an existing result
file.
Writes JSON with the commit measured; never asserts.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from vs_trl import machine  # noqa: E402

from flowrl.planner.simulate import GPU_CONTEXT_GB  # noqa: E402


def flowrl(*arguments: str) -> subprocess.CompletedProcess[str]:
    # Every run compiles from nothing (fresh inductor and Triton caches), as a first run on a
    # machine does: compiling allocates what a cached run skips (inductor's timing buffer),
    # and the planner's prediction must cover that first run.
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor", "TRITON_CACHE_DIR": f"{cache}/triton"}
        return subprocess.run([sys.executable, "-m", "flowrl.cli.main", *arguments], capture_output=True,
                              text=True, cwd=ROOT, env=env)


def run_once(pipeline: Path, steps: int, output: Path, overrides: list[str]) -> dict[str, Any]:
    done = flowrl("run", str(pipeline), "--plain", f"trainer.steps={steps}", f"trainer.output_dir={output}",
                  *overrides)
    if done.returncode != 0:
        return {"returncode": done.returncode, "stderr_tail": done.stderr[-3000:]}
    plan = json.loads((output / "plan-0.json").read_text())
    measured = plan.get("measured", {})
    node_peak = {node: item["peak_memory_gb"] for node, item in measured.get("nodes", {}).items()}
    calls = node_calls(output / "profile.jsonl")
    later_peak = peaks_after_first_step(calls)
    context = GPU_CONTEXT_GB  # max_memory_allocated does not count the CUDA context
    devices = {}
    for device in plan["devices"]:
        here = [node_peak.get(node, 0.0) for node in device["nodes"]]
        later = [later_peak[node] for node in device["nodes"] if node in later_peak]
        gpu = device["kind"] == "gpu"
        devices[device["device"]] = {
            "predicted_peak_gb": device["peak_gb"] - (context if gpu else 0.0),
            "measured_peak_gb": max(here, default=0.0) if gpu else None,
            "measured_peak_after_first_step_gb": max(later) if gpu and later else None,
            "nodes": device["nodes"],
            "models": device["models"],
        }
    for item in devices.values():
        if item["measured_peak_gb"]:
            item["predicted_over_measured"] = item["predicted_peak_gb"] / item["measured_peak_gb"]
    calibrated = plan.get("calibrated") or {}
    return {
        "returncode": 0,
        "placement": {node["node"]: node["devices"] for node in plan["nodes"]},
        "model_devices": plan["runtime"]["model_slots"],
        "predicted_step_s": plan["iteration_s"],
        "measured_step_s": measured.get("step_s_median"),
        "nodes": {node["node"]: {"predicted_s": node.get("predicted_s"), "measured_s": node.get("measured_s"),
                                 "predicted_gb": node["memory_gb"],
                                 "measured_peak_gb": node_peak.get(node["node"])} for node in plan["nodes"]},
        "devices": devices,
        "node_steps": node_steps(calls),
        "calibrated": calibrated,
        "calibrated_step_error": (calibrated["iteration_s"] / calibrated["measured_step_s_median"] - 1)
        if calibrated.get("measured_step_s_median") else None,
    }


def node_calls(profile: Path) -> list[dict[str, Any]]:
    """The node calls a run's ``profile.jsonl`` records, in order (none without the file)."""
    lines = (json.loads(text) for text in (profile.read_text().splitlines() if profile.is_file() else []))
    return [line for line in lines if line.get("type") == "node"]


def peaks_after_first_step(calls: list[dict[str, Any]]) -> dict[str, float]:
    """Each node's largest measured peak over the steps after the run's first: the first step
    compiles (torch.compile's tuning allocates scratch memory of its own), the later ones show
    what the run holds while it trains."""
    measured = [line for line in calls if line.get("peak_memory_gb")]
    first = min((line["step"] for line in measured), default=0)
    peaks: dict[str, float] = {}
    for line in measured:
        if line["step"] > first:
            peaks[line["node"]] = max(peaks.get(line["node"], 0.0), line["peak_memory_gb"])
    return peaks


def node_steps(calls: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Each node's calls in step order (compute, waiting and wall seconds, device, tokens, arrival): a
    node whose time drifts over the run shows how, where a median hides it."""
    fields = ("step", "device", "compute_s", "wait_s", "wall_s", "tokens_in", "arrived_at")
    steps: dict[str, list[dict[str, Any]]] = {}
    for line in calls:
        steps.setdefault(line["node"], []).append({key: line.get(key) for key in fields})
    return steps


def group_layouts(pipeline: Path, slots: int) -> list[dict[str, int]]:
    """Every assignment of the pipeline's device groups to ``slots`` CPU slots, up to renaming
    the slots (the first group on slot 0)."""
    import yaml

    groups = list(yaml.safe_load(pipeline.read_text())["devices"])
    layouts = []
    for rest in itertools.product(range(slots), repeat=len(groups) - 1):
        layout = dict(zip(groups, (0, *rest)))
        used = sorted(set(layout.values()))
        if used == list(range(len(used))):  # slots numbered in order of first use
            layouts.append(layout)
    return layouts


def pins(layout: dict[str, int]) -> list[str]:
    return [f"devices.{group}.device_ids=[{slot}]" for group, slot in layout.items()]


def predicted(pipeline: Path, overrides: list[str]) -> float | None:
    done = flowrl("plan", str(pipeline), "--json", *overrides)
    return json.loads(done.stdout)["iteration_s"] if done.returncode == 0 else None


def layout_of(result: dict[str, Any], pipeline: Path) -> dict[str, int] | None:
    """The default run's placement as group -> slot number (slots renumbered by first use)."""
    import yaml

    spec = yaml.safe_load(pipeline.read_text())
    order: list[str] = []
    layout = {}
    for model, item in spec["models"].items():
        devices = result.get("model_devices", {}).get(model)
        if not devices:
            return None
        if devices[0] not in order:
            order.append(devices[0])
        layout[item["device_group"]] = order.index(devices[0])
    return layout


def per_round(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The planner's choice against each other candidate within each round (the candidates of
    a round run one after another, so a machine that drifts over minutes moves both sides):
    per candidate, the median over rounds of choice / candidate; and the largest of them, what
    the choice loses to the candidate it loses to most (1.0 or less: it is the fastest)."""
    mine = next((item for item in runs if item["planner_choice"]), None)
    if mine is None:
        return {}
    ratios: dict[str, float] = {}
    for item in runs:
        if item is mine:
            continue
        pairs = [m / c for m, c in zip(mine["measured_step_s"], item["measured_step_s"]) if m and c]
        if pairs:
            ratios[json.dumps(item["layout"], sort_keys=True)] = statistics.median(pairs)
    worst = max(ratios, key=lambda key: ratios[key]) if ratios else None
    return {"choice_over_each_per_round": ratios, "choice_over_fastest_per_round": ratios[worst] if worst else None,
            "fastest_per_round": json.loads(worst) if worst and ratios[worst] > 1.0 else mine["layout"]}


def confirm(pipeline: Path, mine: dict[str, int], rival: dict[str, int], rounds: int, steps: int,
            scratch: Path) -> dict[str, Any]:
    """The choice against ``rival`` on fresh runs, ``rounds`` rounds, the two alternating which
    runs first: free of the luck that picked either among many candidates."""
    times: dict[str, list[float | None]] = {"choice": [], "rival": []}
    for round_ in range(rounds):
        order = [("choice", mine), ("rival", rival)]
        for side, layout in order if round_ % 2 == 0 else order[::-1]:
            once = run_once(pipeline, steps, scratch / f"{side}-{round_}", pins(layout))
            times[side].append(once.get("measured_step_s"))
            print(pipeline.stem, "confirm", side, layout, once.get("measured_step_s"), flush=True)
    ratios = [m / r for m, r in zip(times["choice"], times["rival"]) if m and r]
    return {"against": rival, "measured_step_s": times,
            "choice_over_it_per_round": ratios, "choice_over_it": statistics.median(ratios) if ratios else None}


def summarize(path: Path) -> None:
    """Print the per-round comparison of a result file's candidates (``per_round``)."""
    result = json.loads(path.read_text())
    for name, item in result.get("candidates", {}).items():
        confirmed = item.get("confirmed") or {}
        print(name, json.dumps({**per_round(item["runs"]), "confirmed_choice_over_it": confirmed.get("choice_over_it")}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipelines", default="grpo_tiny,ppo_tiny,grpo_data_parallel")
    parser.add_argument("--candidates", default="", help="pipelines whose group layouts are all run")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--candidate-steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--confirm", type=int, default=3,
                        help="rounds of the choice against the candidate it lost to most, on fresh runs")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--summarize", type=Path, help="print the per-round comparison of this result file and stop")
    args = parser.parse_args()
    if args.summarize:
        summarize(args.summarize)
        return
    if args.output is None:
        parser.error("--output is required")
    result: dict[str, Any] = {"benchmark": "planner_accuracy", "command": " ".join(sys.argv),
                              "machine": machine(), "pipelines": {}, "candidates": {}}
    with tempfile.TemporaryDirectory() as scratch:
        for name in [item for item in args.pipelines.split(",") if item]:
            pipeline = ROOT / "pipelines" / f"{name}.yaml"
            result["pipelines"][name] = run_once(pipeline, args.steps, Path(scratch) / name, [])
            print(name, json.dumps({k: result["pipelines"][name].get(k) for k in
                                    ("predicted_step_s", "measured_step_s", "calibrated_step_error")}), flush=True)
        for name in [item for item in args.candidates.split(",") if item]:
            pipeline = ROOT / "pipelines" / f"{name}.yaml"
            default = result["pipelines"].get(name) or run_once(pipeline, args.steps, Path(scratch) / name, [])
            chosen = layout_of(default, pipeline)
            layouts = group_layouts(pipeline, args.slots)
            runs: list[dict[str, Any]] = [{"layout": layout, "planner_choice": layout == chosen,
                                           "predicted_step_s": predicted(pipeline, pins(layout)),
                                           "measured_step_s": []} for layout in layouts]
            for round_ in range(args.repeats):
                for index, item in enumerate(runs):
                    out = Path(scratch) / f"{name}-{index}-{round_}"
                    once = run_once(pipeline, args.candidate_steps, out, pins(item["layout"]))
                    item["measured_step_s"].append(once.get("measured_step_s"))
                    print(name, item["layout"], once.get("measured_step_s"), flush=True)
            for item in runs:
                times = [t for t in item["measured_step_s"] if t is not None]
                item["median_s"] = statistics.median(times) if times else None
            timed = [item for item in runs if item["median_s"] is not None]
            fastest = min(timed, key=lambda item: item["median_s"]) if timed else None
            mine = next((item for item in runs if item["planner_choice"]), None)
            compared = per_round(runs)
            result["candidates"][name] = {
                "planner_choice": chosen,
                "runs": runs,
                "fastest": fastest["layout"] if fastest else None,
                "choice_over_fastest": mine["median_s"] / fastest["median_s"]
                if mine and fastest and mine["median_s"] else None,
                **compared,
            }
            ratios = compared.get("choice_over_each_per_round") or {}
            rival = json.loads(max(ratios, key=lambda key: ratios[key])) if ratios else None
            if mine is not None and rival is not None and args.confirm > 0:
                result["candidates"][name]["confirmed"] = confirm(
                    pipeline, mine["layout"], rival, args.confirm, args.candidate_steps, Path(scratch) / f"{name}-confirm")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
