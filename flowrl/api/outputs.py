"""A run's output folder (config, plans, metrics, events, checkpoints, final model).

    OUTPUT_DIR/
      config.yaml          the resolved pipeline
      plan-<step>.json     every placement decision
      metrics.jsonl        one line per step
      profile.jsonl        one line per node call, per device sample, per smoothed estimate
      events.jsonl         placement, checkpoints, faults, warnings
      samples.jsonl        a few completions of every trainer.log_samples_every-th step, with
                           their prompts, answers, rewards by score node and advantages
      run.json             where the pipeline came from (for ``flowrl resume``), and whether it finished
      run.lock             held (an advisory lock) by the process writing the folder: a second
                           run, resume or --overwrite into it is refused while the first goes on
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
import os
import shutil
import socket
import weakref
import statistics
import time
from pathlib import Path
from typing import Any

from flowrl.api.recovery import TRAINER_STATE, checkpoint_dirs, file_digests, rewound_name
from flowrl.errors import CheckpointError, FlowrlError
from flowrl.profiler import NodeSummary
from flowrl.records import NodeTiming, RunEvent, StepRecord, slowest_part_medians


def check_fresh_start(output_dir: Path, overwrite: bool) -> None:
    """A fresh run may not start in a folder that holds an earlier run's checkpoints (a later
    resume would take them for its own) or its final model (this run would replace it) unless
    it starts over there (``overwrite``)."""
    if overwrite:
        return
    earlier = [path.name for _, path in checkpoint_dirs(output_dir / "checkpoints")]
    elsewhere = "or give this run another output folder (-o DIR; trainer.output_dir)"
    if earlier:
        shown = ", ".join(earlier[-3:]) + (f" and {len(earlier) - 3} older" if len(earlier) > 3 else "")
        raise FlowrlError(
            f"the output folder {output_dir} holds checkpoints of an earlier run ({shown}), which a later resume "
            f"would take for this run's: continue that run (flowrl resume {output_dir}; run(..., resume=True)), "
            f"start over there (--overwrite; run(..., overwrite=True): deletes its checkpoints and final model), {elsewhere}"
        )
    if has_final_model(output_dir):
        raise FlowrlError(
            f"the output folder {output_dir} holds the final model of an earlier run ({output_dir / 'final'}), which "
            "this run would replace: start over there (--overwrite; run(..., overwrite=True): deletes it), "
            f"{elsewhere}"
        )


def check_resume_flags(resume: bool, force: bool, checkpoint: int | None) -> None:
    """Refuse what only a resume takes, given without one."""
    if resume:
        return
    if checkpoint is not None:
        raise FlowrlError("--checkpoint chooses the checkpoint a resume starts from: add --resume")
    if force:
        raise FlowrlError("--force (force=True) lets a resume go on with a changed pipeline: add --resume "
                          "(resume=True); a fresh run needs no --force, and --overwrite starts over in a folder that "
                          "holds an earlier run")


def check_resume_start(output_dir: Path, steps: int) -> None:
    """A resume may not train over a finished run that kept no checkpoint to continue from
    (it would start at step 1 and replace that run's final model), nor stop before its newest
    checkpoint (it would save that checkpoint's weights as a final model of fewer steps)."""
    finished = finished_steps(output_dir)
    if finished is not None and finished >= steps:
        return  # nothing to train: the run says so
    written = checkpoint_dirs(output_dir / "checkpoints")
    if written and written[-1][0] > steps:
        raise FlowrlError(
            f"the run in {output_dir} has a checkpoint of step {written[-1][0]}, past the {steps} steps asked for: "
            f"resume with at least {written[-1][0]} steps (--steps; trainer.steps)"
        )
    if written or not has_final_model(output_dir):
        return
    raise FlowrlError(
        f"the run in {output_dir} ended{f' after {finished} steps' if finished else ''} and kept no checkpoint to "
        f"continue from, so it cannot go on to step {steps} (a run keeps checkpoints with trainer.checkpoint_every "
        "> 0): train again from step 1 there (flowrl run FILE -o DIR --overwrite; run(..., overwrite=True); it "
        "replaces the final model) or into another output folder"
    )


def read_run_info(output_dir: Path, strict: bool = False) -> dict[str, Any]:
    """``run.json`` of the run in ``output_dir``; empty when there is none (or it is
    unreadable; ``strict``: a FlowrlError then, for a resume, which needs what it records)."""
    path = output_dir / "run.json"
    try:
        return dict(json.loads(path.read_text())) if path.is_file() else {}
    except (OSError, ValueError, TypeError) as error:
        if strict:
            raise FlowrlError(f"{path} cannot be read ({type(error).__name__}: {error}): the run's record is "
                              "damaged; restore it from a copy, or start the run again in another output folder") from error
        return {}


def pipeline_folder(config: Path) -> Path | None:
    """The folder a run's ``config.yaml`` reads its relative paths from (models, data, reward
    modules): that of the pipeline file the run started from, which ``run.json`` beside it
    records; None for any other file."""
    if config.name != "config.yaml" or not (config.parent / "run.json").is_file():
        return None
    folder = read_run_info(config.parent, strict=True).get("base_dir")
    return Path(folder) if isinstance(folder, str) and folder else None


def step_line(text: str) -> tuple[int, dict[str, Any]]:
    """(step, the rest) of one line of a run's line files; ValueError for a line that is not
    one (cut short by a killed process, edited)."""
    try:
        line = json.loads(text)
        return int(line.pop("step")), line
    except (ValueError, AttributeError, TypeError, KeyError) as error:
        raise ValueError(f"{type(error).__name__}: {error}") from error


def finished_steps(output_dir: Path) -> int | None:
    """The steps the run in ``output_dir`` finished, as ``run.json`` records them (None: it
    did not finish, or there is no run)."""
    value = read_run_info(output_dir).get("finished_steps")
    return value if isinstance(value, int) else None


def has_final_model(output_dir: Path) -> bool:
    """Whether an earlier run left its trained model in ``output_dir/final``."""
    final = output_dir / "final"
    return final.is_dir() and any(final.iterdir())


LOCK_FILE = "run.lock"


class RunFolder:
    """A run's output folder, held by this process (``run.lock``) from the moment it is
    opened until :meth:`release`: two processes writing one folder would interleave their
    steps in its logs and mix their checkpoints."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise FlowrlError(f"cannot create the output folder {path}: {error}") from error
        self.checkpoints = path / "checkpoints"
        self._lock = _hold(path / LOCK_FILE)
        # a folder dropped without release() (a caller's mistake) lets go when collected
        self._finalizer = weakref.finalize(self, os.close, self._lock) if self._lock is not None else None

    def release(self) -> None:
        """Let another run write the folder (closing the lock's file releases it)."""
        if self._finalizer is not None and self._finalizer.alive:
            try:
                os.ftruncate(self._lock, 0)  # type: ignore[arg-type]
            except OSError:
                pass
            self._finalizer()
        self._lock = None

    def start_over(self) -> None:
        """Delete an earlier run's checkpoints and final model: a fresh run must never resume
        from, or leave beside its own, what another run wrote."""
        for path in (self.checkpoints, self.path / "final"):
            try:
                if path.exists():
                    shutil.rmtree(path)
            except OSError as error:
                raise FlowrlError(f"cannot delete {path} to start over: {error}") from error

    def write_config(self, text: str) -> None:
        _write(self.path / "config.yaml", text)

    def read_config(self) -> str | None:
        path = self.path / "config.yaml"
        return path.read_text() if path.is_file() else None

    def write_run_info(self, info: dict[str, Any]) -> None:
        _write(self.path / "run.json", json.dumps(info, indent=2) + "\n")

    def read_run_info(self, strict: bool = False) -> dict[str, Any]:
        return read_run_info(self.path, strict)

    def reset_logs(self) -> None:
        """A fresh run starts the line files anew (a resumed run appends)."""
        for name in ("metrics.jsonl", "profile.jsonl", "events.jsonl", "samples.jsonl"):
            (self.path / name).write_text("")
            (self.path / rewound_name(name)).unlink(missing_ok=True)

    def truncate_logs(self, last_step: int) -> int:
        """Move the metric, profile and sample lines of steps after ``last_step`` (they will be
        run again) out of the run's files, so these never hold a step twice, into
        ``NAME.rewound.jsonl`` beside them (appended: a run that stops before it trains those
        steps again keeps their history); returns how many metric lines went."""
        dropped = 0
        for name in ("metrics.jsonl", "profile.jsonl", "samples.jsonl"):
            path = self.path / name
            if not path.is_file():
                continue
            kept, moved = [], []
            for line in path.read_text().splitlines():
                try:
                    step = step_line(line)[0]
                except ValueError:
                    continue  # a line cut short by a killed process
                if step <= last_step:
                    kept.append(line)
                else:
                    moved.append(line)
            if moved:
                with (self.path / rewound_name(name)).open("a") as aside:
                    aside.write("".join(line + "\n" for line in moved))
                if name == "metrics.jsonl":
                    dropped = len(moved)
            path.write_text("".join(line + "\n" for line in kept))
        return dropped

    def elapsed_at(self, step: int) -> float:
        """The run's elapsed seconds when ``step`` finished, from metrics.jsonl, for a
        checkpoint that does not keep them (written before it did): the most of the lines up
        to ``step`` (0 for none)."""
        path = self.path / "metrics.jsonl"
        found = 0.0
        if not path.is_file():
            return found
        for text in path.read_text().splitlines():
            try:
                at, line = step_line(text)
            except ValueError:
                continue  # a line cut short by a killed process
            elapsed = line.get("elapsed_s")
            if 0 < at <= step and isinstance(elapsed, (int, float)):
                found = max(found, float(elapsed))
        return found

    def add_measured_to_plans(self, records: list[StepRecord]) -> None:
        """Put what the run measured beside what each plan predicted: plan-N.json gets a
        ``measured`` section over the steps it governed (from N, or 1, to the next plan):
        per node the median compute and wall seconds (a split node's slowest part) and the
        largest peak memory, per device the largest memory and the mean utilisation, and
        the median step; each entry of its ``nodes`` gets ``predicted_s`` (its ``end_s`` -
        ``start_s``) and ``measured_s`` side by side. Plans whose steps this process did not run are left as they are."""
        plans = self._plans()
        for index, (first, path) in enumerate(plans):
            last = plans[index + 1][0] - 1 if index + 1 < len(plans) else None
            governed = [r for r in records if r.step >= max(first, 1) and (last is None or r.step <= last)]
            if not governed:
                continue
            plan = json.loads(path.read_text())
            plan["measured"] = _measured(governed)
            nodes = plan["measured"]["nodes"]
            for entry in plan.get("nodes", []):
                if entry.get("node") in nodes:
                    entry["predicted_s"] = entry["end_s"] - entry["start_s"]
                    entry["measured_s"] = nodes[entry["node"]]["compute_s_median"]
            path.write_text(json.dumps(plan, indent=2) + "\n")

    def governed_by_first_plan(self, records: list[StepRecord]) -> list[StepRecord]:
        """The steps of ``records`` that ``plan-0.json`` governed (before any re-plan)."""
        end = min((step for step, _ in self._plans() if step > 0), default=None)
        return [record for record in records if end is None or record.step < end]

    def _plans(self) -> list[tuple[int, Path]]:
        """(step, path) of every ``plan-N.json``, by step."""
        return sorted((int(path.stem.split("-", 1)[1]), path) for path in self.path.glob("plan-*.json")
                      if path.stem.split("-", 1)[1].isdigit())

    def add_to_plan(self, step: int, key: str, value: Any) -> None:
        path = self.path / f"plan-{step}.json"
        plan = json.loads(path.read_text())
        plan[key] = value
        path.write_text(json.dumps(plan, indent=2) + "\n")

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

    def append_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        for index, sample in enumerate(samples):
            self._append("samples.jsonl", {"step": step, "row": index, **sample})

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
        try:
            with open(self.path / name, "a") as handle:
                handle.write(json.dumps(line) + "\n")
        except OSError as error:  # a full disk, a folder made read-only under the run
            kept = ("the checkpoints written are kept" if checkpoint_dirs(self.checkpoints)
                    else "no checkpoint was written, so it starts at step 1")
            raise FlowrlError(
                f"cannot write {name} in {self.path}: {error.strerror or error}; free disk space or fix the "
                f"folder, then resume (`flowrl resume {self.path}`: {kept}, and a half-written line is dropped)"
            ) from None


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as error:
        raise FlowrlError(f"cannot write {path}: {error.strerror or error}") from error


def _hold(path: Path) -> int | None:
    """Take the advisory lock of ``path`` (made if missing) for this process, and write who
    holds it; a lock another process holds is refused, naming that process. The kernel drops
    the lock when its holder exits, however it exits: a killed run leaves nothing to clean up.
    None where the system or the file system has no ``flock`` (the folder is then not
    guarded)."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        return None
    fd = _open_lock(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise FlowrlError(_held_message(path.parent, holder)) from None
    except OSError:  # a file system without flock (some Lustre, CIFS or FUSE mounts)
        os.close(fd)
        return None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    except OSError:
        pass  # opened read-only (a folder this process may not write): held, unnamed
    return fd


def _open_lock(path: Path) -> int:
    """``path`` opened to lock it: for writing (made if missing), else, where it exists and
    cannot be written (a finished run's read-only folder), for reading, which ``flock`` takes
    as well."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        if path.is_file():
            try:
                return os.open(path, os.O_RDONLY)
            except OSError:
                pass
        raise FlowrlError(f"cannot open the run's lock file {path}: {error.strerror or error}; give the run a "
                          "folder it can write (-o DIR; trainer.output_dir), or remove the file if no run is "
                          "writing the folder") from error


def _held_message(folder: Path, holder: str) -> str:
    return (f"the output folder {folder} is being written by a run that is still going ({holder}): wait for it to "
            "end or stop it, or give this run another output folder (-o DIR; trainer.output_dir)")


def check_not_held(folder: Path) -> None:
    """Refuse, before any other check of ``folder``, a folder another process's run holds
    (``run.lock``): what the run would say once it opens the folder, said first."""
    path = folder / LOCK_FILE
    if not path.is_file():
        return
    try:
        import fcntl

        fd = os.open(path, os.O_RDONLY)
    except (ImportError, OSError):
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        raise FlowrlError(_held_message(folder, holder)) from None
    except OSError:
        return
    finally:
        os.close(fd)


def _measured(records: list[StepRecord]) -> dict[str, Any]:
    """Medians and peaks of ``records`` (the steps one plan governed), for :meth:`RunFolder.add_measured_to_plans`."""
    calls = [(record.step, timing) for record in records for timing in record.nodes]
    compute = slowest_part_medians((t.node, step, t.compute_s) for step, t in calls)
    wall = slowest_part_medians((t.node, step, t.wall_s) for step, t in calls)
    node_peak: dict[str, float] = {}
    device_peak: dict[str, float] = {}
    utilization: dict[str, list[float]] = {}
    for _, timing in calls:
        node_peak[timing.node] = max(node_peak.get(timing.node, 0.0), timing.peak_memory_gb)
    for record in records:
        for sample in record.devices:
            device_peak[sample.device] = max(device_peak.get(sample.device, 0.0), sample.memory_gb)
            utilization.setdefault(sample.device, []).append(sample.utilization)
    steps = [r.metrics["timing_s/step"] for r in records if math.isfinite(r.metrics.get("timing_s/step", math.nan))]
    return {
        "steps": [records[0].step, records[-1].step],
        "step_s_median": statistics.median(steps) if steps else None,
        "nodes": {node: {"compute_s_median": compute[node], "wall_s_median": wall[node],
                         "peak_memory_gb": node_peak[node]} for node in compute},
        "devices": {device: {"peak_memory_gb": device_peak[device],
                             "utilization_mean": statistics.fmean(utilization[device])} for device in device_peak},
    }


def _finite(metrics: dict[str, float]) -> dict[str, float | None]:
    # JSON has no NaN; a missing number is written as null.
    return {k: (v if isinstance(v, (int, float)) and math.isfinite(v) else None) for k, v in metrics.items()}


def finite_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The finite numbers of a record (trackers take numbers only; NaN means not measured)."""
    return {key: float(value) for key, value in _finite(metrics).items() if value is not None}
