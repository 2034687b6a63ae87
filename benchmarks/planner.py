"""How good and how fast the planner is (a program, not a test: it never asserts).

    python benchmarks/planner.py [--instances 200] [--output benchmarks/results/planner.json]

(a) heuristic (greedy + local search) vs the exhaustive optimum on random small instances:
    the ratio of predicted step times;
(b) the planner vs the two layouts users write by hand, on the shipped inventories:
    "own groups" (every node on its group's devices, the natural option) and "colocated"
    (every node on the first device of the actor's group, when it fits);
(c) planning time of the shipped inventories (h200-8x, cluster-2node) and against cluster
    size up to 1,024 GPUs with pipelines of up to 30 nodes.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

from flowrl.devices.files import load_inventory
from flowrl.devices.groups import pipeline_groups
from flowrl.devices.inventory import Device, Host, Inventory
from flowrl.devices.matching import match_groups
from flowrl.errors import PlacementError
from flowrl.graph import PipelineGraph
from flowrl.planner.compiled import compile_plan
from flowrl.planner.costs import EstimatedCosts
from flowrl.planner.search import SearchOptions, candidates, evaluate, search
from flowrl.planner.simulate import Placement
from flowrl.spec.loader import pipeline_from_dict

ROOT = Path(__file__).resolve().parents[1]
MODELS = ["builtin:small-llama", "Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-1.5B", "Qwen/Qwen2.5-7B"]
GPUS = [("A100-40GB", 40, 312, 1555), ("A100-80GB", 80, 312, 2039), ("H100-80GB", 80, 989, 3350),
        ("V100-32GB", 32, 125, 900), ("L40S", 48, 362, 864)]


def pipeline(rng: random.Random, num_groups: int, extra_scores: int = 0) -> PipelineGraph:
    """A GRPO pipeline with a reward model and a reference; extra score nodes widen it."""
    actor, ref = rng.choice(MODELS[:3]), rng.choice(MODELS[:3])
    groups: dict[str, Any] = {"actor_group": {"type": "gpu", "count": rng.choice([1, 2])}}
    ref_model: dict[str, Any] = {"path": actor, "dtype": "bf16", "offload_to_cpu": rng.random() < 0.5}
    if num_groups > 1:
        groups["ref_group"] = {"type": "gpu", "count": rng.choice([1, 2])}
        ref_model["device_group"] = "ref_group"
    nodes: dict[str, Any] = {
        "rollout": {"role": "generate", "model": "actor", "inputs": ["prompts"],
                    "n": rng.choice([4, 8]), "max_new_tokens": rng.choice([64, 256, 512])},
        "ref": {"role": "reference_logprob", "model": "reference", "inputs": ["rollout"]},
        "adv": {"role": "advantage", "inputs": ["reward"]},
        "train": {"role": "update", "model": "actor", "inputs": ["rollout", "adv", "ref"],
                  "kl_coef": 0.01, "mini_batch_size": 8},
        "reward": {"role": "score", "fn": "digits", "inputs": ["rollout"]},
    }
    for index in range(extra_scores):
        nodes[f"check_{index}"] = {"role": "score", "fn": "digits", "inputs": ["rollout"]}
        nodes["adv"]["inputs"].append(f"check_{index}")
    data = {
        "name": "bench",
        "models": {"actor": {"path": actor, "device_group": "actor_group", "dtype": "bf16",
                             "gradient_checkpointing": True}, "reference": ref_model},
        "devices": groups,
        "nodes": nodes,
        "data": {"source": "builtin:digits", "batch_size": rng.choice([8, 32, 64])},
    }
    del ref
    return pipeline_from_dict(data)


def cluster(num_gpus: int, rng: random.Random | None = None, per_host: int = 8) -> Inventory:
    devices: list[Device] = []
    hosts: list[Host] = []
    for number in range(num_gpus):
        host = f"node-{number // per_host}"
        name, memory, tflops, bandwidth = (rng.choice(GPUS) if rng else GPUS[(number // per_host) % len(GPUS)])
        peers = tuple(f"gpu-{i}" for i in range(number // per_host * per_host,
                                                 min(num_gpus, (number // per_host + 1) * per_host)) if i != number)
        devices.append(Device(f"gpu-{number}", host, number % per_host, "gpu", name, "ampere", memory,
                              family=name.lower(), nvlink_peers=peers, tflops_bf16=tflops,
                              bandwidth_gbs=bandwidth))
    for index in range(max(1, num_gpus // per_host)):
        hosts.append(Host(f"node-{index}", 64, 1024))
        devices.append(Device(f"cpu-{index}", f"node-{index}", 0, "cpu", "cpu", "cpu", 1024, family="cpu"))
    return Inventory(tuple(devices), tuple(hosts), "bench")


def optimum_gap(instances: int) -> dict[str, Any]:
    rng = random.Random(0)
    ratios: list[float] = []
    skipped = 0
    while len(ratios) < instances:
        graph = pipeline(rng, rng.choice([1, 2]), rng.choice([0, 1, 2]))
        devices = cluster(rng.choice([2, 4]), rng, per_host=rng.choice([2, 4]))
        match = match_groups(pipeline_groups(graph.spec), devices)
        if not match.ok:
            skipped += 1
            continue
        costs = EstimatedCosts(graph)
        try:
            exact = search(graph, devices, match, costs, SearchOptions(exact_limit=10**6))
            heuristic = search(graph, devices, match, costs, SearchOptions(exact_limit=0))
        except PlacementError:
            skipped += 1
            continue
        ratios.append(heuristic.best.schedule.iteration_s / exact.best.schedule.iteration_s)
    within = sum(ratio <= 1.05 for ratio in ratios) / len(ratios)
    return {"instances": len(ratios), "skipped": skipped, "median_ratio": statistics.median(ratios),
            "max_ratio": max(ratios), "share_within_5pct": within,
            "share_exact": sum(ratio <= 1 + 1e-9 for ratio in ratios) / len(ratios)}


def versus_hand_layouts() -> list[dict[str, Any]]:
    rows = []
    rng = random.Random(1)
    for name in ("mixed-4gpu", "a100-4x40gb", "h200-8x", "cluster-2node"):
        devices = load_inventory(ROOT / "devices" / f"{name}.yaml")
        graph = pipeline(rng, 2)
        match = match_groups(pipeline_groups(graph.spec), devices)
        if not match.ok:
            rows.append({"inventory": name, "note": "groups do not match"})
            continue
        costs = EstimatedCosts(graph)
        options = candidates(graph, devices, match, SearchOptions())
        planned = search(graph, devices, match, costs)
        own = evaluate(graph, {n: o[0] for n, o in options.items()}, devices, costs, 0.1)
        first = match.assignment["actor_group"][:1]
        together = evaluate(graph, {n: Placement(tuple(first)) for n in options}, devices, costs, 0.1)
        rows.append({
            "inventory": name,
            "planner_s": planned.best.schedule.iteration_s,
            "own_groups_s": own.schedule.iteration_s,
            "colocated_s": together.schedule.iteration_s if together.feasible else None,
            "own_groups_over_planner": own.schedule.iteration_s / planned.best.schedule.iteration_s,
            "colocated_over_planner": (together.schedule.iteration_s / planned.best.schedule.iteration_s
                                       if together.feasible else None),
        })
    return rows


def timed(function: Any, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)


def planning_times() -> list[dict[str, Any]]:
    rows = []
    for name in ("h200-8x", "cluster-2node"):
        devices = load_inventory(ROOT / "devices" / f"{name}.yaml")
        graph = pipeline(random.Random(2), 2, 2)
        rows.append({"case": name, "gpus": len(devices.gpus()), "nodes": len(graph.spec.nodes),
                     "plan_s": timed(lambda: compile_plan(graph, devices))})
    for num_gpus in (8, 64, 256, 1024):
        for extra in (0, 25):  # 5 and 30 nodes
            graph = pipeline(random.Random(3), 2, extra)
            devices = cluster(num_gpus)
            rows.append({"case": "synthetic", "gpus": num_gpus, "nodes": len(graph.spec.nodes),
                         "plan_s": timed(lambda: compile_plan(graph, devices), repeats=1)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=200)
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "planner.json")
    args = parser.parse_args()
    gap = optimum_gap(args.instances)
    print(f"(a) heuristic vs exact on {gap['instances']} instances: median ratio "
          f"{gap['median_ratio']:.4f}, max {gap['max_ratio']:.4f}, within 5 %: {gap['share_within_5pct']:.1%}")
    layouts = versus_hand_layouts()
    print("(b) inventory          planner    own groups  colocated")
    for row in layouts:
        if "note" in row:
            print(f"    {row['inventory']:<18} {row['note']}")
            continue
        colocated = f"{row['colocated_s'] * 1e3:9.1f} ms" if row["colocated_s"] else "  no fit"
        print(f"    {row['inventory']:<18} {row['planner_s'] * 1e3:7.1f} ms {row['own_groups_s'] * 1e3:9.1f} ms {colocated}")
    times = planning_times()
    print("(c) case           gpus  nodes  plan time")
    for row in times:
        print(f"    {row['case']:<14} {row['gpus']:5d}  {row['nodes']:5d}  {row['plan_s'] * 1e3:8.1f} ms")
    from vs_trl import machine  # the benchmarks folder is the script's: on sys.path

    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "machine": {**machine(), "processor": platform.processor() or platform.machine()},
        "optimum_gap": gap, "hand_layouts": layouts, "planning_time": times,
    }, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
