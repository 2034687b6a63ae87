"""Chaos: workers killed and stopped at random moments while a pipeline trains.

    python benchmarks/chaos.py --steps 300 --faults 20 --output benchmarks/results/chaos.json

For each pipeline (the default ``grpo_tiny`` and ``grpo_data_parallel``), a child process
runs it for ``--steps`` steps on its local Dask cluster while a seeded schedule, spread over
the run, does to the workers that serve device slots:

- ``kill``: one SIGKILL, a random 0-150 ms into a step;
- ``burst``: 2-3 SIGKILLs 50-400 ms apart (inside the recovery of the first; the same slot
  may be hit again, as an OOM loop kills a replacement);
- ``checkpoint``: a SIGKILL a few milliseconds after a checkpoint step ends, while the
  checkpoint is written;
- ``hang``: SIGSTOP, which only ``runtime.node_timeout_s`` notices.

The child runs with ``max_recoveries`` high enough for the schedule. A last run of the
default pipeline allows fewer (``--stop-run``), to show the stop with its message.

Per run: outcome (completed / stopped with message / hung: no end within ``--max-minutes``
/ crashed: a traceback), steps committed, steps run again, gaps and duplicates in
``metrics.jsonl``, and per fault the time from noticing it to running again (``lost_s``) and
that plus the steps run again at the median step time. Writes JSON; never asserts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PIPELINES = ("grpo_tiny", "grpo_data_parallel")
KINDS = ("kill", "kill", "burst", "checkpoint", "hang")


def schedule(steps: int, faults: int, checkpoint_every: int, seed: int) -> dict[int, str]:
    """Step -> action, spread evenly (one action per segment, at a random step in it), until
    at least ``faults`` faults are planned (a burst counts 2.5 on average)."""
    rng = random.Random(seed)
    actions: list[str] = []
    planned = 0.0
    while planned < faults:
        kind = KINDS[len(actions) % len(KINDS)]
        actions.append(kind)
        planned += 2.5 if kind == "burst" else 1
    segment = max(2, (steps - 10) // len(actions))
    plan: dict[int, str] = {}
    for index, kind in enumerate(actions):
        low, high = 3 + index * segment, 3 + (index + 1) * segment - 2
        step = rng.randint(low, max(low, high))
        if kind == "checkpoint":
            step = max(checkpoint_every, (step // checkpoint_every) * checkpoint_every)
            while step in plan or step >= steps:
                step -= checkpoint_every
        while step in plan:
            step += 1
        plan[step] = kind
    return plan


class Chaos:
    """An observer of the run: after each planned step, does its action from a timer thread."""

    def __init__(self, plan: dict[int, str], seed: int, output: Path) -> None:
        self.plan = plan
        self.output = output
        self.rng = random.Random(seed + 1)
        self.cluster: Any = None
        self.actions: list[dict[str, Any]] = []
        self.stopped: list[int] = []

    def on_step(self, record: Any) -> None:
        kind = self.plan.pop(record.step, None)  # once: a step run again after a fault is not hit again
        if kind is None or record.step >= record.num_steps:
            return
        delay = 0.003 if kind == "checkpoint" else self.rng.uniform(0.0, 0.15)
        threading.Timer(delay, self._act, args=(kind, record.step)).start()

    def on_event(self, event: Any) -> None:
        pass

    def _act(self, kind: str, step: int) -> None:
        entry: dict[str, Any] = {"after_step": step, "kind": kind, "time": time.time(), "signals": []}
        self.actions.append(entry)
        count = self.rng.choice((2, 3)) if kind == "burst" else 1
        for number in range(count):
            if number:
                time.sleep(self.rng.uniform(0.05, 0.4))
            self._signal(entry, signal.SIGSTOP if kind == "hang" else signal.SIGKILL)

    def _signal(self, entry: dict[str, Any], which: signal.Signals) -> None:
        try:
            used = self.slots_in_use()
            slots = [slot for slot in self.cluster.slots if not used or slot.name in used]
            registered = self.cluster.addresses()
            slot = self.rng.choice([slot for slot in slots if slot.name in registered])
            address = registered[slot.name]
            pid = self.cluster.client.run(os.getpid, workers=[address])[address]
            os.kill(pid, which)
            if which == signal.SIGSTOP:
                self.stopped.append(pid)
            entry["signals"].append({"slot": slot.name, "worker": str(slot.worker), "pid": pid,
                                     "signal": which.name, "time": time.time()})
        except Exception as error:  # noqa: BLE001 - a worker may be gone already: note it
            entry["signals"].append({"error": f"{type(error).__name__}: {error}", "time": time.time()})

    def slots_in_use(self) -> set[str]:
        """The slots the run's newest plan file places nodes on (a signal to an idle worker
        tests nothing)."""
        plans = sorted(self.output.glob("plan-*.json"), key=lambda path: int(path.stem.split("-")[1]))
        if not plans:
            return set()
        runtime = json.loads(plans[-1].read_text()).get("runtime", {})
        used = set(runtime.get("node_slots", {}).values())
        for slots in runtime.get("node_shards", {}).values():
            used.update(slots)
        return used

    def release(self) -> None:
        for pid in self.stopped:  # a stopped process that nobody restarted must not linger
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def child(args: argparse.Namespace) -> None:
    from flowrl.api.run import run
    from flowrl.errors import RunStopped
    from flowrl.runtime.cluster import Cluster
    from flowrl.spec.loader import load_pipeline

    work = Path(args.work)
    plan = schedule(args.steps, args.faults, args.checkpoint_every, args.seed)
    chaos = Chaos(dict(plan), args.seed, work / "out")
    start_local = Cluster.start_local.__func__  # type: ignore[attr-defined]

    def capture(cls: type, *a: Any, **k: Any) -> Any:
        chaos.cluster = start_local(cls, *a, **k)
        return chaos.cluster

    Cluster.start_local = classmethod(capture)  # type: ignore[method-assign, assignment]
    overrides = [
        f"trainer.steps={args.steps}", f"trainer.checkpoint_every={args.checkpoint_every}", "trainer.keep_checkpoints=2",
        f"runtime.max_recoveries={args.max_recoveries}", "runtime.recovery_window_steps=50",
        f"runtime.node_timeout_s={args.node_timeout_s}", "runtime.recovery_timeout_s=30",
        *([f"runtime.standby_workers={args.standby}"] if args.standby is not None else []),
    ]
    graph = load_pipeline(REPO / "pipelines" / f"{args.child}.yaml", overrides)
    outcome, message = "completed", ""
    started = time.perf_counter()
    try:
        run(graph, output_dir=work / "out", observer=chaos, base_dir=REPO / "pipelines")
    except RunStopped as stopped:
        outcome, message = "stopped with message", str(stopped)
    finally:
        chaos.release()
    report = {"outcome": outcome, "message": message, "wall_s": time.perf_counter() - started,
              "plan": {str(step): kind for step, kind in sorted(plan.items())}, "actions": chaos.actions}
    (work / "child.json").write_text(json.dumps(report, indent=2) + "\n")


def analyse(work: Path) -> dict[str, Any]:
    output = work / "out"
    lines = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()] \
        if (output / "metrics.jsonl").exists() else []
    steps = [line["step"] for line in lines if line["step"] > 0]
    events = [json.loads(line) for line in (output / "events.jsonl").read_text().splitlines()] \
        if (output / "events.jsonl").exists() else []
    step_times = [line["timing_s/step"] for line in lines if "timing_s/step" in line]
    median_step = statistics.median(step_times) if step_times else 0.0
    recoveries = [event["data"] | {"step": event["step"]} for event in events if event["kind"] == "recovered"]
    for item in recoveries:
        item["steps_run_again"] = item["step"] - item["back_to"]
        item["lost_with_redo_s"] = item["lost_s"] + item["steps_run_again"] * median_step
    single = [item for item in recoveries if item["faults"] == 1]

    def spread(values: list[float]) -> dict[str, float] | None:
        return {"median": statistics.median(values), "max": max(values), "n": len(values)} if values else None

    return {
        "steps_committed": len(steps),
        "steps_run_again": sum(item["steps_run_again"] for item in recoveries),
        "metrics_gaps": sorted(set(range(1, max(steps, default=0) + 1)) - set(steps)),
        "metrics_duplicates": len(steps) - len(set(steps)),
        "faults_seen": sum(1 for event in events if event["kind"] == "fault"),
        "recoveries": len(recoveries),
        "median_step_s": median_step,
        "lost_s_single_fault": spread([item["lost_s"] for item in single]),
        "lost_with_redo_s_single_fault": spread([item["lost_with_redo_s"] for item in single]),
        "lost_s_all": spread([item["lost_s"] for item in recoveries]),
        "recovery_details": recoveries,
        "stop_events": [event["message"] for event in events if event["kind"] == "stopped"],
        "fault_events": [{"step": event["step"], "time": event["time"], "message": event["message"]}
                         for event in events if event["kind"] == "fault"],
    }


def parent(args: argparse.Namespace) -> None:
    from vs_trl import machine  # the benchmarks folder is the script's: on sys.path

    measured = machine()
    if args.commit:
        measured["flowrl_commit"] = args.commit
    runs = [(name, args.max_recoveries, args.faults) for name in args.pipelines.split(",")]
    if args.stop_run:
        runs.append(("grpo_tiny", 1, 6))
    results = []
    for name, max_recoveries, faults in runs:
        work = Path(tempfile.mkdtemp(prefix=f"flowrl-chaos-{name}-"))
        command = [sys.executable, __file__, "--child", name, "--work", str(work), "--steps", str(args.steps),
                   "--faults", str(faults), "--seed", str(args.seed), "--max-recoveries", str(max_recoveries),
                   "--checkpoint-every", str(args.checkpoint_every), "--node-timeout-s", str(args.node_timeout_s),
                   *(["--standby", str(args.standby)] if args.standby is not None else [])]
        started = time.perf_counter()
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.max_minutes * 60, cwd=REPO)
            code, stderr = done.returncode, done.stderr
            hung = False
        except subprocess.TimeoutExpired as expired:
            code, stderr, hung = None, (expired.stderr or b"").decode() if isinstance(expired.stderr, bytes) else "", True
            subprocess.run(["pkill", "-9", "-f", str(work)], check=False)
        child_report = json.loads((work / "child.json").read_text()) if (work / "child.json").exists() else {}
        outcome = "hung" if hung else child_report.get("outcome", "crashed")
        result = {
            "pipeline": name, "max_recoveries": max_recoveries, "faults_planned": faults, "outcome": outcome,
            "exit_code": code, "traceback": "Traceback" in stderr, "stderr_tail": stderr[-2000:] if code else "",
            "message": child_report.get("message", ""), "wall_s": time.perf_counter() - started,
            "actions": child_report.get("actions", []),
            "signals_sent": sum(len([s for s in a["signals"] if "signal" in s]) for a in child_report.get("actions", [])),
            **analyse(work),
        }
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k not in ("actions", "recovery_details")}, indent=2),
              flush=True)
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {**measured, "note": f"{os.cpu_count()} cores, no GPU" if not args.gpu_note else args.gpu_note},
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in ("child", "work")},
        "runs": results,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written: {args.output}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pipelines", default=",".join(PIPELINES))
    parser.add_argument("--max-recoveries", type=int, default=12)
    parser.add_argument("--checkpoint-every", type=int, default=25)
    parser.add_argument("--node-timeout-s", type=float, default=8.0)
    parser.add_argument("--standby", type=int, default=None, help="runtime.standby_workers (default: the pipeline's)")
    parser.add_argument("--stop-run", action="store_true", help="one more run allowed fewer recoveries than it meets")
    parser.add_argument("--max-minutes", type=float, default=12.0, help="per run; past it the run counts as hung")
    parser.add_argument("--gpu-note", default="")
    parser.add_argument("--commit", default="", help="the commit measured, where the copy has no .git (device machines)")
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks" / "results" / "chaos.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()
