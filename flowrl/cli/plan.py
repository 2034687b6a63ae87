"""``flowrl plan``: where each node runs, memory per device, predicted step time, timeline.

    flowrl plan pipelines/ppo.yaml --devices devices/mixed-4gpu.yaml
    flowrl plan pipelines/ppo.yaml --devices devices/mixed-4gpu.yaml --json
    flowrl plan pipelines/ppo.yaml --devices devices/mixed-4gpu.yaml --output timeline.svg
    flowrl plan pipelines/ppo.yaml data.batch_size=16 --devices devices/mixed-4gpu.yaml

Without ``--devices`` the plan is for this machine (NVML GPUs and ``runtime.cpu_slots``).
The SVG is written by hand so no plotting library is needed; ``.png`` needs matplotlib.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from xml.sax.saxutils import escape as xml_escape

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flowrl.devices.files import load_inventory
from flowrl.devices.inventory import detect_local
from flowrl.errors import FlowrlError
from flowrl.planner.compiled import CompiledPlan, compile_plan
from flowrl.spec.loader import load_pipeline

GANTT_WIDTH = 60
"""Characters of the terminal timeline's time axis."""
_PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1",
            "#ff9da7", "#9c755f", "#bab0ac"]


def plan_command(
    pipeline: Path, devices_file: Path | None, as_json: bool, output: Path | None,
    console: Console, overrides: Sequence[str] = (),
) -> CompiledPlan:
    """Plan ``pipeline`` (with ``KEY=VALUE`` overrides) and print it (tables or JSON); write
    the timeline to ``output``."""
    graph = load_pipeline(pipeline, overrides)
    if output is not None and output.suffix.lower() not in (".svg", ".png"):
        raise FlowrlError(f"--output {output}: write the timeline as .svg (or .png with matplotlib)")
    if devices_file is not None:
        inventory = load_inventory(devices_file)
    else:
        inventory = detect_local(num_cpu_slots=graph.spec.runtime.cpu_slots)
    plan = compile_plan(graph, inventory, base_dir=pipeline.resolve().parent)
    if as_json:
        console.print(json.dumps(plan.to_dict(), indent=2), markup=False, highlight=False,
                      soft_wrap=True)
    else:
        print_plan(plan, console)
    if output is not None:
        write_timeline(plan, output)
        if not as_json:
            console.print(f"timeline written to {output}", highlight=False)
    return plan


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
        memory.add_row(device.label, f"{device.peak_gb:.2f} GB", f"{device.capacity_gb:g} GB",
                       f"{share:.1%}", ", ".join(device.models) + colocated)
    console.print(memory)
    console.print(
        f"predicted step time: {_ms(plan.iteration_s)} ({plan.method} search, "
        f"{plan.num_evaluated} placements simulated)", highlight=False,
    )
    console.print(f"critical path: {' -> '.join(plan.critical_path)}", highlight=False)
    for line in gantt_lines(plan):
        console.print(line, markup=False, highlight=False)


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
    if output.suffix.lower() == ".png":
        _write_png(plan, output)
    else:
        output.write_text(timeline_svg(plan))


def timeline_svg(plan: CompiledPlan) -> str:
    """The timeline as an SVG document: one lane per device, one bar per task."""
    lane, left, right, top, axis = 34, 150, 30, 40, 30
    chart = 720
    devices = [device.device for device in plan.devices]
    labels = {device.device: device.label for device in plan.devices}
    height = top + lane * len(devices) + axis + 10
    total = plan.iteration_s or 1.0
    tasks = list(dict.fromkeys(entry.task for entry in plan.timeline))
    colors = {task: _PALETTE[i % len(_PALETTE)] for i, task in enumerate(tasks)}
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + chart + right}" '
        f'height="{height}" font-family="sans-serif" font-size="12">',
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="{left}" y="20" font-size="14">{xml_escape(plan.pipeline)}: predicted step '
        f'{_ms(plan.iteration_s)}; critical path {xml_escape(" → ".join(plan.critical_path))}</text>',
    ]
    for row, device in enumerate(devices):
        y = top + row * lane
        parts.append(f'<text x="{left - 8}" y="{y + lane / 2 + 4}" text-anchor="end">'
                     f'{xml_escape(labels[device])}</text>')
        parts.append(f'<line x1="{left}" y1="{y + lane}" x2="{left + chart}" y2="{y + lane}" '
                     'stroke="#ddd"/>')
        for entry in plan.timeline:
            if entry.device != device:
                continue
            x = left + entry.start_s / total * chart
            bar = max(1.0, (entry.end_s - entry.start_s) / total * chart)
            critical = entry.task in plan.critical_path
            stroke = ' stroke="black" stroke-width="2"' if critical else ""
            parts.append(f'<rect x="{x:.1f}" y="{y + 4}" width="{bar:.1f}" height="{lane - 8}" '
                         f'fill="{colors[entry.task]}"{stroke}><title>{xml_escape(entry.task)}: '
                         f'{_ms(entry.start_s)} .. {_ms(entry.end_s)}</title></rect>')
            if bar > 7 * len(entry.task):
                parts.append(f'<text x="{x + 4:.1f}" y="{y + lane / 2 + 4}" fill="white">'
                             f'{xml_escape(entry.task)}</text>')
    base = top + lane * len(devices)
    for tick in range(6):
        x = left + tick / 5 * chart
        parts.append(f'<line x1="{x:.1f}" y1="{base}" x2="{x:.1f}" y2="{base + 5}" stroke="black"/>')
        parts.append(f'<text x="{x:.1f}" y="{base + 18}" text-anchor="middle">'
                     f'{_ms(total * tick / 5)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _write_png(plan: CompiledPlan, output: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError:
        raise FlowrlError(
            f"--output {output}: writing .png needs matplotlib, which is not installed; "
            "write the timeline as .svg instead (--output timeline.svg)"
        ) from None
    devices = [device.device for device in plan.devices]
    figure, axes = pyplot.subplots(figsize=(10, 0.5 * len(devices) + 1.5))
    for row, device in enumerate(devices):
        for entry in plan.timeline:
            if entry.device == device:
                axes.barh(row, (entry.end_s - entry.start_s) * 1e3, left=entry.start_s * 1e3)
                axes.text(entry.start_s * 1e3, row, entry.task, va="center", fontsize=7)
    axes.set_yticks(range(len(devices)), [device.label for device in plan.devices])
    axes.set_xlabel("ms")
    axes.set_title(f"{plan.pipeline}: predicted step {_ms(plan.iteration_s)}")
    figure.tight_layout()
    figure.savefig(output)
    pyplot.close(figure)
