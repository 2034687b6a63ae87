"""A run's output folder (config, plans, metrics, events, checkpoints, final model).

    OUTPUT_DIR/
      config.yaml          the resolved pipeline
      plan-<step>.json     every placement decision
      metrics.jsonl        one line per step
      profile.jsonl        one line per node call, per device sample, per smoothed estimate
      events.jsonl         placement, checkpoints, faults, warnings
      run.json             where the pipeline came from (for ``flowrl resume``), and whether it finished
      checkpoints/step-<n>/  written under a temporary name, then renamed; trainer_state.json
                           (written last) lists every file's SHA-256, each weight shard and
                           model.safetensors.index.json included
      final/               the trained policy, loadable with from_pretrained (a trained critic
                           in final/<name>/, a token classifier)

Weights bigger than ``trainer.max_shard_size`` are written as ``model-0000i-of-0000N.safetensors``
plus ``model.safetensors.index.json``, as transformers writes them.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

from flowrl.api.recovery import TRAINER_STATE, file_digests
from flowrl.errors import CheckpointError, FlowrlError
from flowrl.profiler import NodeSummary
from flowrl.records import NodeTiming, RunEvent, StepRecord


class RunFolder:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise FlowrlError(f"cannot create the output folder {path}: {error}") from error
        self.checkpoints = path / "checkpoints"

    def write_config(self, text: str) -> None:
        (self.path / "config.yaml").write_text(text)

    def read_config(self) -> str | None:
        path = self.path / "config.yaml"
        return path.read_text() if path.is_file() else None

    def write_run_info(self, info: dict[str, Any]) -> None:
        (self.path / "run.json").write_text(json.dumps(info, indent=2) + "\n")

    def read_run_info(self) -> dict[str, Any]:
        path = self.path / "run.json"
        try:
            return dict(json.loads(path.read_text())) if path.is_file() else {}
        except (OSError, ValueError):
            return {}

    def reset_logs(self) -> None:
        """A fresh run starts the line files anew (a resumed run appends)."""
        for name in ("metrics.jsonl", "profile.jsonl", "events.jsonl"):
            (self.path / name).write_text("")

    def truncate_logs(self, last_step: int) -> int:
        """Drop the metric and profile lines of steps after ``last_step`` (they will be run
        again), so the files never hold a step twice; returns how many metric lines went."""
        dropped = 0
        for name in ("metrics.jsonl", "profile.jsonl"):
            path = self.path / name
            if not path.is_file():
                continue
            kept = []
            for line in path.read_text().splitlines():
                try:
                    step = int(json.loads(line).get("step", 0))
                except (ValueError, AttributeError, TypeError):
                    continue  # a line cut short by a killed process
                if step <= last_step:
                    kept.append(line)
                elif name == "metrics.jsonl":
                    dropped += 1
            path.write_text("".join(line + "\n" for line in kept))
        return dropped

    def write_plan(self, step: int, plan: dict[str, Any]) -> Path:
        target = self.path / f"plan-{step}.json"
        target.write_text(json.dumps(plan, indent=2) + "\n")
        return target

    def append_metrics(self, record: StepRecord) -> None:
        line = {"step": record.step, "elapsed_s": round(record.elapsed_s, 4), **_finite(record.metrics)}
        self._append("metrics.jsonl", line)
        for node in record.nodes:
            self._append("profile.jsonl", {"step": record.step, "type": "node", **node.to_dict()})
        for device in record.devices:
            self._append("profile.jsonl", {"step": record.step, "type": "device", **vars(device)})

    def append_node(self, step: int, timing: NodeTiming) -> None:
        """One node call outside a step's record (an evaluation)."""
        self._append("profile.jsonl", {"step": step, "type": "node", **timing.to_dict()})

    def append_smoothed(self, step: int, summaries: list[NodeSummary]) -> None:
        """The profiler's smoothed per-node estimates (EWMA), as the planner sees them."""
        for summary in summaries:
            self._append("profile.jsonl", {"step": step, "type": "smoothed", **vars(summary)})

    def append_event(self, event: RunEvent) -> None:
        self._append("events.jsonl", {"time": time.time(), **vars(event)})

    def checkpoint_staging(self, step: int) -> Path:
        staging = self.checkpoints / f".step-{step}.tmp"
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        return staging

    def commit_checkpoint(self, staging: Path, step: int, trainer_state: dict[str, Any], keep: int) -> Path:
        """Seal ``staging`` (a manifest of every file's SHA-256, written last) and rename it
        into place; older checkpoints beyond ``keep`` go only after the new one is in place."""
        final = self.checkpoints / f"step-{step}"
        try:
            manifest = {**trainer_state, "step": step, "files": file_digests(staging)}
            (staging / TRAINER_STATE).write_text(json.dumps(manifest, indent=2) + "\n")
            if final.exists():
                shutil.rmtree(final)
            staging.rename(final)
        except OSError as error:
            self.discard_staging(staging)
            raise CheckpointError(f"cannot finish checkpoint {final}: {error}; the previous one is intact") from error
        self._prune(keep)
        return final

    def discard_staging(self, staging: Path) -> None:
        shutil.rmtree(staging, ignore_errors=True)

    def _prune(self, keep: int) -> None:
        steps = sorted(
            (int(p.name.removeprefix("step-")), p) for p in self.checkpoints.glob("step-*") if p.is_dir()
        )
        for _, path in steps[:-keep]:
            shutil.rmtree(path, ignore_errors=True)

    def _append(self, name: str, line: dict[str, Any]) -> None:
        with open(self.path / name, "a") as handle:
            handle.write(json.dumps(line) + "\n")


def _finite(metrics: dict[str, float]) -> dict[str, float | None]:
    # JSON has no NaN; a missing number is written as null.
    return {k: (v if isinstance(v, (int, float)) and math.isfinite(v) else None) for k, v in metrics.items()}
