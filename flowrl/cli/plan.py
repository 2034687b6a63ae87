"""``flowrl plan``: where each node runs, memory per device, predicted step time, timeline.

    flowrl plan pipelines/ppo.yaml --devices devices/mixed-4gpu.yaml
    flowrl plan pipelines/ppo.yaml --devices devices/mixed-4gpu.yaml --json
    flowrl plan pipelines/ppo.yaml --devices devices/mixed-4gpu.yaml --output timeline.svg
    flowrl plan pipelines/ppo.yaml data.batch_size=16 --devices devices/mixed-4gpu.yaml

    flowrl plan pipelines/ppo.yaml --scheduler tcp://HOST:8786

Without ``--devices`` the plan is for the workers of the Dask scheduler that ``--scheduler``
(else the pipeline's ``runtime.scheduler_address``) names, as a run that joins it places
them, else for this machine (NVML GPUs and ``runtime.cpu_slots``).
The picture is drawn with matplotlib (``flowrl.ui.plots``), as ``.svg`` or ``.png``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flowrl.cli.devices import inventory_for
from flowrl.devices.groups import pipeline_groups
from flowrl.devices.matching import match_groups
from flowrl.errors import FlowrlError, PlacementError, SpecError
from flowrl.graph import PipelineGraph
from flowrl.planner.compiled import CompiledPlan, compile_plan, layout_words
from flowrl.planner.cost import measure_cpu_rates, resolve_shape
from flowrl.planner.costs import EstimatedCosts
from flowrl.planner.micro_batches import resolve_micro_batches, resolved_json
from flowrl.planner.search import FEWER_CPU_SLOTS_WITHIN
from flowrl.spec.loader import issue_locator, load_pipeline, placed_within

GANTT_WIDTH = 60
"""Characters of the terminal timeline's time axis."""


def plan_command(
    pipeline: Path, devices_file: Path | None, as_json: bool, output: Path | None,
    console: Console, overrides: Sequence[str] = (), scheduler: str | None = None,
) -> CompiledPlan:
    """Plan ``pipeline`` (with ``KEY=VALUE`` overrides) and print it (tables or JSON); write
    the timeline to ``output``."""
    graph = load_pipeline(pipeline, overrides)
    if output is not None and output.suffix.lower() not in (".svg", ".png"):
        raise FlowrlError(f"--output {output}: write the timeline as .svg or .png")
    if output is not None and not output.parent.is_dir():
        raise FlowrlError(f"--output {output}: there is no folder {output.parent}; create it or write the timeline "
                          "elsewhere")
    base_dir = pipeline.resolve().parent  # relative model and data paths are the file's
    unsized = _unsized_models(graph, base_dir)
    if unsized:
        locate = issue_locator(pipeline, overrides)
        raise SpecError([locate(path, message) for path, message in unsized])
    inventory = inventory_for(graph.spec.runtime, devices_file, scheduler, base_dir)
    # Where a run would plan (this machine, or a cluster it joins), this machine's CPUs are
    # measured as `flowrl run` measures them, so that both predict alike.
    cpu_rates = measure_cpu_rates() if devices_file is None else None
    match = match_groups(pipeline_groups(graph.spec), inventory)
    with placed_within(issue_locator(pipeline, overrides)):  # at the groups' lines
        match.raise_if_unsatisfied()
    costs = EstimatedCosts(graph, cpu_rates, base_dir)
    graph, costs, passes = resolve_micro_batches(graph, inventory, match, costs)
    plan = compile_plan(graph, inventory, match=match, costs=costs)
    if as_json:
        console.print(json.dumps({**plan.to_dict(), **resolved_json(passes)}, indent=2), markup=False,
                      highlight=False, soft_wrap=True)
    else:
        print_plan(plan, console)
        if cpu_rates is not None:
            console.print(f"CPU rates measured here: {cpu_rates.flops_per_s / 1e9:.1f} GFLOP/s (fp32 matmul), "
                          f"{cpu_rates.bandwidth_gbs:.1f} GB/s (copy); {cpu_rates.overheads.per_layer_text()}",
                          highlight=False)
        for item in passes:
            console.print(escape(item.line()), highlight=False)
    if output is not None:
        try:
            write_timeline(plan, output)
        except OSError as error:
            raise FlowrlError(f"--output {output}: cannot write the timeline ({error.strerror or error}); write "
                              "it elsewhere") from error
        if not as_json:
            console.print(f"timeline written to {output}", highlight=False)
    return plan


def _unsized_models(graph: PipelineGraph, base_dir: Path) -> list[tuple[str, str]]:
    """(field, why) for each model the planner cannot size (no config.json where the path
    points, not a known shape): a plan needs every model's shape."""
    unsized = []
    for name, model in graph.spec.models.items():
        try:
            resolve_shape(model.path, base_dir)
        except PlacementError as error:
            unsized.append((f"models.{name}.path", str(error)))
    return unsized


