"""``flowrl simulate``: scheduler policies on a simulated cluster, side by side.

    flowrl simulate pipelines/ppo.yaml --devices devices/mixed-4gpu.yaml --steps 200 \\
        --scenario throttle --policy both

Both policies meet the same scenario and the same noise stream (``--seed``), so the
table compares policies, not luck.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from flowrl.cli.devices import inventory_for
from flowrl.planner.cost import measure_cpu_rates
from flowrl.errors import FlowrlError, SpecError
from flowrl.scheduler.events import Decision
from flowrl.scheduler.policy import settings_from_spec
from flowrl.simulator.run import SimulationResult, compare_policies
from flowrl.simulator.scenario import SHIPPED_DIR, Scenario, load_scenario
from flowrl.spec.loader import issue_locator, load_pipeline, placed_within

POLICIES = ("static", "dynamic", "both")


def simulate_command(
    pipeline: Path,
    devices_file: Path | None,
    steps: int,
    scenario: str | None,
    policy: str,
    seed: int | None,
    as_json: bool,
    console: Console,
    overrides: Sequence[str] = (),
) -> dict[str, SimulationResult]:
    """Simulate ``steps`` steps of ``pipeline`` (with ``KEY=VALUE`` overrides) under each
    policy and print the comparison."""
    if policy not in POLICIES:
        raise FlowrlError(f"--policy {policy}: expected one of {', '.join(POLICIES)}")
    if steps < 1:
        raise FlowrlError(f"--steps {steps}: simulate at least 1 step")
    graph = load_pipeline(pipeline, overrides)
    # as flowrl plan: the file; else the pipeline's runtime.scheduler_address's workers; else this machine
    inventory = inventory_for(graph.spec.runtime, devices_file, None, pipeline.resolve().parent)
    devices = (str(devices_file) if devices_file is not None else
               graph.spec.runtime.scheduler_address or "this machine")
    try:
        chosen = load_scenario(scenario or "steady", inventory)
    except SpecError as error:
        # a scenario names the devices and hosts of the cluster it was written for
        missing = any(issue.path.startswith("events.") and issue.path.endswith((".device", ".host"))
                      for issue in error.issues)
        if devices_file is not None or not missing:
            raise
        shipped = SHIPPED_DIR.parent / "devices" / "mixed-4gpu.yaml"
        raise FlowrlError(f"{error}\nthe scenario names devices that {devices} lacks: simulate the cluster it was "
                          f"written for (--devices INVENTORY.yaml; the built-in scenarios: --devices {shipped})") from None
    names = ["static", "dynamic"] if policy == "both" else [policy]
    settings = settings_from_spec(graph.spec.scheduler, restart_s=None)
    # where this machine is simulated, its CPUs are measured as flowrl plan and run measure them
    cpu_rates = measure_cpu_rates() if devices_file is None and not graph.spec.runtime.scheduler_address else None
    with placed_within(issue_locator(pipeline, overrides)):  # unmatched groups at their lines
        results = compare_policies(graph, inventory, chosen, names, steps, seed, settings,
                                   base_dir=pipeline.resolve().parent, cpu_rates=cpu_rates)
    used_seed = chosen.seed if seed is None else seed
    if as_json:
        data = {
            "pipeline": graph.name,
            "devices": devices,
            "steps": steps,
            "seed": used_seed,
            "scenario": {"name": chosen.name, "source": chosen.source, "noise": chosen.noise,
                         "events": chosen.summary()},
            "policies": {name: result.to_dict() for name, result in results.items()},
        }
        console.print(json.dumps(_finite(data), indent=2), markup=False, highlight=False,
                      soft_wrap=True)
    else:
        print_comparison(graph.name, devices, chosen, used_seed, steps, results, console)
    return results


def print_comparison(
    pipeline: str, devices: str, scenario: Scenario, seed: int, steps: int,
    results: dict[str, SimulationResult], console: Console,
) -> None:
    console.print(
        f"simulated '{pipeline}' on {devices}: {steps} steps, scenario {scenario.name} "
        f"({scenario.summary()}), noise sigma {scenario.noise:g}, seed {seed}",
        highlight=False, markup=False,
    )
    table = Table(title="Policies compared", title_justify="left")
    for column in ("policy", "throughput", "step time", "p10 - p90", "utilisation", "moves",
                   "failures"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for name, result in results.items():
        summary = result.summary
        table.add_row(
            name,
            f"{summary.throughput_steps_per_s:.2f} steps/s",
            _ms(summary.mean_step_s),
            f"{_ms(summary.p10_step_s)} - {_ms(summary.p90_step_s)}",
            f"{summary.mean_utilization:.0%}",
            str(summary.num_moves),
            str(summary.num_failures),
        )
    console.print(table)
    first = min((event.step for event in scenario.events if event.step <= steps), default=None)
    if first is not None:
        parts = [f"{name} {_ms(result.mean_step_s_from(first))}" for name, result in results.items()]
        console.print(f"mean step time from step {first} (first event): {', '.join(parts)}",
                      highlight=False, markup=False)
    if "static" in results and "dynamic" in results:
        static = results["static"].summary.throughput_steps_per_s
        dynamic = results["dynamic"].summary.throughput_steps_per_s
        ratio = f"{dynamic / static:.2f}x" if static > 0 else "n/a (static completed no step)"
        console.print(f"dynamic / static throughput: {ratio}", highlight=False, markup=False)
    for name, result in results.items():
        if name == "static":
            continue
        # a lost device forces a re-plan, which finds no placement when nothing fits the rest
        carried = [d for d in result.decisions if (d.accepted or d.forced) and d.plan is not None]
        impossible = [d for d in result.decisions if d.forced and d.plan is None]
        kept = len(result.decisions) - len(carried) - len(impossible)
        found_none = f", {len(impossible)} found no placement on the devices left" if impossible else ""
        console.print(f"decisions ({name}): {len(carried)} re-plans carried out{found_none}, "
                      f"{kept} considered and kept", highlight=False, markup=False)
        for decision in result.decisions:
            for line in decision_lines(decision):
                console.print(f"  {line}", highlight=False, markup=False)
        for note in result.notes:
            console.print(f"note: {note}", highlight=False, markup=False)


def decision_lines(decision: Decision) -> list[str]:
    """``step 61: moving actor: gpu-3, gpu-0 -> gpu-1, gpu-0 (gpu-3 at 50% speed, ...)``."""
    if not decision.moves:
        return [f"step {decision.step}: {decision.reason} ({', '.join(decision.triggers)})"]
    if not decision.accepted:
        subjects = ", ".join(move.subject for move in decision.moves)
        return [f"step {decision.step}: {decision.reason} (would move {subjects}; "
                f"predicted gain {decision.gain_share:.0%}/step)"]
    verb = "moving"
    lines = []
    for move in decision.moves:
        gain = f"predicted gain {decision.gain_share:.0%}/step" if not decision.forced \
            else f"predicted step {_ms(decision.predicted_after_s)}"
        lines.append(
            f"step {decision.step}: {verb} {move.subject}: {', '.join(move.from_devices)} -> "
            f"{', '.join(move.to_devices)} ({move.why}, {gain}, move cost {_seconds(move.cost_s)})"
        )
    return lines


def _ms(seconds: float) -> str:
    if math.isnan(seconds):
        return "-"
    return f"{seconds * 1e3:.2f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _seconds(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 0.1 else f"{seconds * 1e3:.0f} ms"


def _finite(value: Any) -> Any:
    """JSON has no infinity or NaN: they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value
