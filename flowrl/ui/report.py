"""``flowrl report OUTPUT_DIR``: a run's output folder as one HTML page with pictures.

Read from the folder (nothing is re-run): ``metrics.jsonl`` (curves), ``profile.jsonl``
(every node call: when it arrived on its worker, how long it waited and computed; device
samples), ``events.jsonl`` (faults and moves, marked on the curves) and ``plan-0.json``
(the planner's predicted node times). Written to ``OUTPUT_DIR/report/`` (or ``--output``):

- ``index.html``: the page, every picture inside it (base64 PNG), so the one file can be sent
  on its own;
- ``curves.png`` (reward, KL, entropy, response length, ...), ``eval.png`` (held-out scores,
  when the run evaluated), ``timeline.png`` (the measured timeline of one step: a lane per
  worker, a bar per node call, its wait for inputs in grey), ``nodes.png`` (predicted and
  measured seconds per node), ``devices.png`` (utilisation and memory of each device over the
  run), with faults, moves and resumes as dashed lines;
- ``trace.json``: every node call of every step in Chrome's trace format (``chrome://tracing``,
  https://ui.perfetto.dev): one thread per worker, a slice per wait and per computation.
"""

from __future__ import annotations

import base64
import html
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowrl.records import slowest_part_medians
from flowrl.errors import FlowrlError
from flowrl.ui.plots import Bar, Mark, compared_bars, curves, timeline

CURVES = (
    ("critic/score/mean", "reward (score mean)"),
    ("actor/kl_loss", "KL to the reference"),
    ("actor/reward_kl_penalty", "KL in the reward"),
    ("actor/entropy", "policy entropy"),
    ("response_length/mean", "response length"),
    ("actor/pg_loss", "policy loss"),
    ("critic/vf_loss", "value loss"),
    ("timing_s/step", "seconds per step"),
)
"""Metrics drawn as curves, when the run has them."""


@dataclass
class RunFiles:
    """What a run folder holds, read once."""

    folder: Path
    metrics: list[dict[str, Any]] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    plan: dict[str, Any] = field(default_factory=dict)
    elapsed: dict[int, float] = field(default_factory=dict)
    """Seconds from the start of the run to the end of each step."""

    @classmethod
    def read(cls, folder: Path) -> "RunFiles":
        if not folder.is_dir():
            raise FlowrlError(f"{folder}: no such folder; give the output folder of a run (trainer.output_dir)")
        if not (folder / "metrics.jsonl").is_file():
            raise FlowrlError(f"{folder}: no metrics.jsonl here; give the output folder of a run "
                              "(trainer.output_dir)")
        files = cls(folder)
        files.metrics = _lines(folder / "metrics.jsonl")
        files.elapsed = {line["step"]: float(line.get("elapsed_s", 0.0)) for line in files.metrics}
        for line in _lines(folder / "profile.jsonl"):
            if line.get("type") == "node":
                files.calls.append(line)
            elif line.get("type") == "device":
                files.samples.append(line)
        files.events = _lines(folder / "events.jsonl")
        plan = folder / "plan-0.json"
        files.plan = json.loads(plan.read_text()) if plan.is_file() else {}
        if not any(line["step"] > 0 for line in files.metrics):
            raise FlowrlError(f"{folder}: the run has no finished step yet; nothing to report")
        return files

    def elapsed_of(self, step: int) -> float:
        return self.elapsed.get(step, 0.0)

    def marks(self, on_time: bool) -> tuple[Mark, ...]:
        """Faults, moves and resumes (at the checkpoint's step), at their step (or its elapsed
        seconds)."""
        found = []
        for event in self.events:
            if event.get("kind") in ("fault", "move", "resume") and event.get("step") is not None:
                x = self.elapsed_of(event["step"]) if on_time else float(event["step"])
                found.append(Mark(x, event["kind"], event.get("message", "")))
        return tuple(found)


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    lines = []
    for text in path.read_text().splitlines():
        try:
            lines.append(json.loads(text))
        except ValueError:
            continue  # a line cut short by a killed process
    return lines