def print_plan(plan: CompiledPlan, console: Console) -> None:
    table = Table(title=f"Plan of '{plan.pipeline}'", title_justify="left")
    for column in ("node", "role", "devices", "start", "time", "memory", "why"):
        table.add_column(column, overflow="fold",
                         justify="right" if column in ("start", "time", "memory") else "left")
    for item in plan.nodes:
        where = ", ".join(item.devices) + (" (paged)" if item.offloaded else "")
        table.add_row(item.node, item.role, where, _ms(item.start_s), _ms(item.duration_s),
                      f"{item.memory_gb:.2f} GB", escape(item.reason))
    console.print(table)
    memory = Table(title="Memory per device", title_justify="left")
    for column in ("device", "peak", "of", "used", "models"):
        memory.add_column(column, justify="right" if column in ("peak", "of", "used") else "left")
    for device in plan.devices:
        share = device.peak_gb / device.capacity_gb if device.capacity_gb else 0.0
        colocated = " (time-shared)" if len(device.models) > 1 else ""
        # offloaded models wait in host memory and are copied in for their calls
        paged = sorted({item.model for item in plan.nodes
                        if item.offloaded and item.model is not None and device.device in item.devices})
        memory.add_row(device.label, f"{device.peak_gb:.2f} GB", f"{device.capacity_gb:.1f} GB",
                       f"{share:.1%}", ", ".join([*device.models, *(f"{name} (paged in)" for name in paged)]) + colocated)
    console.print(memory)
    console.print(
        f"predicted step time: {_ms(plan.iteration_s)} ({plan.method} search, "
        f"{plan.num_evaluated} placements simulated)", highlight=False,
    )
    if plan.alternative is not None:
        console.print(alternative_line(plan), highlight=False)
    console.print(f"critical path: {' -> '.join(plan.critical_path)}", highlight=False)
    for line in gantt_lines(plan):
        console.print(line, markup=False, highlight=False)


CLOSE_LAYOUTS = 0.10
"""Layouts whose predicted steps differ by less than this share are called close: the
planner's calibrated CPU step times were within 10-13 % of measured ones
(``benchmarks/results/planner_accuracy_cpu_8ac5e91.json``), and the CPU rates measured at start
vary between runs, so either may be chosen."""


def alternative_line(plan: CompiledPlan) -> str:
    """The layout of the device groups that came next, its step and how far behind."""
    other = plan.alternative
    assert other is not None
    behind = other.iteration_s / plan.iteration_s - 1 if plan.iteration_s > 0 else 0.0
    line = f"next layout: {layout_words(other.shared)}, {_ms(other.iteration_s)} ({behind:+.1%})"
    if behind < 0:  # the plan took fewer CPU slots for a step at most FEWER_CPU_SLOTS_WITHIN slower
        line += f"; faster, on more CPU slots: the plan takes fewer slots within {FEWER_CPU_SLOTS_WITHIN:.0%}"
    elif behind < CLOSE_LAYOUTS:
        line += f"; within {CLOSE_LAYOUTS:.0%}: the rates measured at start may choose either"
    return line


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 10 else f"{seconds:.1f} s"


def gantt_lines(plan: CompiledPlan, width: int = GANTT_WIDTH) -> list[str]:
    """A text timeline: one row per device, each task drawn with its key letter."""
    keys = _keys(plan)
    total = plan.iteration_s or 1.0
    label_width = max((len(device.device) for device in plan.devices), default=6)
    lines = [f"timeline (0 .. {_ms(plan.iteration_s)}, one column = {_ms(total / width)})"]
    for device in plan.devices:
        row = [" "] * width
        for entry in plan.timeline:
            if entry.device != device.device:
                continue
            first = min(width - 1, int(entry.start_s / total * width))
            last = max(first + 1, min(width, round(entry.end_s / total * width)))
            for column in range(first, last):
                row[column] = keys[entry.task]
        lines.append(f"{device.device.rjust(label_width)} |{''.join(row)}|")
    legend = "  ".join(f"{key}={task}" for task, key in keys.items())
    lines.append(f"{' ' * label_width}  {legend}")
    return lines


def _keys(plan: CompiledPlan) -> dict[str, str]:
    keys: dict[str, str] = {}
    for entry in sorted(plan.timeline, key=lambda e: (e.start_s, e.task)):
        if entry.task not in keys:
            letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
            keys[entry.task] = "~" if entry.kind == "sync" else letters[len(keys) % len(letters)]
    return keys


def write_timeline(plan: CompiledPlan, output: Path) -> None:
    """The predicted timeline, drawn by the same module as ``flowrl report``'s measured one:
    a lane per device, a bar per task, the critical path outlined."""
    from flowrl.ui.plots import Bar, timeline

    bars = [Bar(entry.device, entry.task, entry.start_s, entry.end_s, emphasised=entry.task in plan.critical_path)
            for entry in plan.timeline]
    title = f"{plan.pipeline}: predicted step {_ms(plan.iteration_s)}; critical path {' -> '.join(plan.critical_path)}"
    timeline(bars, [device.device for device in plan.devices], title, output,
             {device.device: device.label for device in plan.devices})
