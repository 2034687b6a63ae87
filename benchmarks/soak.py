"""Soak: the default pipeline for many steps with a worker process killed every N steps.

    python benchmarks/soak.py --steps 200 --kill-every 50 --output benchmarks/results/soak.json

Runs ``pipelines/grpo_tiny.yaml`` on its local Dask cluster. Right after steps N, 2N, ... a
timer kills one Dask worker process with SIGKILL a few milliseconds into the next step (the
workers take turns), so the kill lands mid-iteration. The run has to notice, get the worker's
replacement, rebuild its roles from the newest snapshot and go on. Reported: steps completed,
faults seen and recovered, steps run again, seconds lost per fault (from ``events.jsonl``),
whether ``metrics.jsonl`` has every step exactly once, the reward of the first and last 10
steps, and the wall time. Bounded: ``--max-minutes`` stops the run (it is then reported as
cut short). Writes JSON; never asserts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def worker_processes() -> list[psutil.Process]:
    """The Dask worker processes of this driver: its spawned children (the resource tracker aside)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            command = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "spawn_main" in command and "resource_tracker" not in command:
            found.append(child)
    return sorted(found, key=lambda process: process.pid)


class Killer:
    """An observer: after every ``every`` steps, kill one worker ``delay_s`` into the next step."""

    def __init__(self, every: int, delay_s: float, deadline: float) -> None:
        self.every = every
        self.delay_s = delay_s
        self.deadline = deadline
        self.kills: list[dict[str, Any]] = []
        self.last_step = 0

    def on_step(self, record: Any) -> None:
        self.last_step = record.step
        if time.monotonic() > self.deadline:
            raise KeyboardInterrupt  # the time bound: stop the run here
        if record.step % self.every == 0 and record.step < record.num_steps:
            threading.Timer(self.delay_s, self._kill, args=(record.step + 1,)).start()

    def on_event(self, event: Any) -> None:
        pass

    def _kill(self, during_step: int) -> None:
        workers = worker_processes()
        if not workers:
            return
        victim = workers[len(self.kills) % len(workers)]
        os.kill(victim.pid, signal.SIGKILL)
        self.kills.append({"during_step": during_step, "pid": victim.pid, "time": time.time()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--kill-every", type=int, default=50)
    parser.add_argument("--delay-ms", type=float, default=20.0, help="how far into the step the kill lands")
    parser.add_argument("--max-minutes", type=float, default=15.0)
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks" / "results" / "soak.json")
    args = parser.parse_args()

    from flowrl.api.run import run
    from flowrl.spec.loader import load_pipeline

    graph = load_pipeline(REPO / "pipelines" / "grpo_tiny.yaml")
    output_dir = Path(tempfile.mkdtemp(prefix="flowrl-soak-"))
    killer = Killer(args.kill_every, args.delay_ms / 1e3, time.monotonic() + args.max_minutes * 60)
    started = time.perf_counter()
    cut_short = False
    try:
        run(graph, steps=args.steps, output_dir=output_dir, observer=killer, base_dir=REPO / "pipelines")
    except KeyboardInterrupt:
        cut_short = True
    wall_s = time.perf_counter() - started

    lines = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [line["step"] for line in lines]
    events = [json.loads(line) for line in (output_dir / "events.jsonl").read_text().splitlines()]
    faults = [event for event in events if event["kind"] == "fault"]
    recoveries = []
    for event in events:
        if event["kind"] != "recovered":
            continue
        lost = re.search(r"([0-9.]+) s lost", event["message"])
        again = re.search(r"running again from step (\d+)", event["message"])
        waited = re.search(r"([0-9.]+) s waiting for the worker", event["message"])
        recoveries.append({
            "fault_step": event["step"],
            "seconds_lost": float(lost.group(1)) if lost else None,
            "seconds_waiting_for_the_worker": float(waited.group(1)) if waited else None,
            "steps_run_again": event["step"] - int(again.group(1)) + 1 if again else None,
            "message": event["message"],
        })
    rewards = [line.get("critic/score/mean") for line in lines if line.get("critic/score/mean") is not None]
    from vs_trl import machine  # the benchmarks folder is the script's: on sys.path

    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "steps_completed": len(steps),
        "cut_short": cut_short,
        "kills": killer.kills,
        "faults": len(faults),
        "recoveries": recoveries,
        "steps_run_again": sum(r["steps_run_again"] or 0 for r in recoveries),
        "seconds_lost": [r["seconds_lost"] for r in recoveries],
        "metrics_every_step_once": steps == list(range(1, len(steps) + 1)),
        "metrics_duplicates": len(steps) - len(set(steps)),
        "metrics_gaps": sorted(set(range(1, max(steps, default=0) + 1)) - set(steps)),
        "reward_first10_last10": [sum(rewards[:10]) / max(1, len(rewards[:10])),
                                  sum(rewards[-10:]) / max(1, len(rewards[-10:]))],
        "wall_s": wall_s,
        "output_dir": str(output_dir),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k not in ("recoveries",)}, indent=2))
    print(f"written: {args.output}")


if __name__ == "__main__":
    main()