def chosen_step(files: RunFiles, step: int | None) -> int | None:
    """``step`` if the run has its node calls, else the step whose duration is the median
    of the run's (a typical step, not the first, which compiles and warms up); None when no
    call was timed (a run of an older version), unless ``step`` was asked for."""
    steps = sorted({call["step"] for call in files.calls if call["step"] > 0 and call.get("arrived_at")})
    if not steps and step is None:
        return None
    if not steps:
        raise FlowrlError(f"--step {step}: profile.jsonl has no timed node calls (a run of an older version?)")
    if step is not None:
        if step not in steps:
            raise FlowrlError(f"--step {step}: the run has node calls for steps {steps[0]}..{steps[-1]}")
        return step
    durations = {line["step"]: line.get("timing_s/step", 0.0) for line in files.metrics if line["step"] in steps}
    ordered = sorted(steps, key=lambda s: (durations.get(s, 0.0), s))
    return ordered[len(ordered) // 2]


def step_bars(files: RunFiles, step: int) -> tuple[list[Bar], list[str]]:
    """The measured timeline of ``step``: per call, its wait then its computation, from the
    first call's arrival."""
    calls = [call for call in files.calls if call["step"] == step and call.get("arrived_at")]
    start = min(call["arrived_at"] for call in calls)
    bars = []
    for call in calls:
        arrived = call["arrived_at"] - start
        wait = call["wait_s"]
        if wait > 0:
            bars.append(Bar(call["device"], call["node"], arrived, arrived + wait, waiting=True))
        bars.append(Bar(call["device"], call["node"], arrived + wait, arrived + wait + call["compute_s"]))
    lanes = sorted({bar.lane for bar in bars})
    return bars, lanes


def chrome_trace(files: RunFiles) -> dict[str, Any]:
    """Every timed node call as Chrome trace events (microseconds from the run's first call)."""
    calls = [call for call in files.calls if call.get("arrived_at")]
    if not calls:
        return {"traceEvents": []}
    start = min(call["arrived_at"] for call in calls)
    lanes = {lane: index for index, lane in enumerate(sorted({call["device"] for call in calls}))}
    events: list[dict[str, Any]] = [
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": lane}} for lane, tid in lanes.items()
    ]
    for call in calls:
        arrived = (call["arrived_at"] - start) * 1e6
        args = {"step": call["step"], "tokens_in": call["tokens_in"], "tokens_out": call["tokens_out"]}
        if call["wait_s"] > 0:
            events.append({"name": f"wait: {call['node']}", "cat": "wait", "ph": "X", "pid": 1,
                           "tid": lanes[call["device"]], "ts": arrived, "dur": call["wait_s"] * 1e6, "args": args})
        events.append({"name": call["node"], "cat": call["role"], "ph": "X", "pid": 1, "tid": lanes[call["device"]],
                       "ts": arrived + call["wait_s"] * 1e6, "dur": call["compute_s"] * 1e6, "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def node_seconds(files: RunFiles) -> tuple[list[str], list[float], list[float]]:
    """Per node of the plan: predicted seconds (plan-0.json) and the median measured compute
    seconds (the slowest part, for a split node), both in ms."""
    predicted = {node["node"]: node["end_s"] - node["start_s"] for node in files.plan.get("nodes", [])}
    measured = slowest_part_medians((call["node"], call["step"], call["compute_s"]) for call in files.calls
                                    if call["step"] > 0 and call["node"] in predicted)
    names = [name for name in predicted if name in measured]
    return names, [predicted[name] * 1e3 for name in names], [measured[name] * 1e3 for name in names]


def build_report(folder: Path, output: Path | None = None, step: int | None = None) -> Path:
    """Write the report of the run in ``folder``; returns the HTML page's path."""
    files = RunFiles.read(folder)
    out = output or folder / "report"
    try:
        return _write_report(files, folder, out, step)
    except OSError as error:
        raise FlowrlError(f"cannot write the report in {out}: {error.strerror or error}; write it elsewhere "
                          "(--output DIR)") from error


def _write_report(files: RunFiles, folder: Path, out: Path, step: int | None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    pictures: list[tuple[str, str, str]] = []  # (file, title, caption)
    name = files.plan.get("pipeline") or folder.name
    trained = [line for line in files.metrics if line["step"] > 0]

    series = {}
    for key, title in CURVES:
        points = [(line["step"], line[key]) for line in trained if line.get(key) is not None]
        if points:
            series[title] = ([float(x) for x, _ in points], [float(y) for _, y in points])
    curves(series, out / "curves.png", files.marks(on_time=False))
    pictures.append(("curves.png", "Training curves", "per step; dashed: faults (red), moves (purple) and resumes (green)"))

    evaluated = sorted({key for line in files.metrics for key in line if key.startswith("val/") and key.endswith("/mean")})
    if evaluated:
        eval_series = {key: ([float(line["step"]) for line in files.metrics if line.get(key) is not None],
                             [float(line[key]) for line in files.metrics if line.get(key) is not None])
                       for key in evaluated}
        curves(eval_series, out / "eval.png")
        pictures.append(("eval.png", "Evaluation", "held-out prompts, at step 0 and every eval.every_steps"))

    shown = chosen_step(files, step)
    if shown is not None:
        bars, lanes = step_bars(files, shown)
        took = max(bar.end_s for bar in bars)
        timeline(bars, lanes, f"{name}: step {shown} as measured, {took * 1e3:.0f} ms from the first call",
                 out / "timeline.png")
        pictures.append(("timeline.png", f"Step {shown}, measured",
                         "a lane per worker; each node call's wait for its inputs (grey), then its computation"))

    names, predicted, measured = node_seconds(files)
    if names:
        compared_bars(names, predicted, measured, ("predicted (plan-0.json)", "measured (median)"),
                      "Seconds per node", out / "nodes.png")
        pictures.append(("nodes.png", "Predicted and measured", "the planner's first plan against the run"))

    devices = sorted({sample["device"] for sample in files.samples})
    if devices:
        device_series = {}
        for device in devices:
            rows = [sample for sample in files.samples if sample["device"] == device and sample["step"] > 0]
            xs = [files.elapsed_of(sample["step"]) for sample in rows]
            device_series[f"{device} utilisation"] = (xs, [float(sample["utilization"]) for sample in rows])
            device_series[f"{device} memory (GB)"] = (xs, [float(sample["memory_gb"]) for sample in rows])
        curves(device_series, out / "devices.png", files.marks(on_time=True), x_label="seconds")
        pictures.append(("devices.png", "Devices", "per worker slot over the run (a resumed run's clock goes on from "
                         "its checkpoint); dashed: faults, moves and resumes"))

    (out / "trace.json").write_text(json.dumps(chrome_trace(files)))
    page = out / "index.html"
    page.write_text(_html(name, files, pictures, out))
    return page


def _html(name: str, files: RunFiles, pictures: list[tuple[str, str, str]], out: Path) -> str:
    last = [line for line in files.metrics if line["step"] > 0][-1]
    facts = [("steps", str(last["step"])), ("elapsed", f"{last.get('elapsed_s', 0.0):.1f} s"),
             ("faults", str(sum(1 for e in files.events if e.get("kind") == "fault"))),
             ("moves", str(sum(1 for e in files.events if e.get("kind") == "move")))]
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in facts)
    figures = []
    for file, title, caption in pictures:
        data = base64.b64encode((out / file).read_bytes()).decode()
        figures.append(f'<figure><h2>{html.escape(title)}</h2><img alt="{html.escape(title)}" '
                       f'src="data:image/png;base64,{data}"><figcaption>{html.escape(caption)} '
                       f'({html.escape(file)})</figcaption></figure>')
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(name)}: flowrl report</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}}
img{{max-width:100%}} th{{text-align:left;padding-right:1em}} figure{{margin:2em 0}}
figcaption{{color:#666;font-size:90%}}</style></head>
<body><h1>{html.escape(name)}</h1><p>{html.escape(str(files.folder))}</p><table>{rows}</table>
{''.join(figures)}
<p>The measured timeline of every step: <code>trace.json</code> (open it in https://ui.perfetto.dev).</p>
</body></html>
"""
