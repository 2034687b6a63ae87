"""Time group matching on large inventories (a program, not a test: it never asserts).

    python benchmarks/matching.py

Builds inventories of 1,000 GPUs (125 hosts x 8) in a few shapes, matches a PPO-like set
of groups against each several times, prints a table and writes
benchmarks/results/matching.json. Devices of one type fold into one flow-network node, so
the time grows with the number of distinct device types, not of devices; the
"all distinct" case (every card a different memory size) is the worst case.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from flowrl.devices.inventory import Device, Inventory
from flowrl.devices.matching import match_groups
from flowrl.spec.schema import DeviceGroupSpec

_KINDS = [
    ("A100-80GB", "ampere", 80.0, "a100"),
    ("H100-80GB", "hopper", 80.0, "h100"),
    ("L40S", "ada", 48.0, "l40s"),
    ("A100-40GB", "ampere", 40.0, "a100"),
]


def build(num_devices: int, distinct: bool) -> Inventory:
    devices = []
    for number in range(num_devices):
        name, arch, memory_gb, family = _KINDS[(number // 8) % len(_KINDS)]
        if distinct:  # every card its own class: the flow network has one node per card
            memory_gb += number / 100
        devices.append(
            Device(f"gpu-{number}", f"node-{number // 8}", number % 8, "gpu", name, arch,
                   memory_gb, family=family)
        )
    return Inventory(tuple(devices), ())


def groups(num_groups: int) -> dict[str, DeviceGroupSpec]:
    shapes = [
        DeviceGroupSpec(
            type="gpu", count=64, min_memory_gb=80, preferred_arch=["hopper", "ampere"]
        ),
        DeviceGroupSpec(type="gpu", count=32, min_memory_gb=40),
        DeviceGroupSpec(type="gpu", count=16, arch=["ampere", "ada"]),
        DeviceGroupSpec(type="gpu", count=8),
    ]
    return {f"group_{i}": shapes[i % len(shapes)] for i in range(num_groups)}


def time_case(
    inventory: Inventory, group_specs: dict[str, DeviceGroupSpec], repeats: int
) -> dict[str, float | bool]:
    times = []
    ok = True
    for _ in range(repeats):
        start = time.perf_counter()
        match = match_groups(group_specs, inventory)
        times.append(time.perf_counter() - start)
        ok = ok and match.ok
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "all_matched": ok,
    }


def main() -> None:
    cases = [
        ("1000 gpus, 4 types, 4 groups", build(1000, False), groups(4), 5),
        ("1000 gpus, 4 types, 16 groups", build(1000, False), groups(16), 5),
        ("1000 gpus, all distinct, 4 groups", build(1000, True), groups(4), 3),
        ("1000 gpus, all distinct, 16 groups", build(1000, True), groups(16), 3),
    ]
    rows = []
    print(f"{'case':40} {'median':>10} {'min':>10} {'max':>10}  matched")
    for label, inventory, group_specs, repeats in cases:
        result = time_case(inventory, group_specs, repeats)
        rows.append({"case": label, "repeats": repeats, **result})
        print(f"{label:40} {result['median_s']:>9.3f}s {result['min_s']:>9.3f}s "
              f"{result['max_s']:>9.3f}s  {result['all_matched']}")
    out = Path(__file__).parent / "results" / "matching.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    from vs_trl import machine  # the benchmarks folder is the script's: on sys.path

    out.write_text(json.dumps({"machine": machine(), "cases": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
