"""The loop around the run's state machine: carry out one instruction, feed back one event.

``api/lifecycle.py`` decides; this module only does what it is told, against the cluster
and the run folder, and turns whatever happened into an event. Every remote call it makes
has a deadline and notices a lost worker at once (``runtime/waiting.py``), so no fault can
leave it waiting. Errors become ``Failed`` events; only the machine's ``Stop`` ends the run.

A lost worker's slot goes to a warm spare worker when the local cluster has one (imports
done, no models; ``runtime.standby_workers``), else to its replacement, else the plan is
placed again onto the survivors. The trained models come back from the newer of the
driver's in-memory snapshot (``runtime.snapshot_every``) and the newest checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from flowrl.api import lifecycle as lc
from flowrl.api.evaluation import Evaluator
from flowrl.api.faults import NonFiniteGuard
from flowrl.api.metrics import step_metrics
from flowrl.api.outputs import RunFolder
from flowrl.api.recovery import FoundCheckpoint, newest_checkpoint, newest_written, resume_note
from flowrl.api.replanning import Replanner
from flowrl.api.reward_guard import RewardFailureGuard
from flowrl.data import PromptSource
from flowrl.errors import (CheckpointError, FlowrlError, NodeTimeout, PlacementError, RewardError, RunInterrupted,
                           RunStopped, WorkerLost, error_chain)
from flowrl.graph import PipelineGraph
from flowrl.records import RunEvent, StepRecord
from flowrl.runtime.torch_profile import fallback_folder
from flowrl.runtime.cluster import Cluster, call_within
from flowrl.runtime.interrupts import (handed_over, note_stop_signal, owed, raise_outside_imports, repeated_signal,
                                       stopping_for, took_retry)
from flowrl.runtime.session import PendingSnapshot, Session
from flowrl.runtime.waiting import lost_slots
from flowrl.scheduler.events import DeviceReplaced
from flowrl.spec.schema import ScoreNode

LOSS_NOTICE_S = 15.0
"""Longest wait for the scheduler to see a worker loss that the driver already saw."""
PEER_LOSS_NOTICE_S = 3.0
"""Longest wait for the scheduler to see that a rank whose group's collective failed is gone;
a rank that did not die (stopped, hung) costs this wait before its group restarts."""
NEW_WORKER_AFTER_S = 8.0
"""A lost slot whose worker is not back after this long gets a newly started worker too. A
nanny's replacement forked from the warm server registers in about 0.1 s on 2 idle cores; a
spawned one (machines with GPUs) imports torch first, about 5 s on 2 busy cores."""
STANDBY_MIN_REMAINING_S = 30.0
"""Spare workers start once the run has at least this long to go (or after a first fault): a
spare takes seconds of CPU to import torch, which a short run would only lose, and a cluster
waits for a starting worker before it can close."""
AUTO_SNAPSHOT_PARAMETERS = 50_000_000
"""Up to this many trained parameters, ``snapshot_every: null`` keeps in-memory snapshots;
above, checkpoints serve."""
SNAPSHOT_INTERVAL_S = 10.0
"""``snapshot_every: null`` takes a snapshot about every this many seconds of steps, so a
fault runs at most about this much again. Every step would cost more than it saves: on 2
cores, pulling an 8 M-parameter model's weights and Adam state (100 MB) each 0.7 s step made
the steps 10-20 % slower."""
SNAPSHOT_BYTES_PER_S = 10e6
"""... and, for larger models, so seldom that snapshots move at most this many bytes per
second of training on average."""
SNAPSHOT_BYTES_PER_PARAMETER = 14
"""A trained parameter with its optimizer state, the larger of: fp32 with two Adam moments
(12), 16-bit with an fp32 master and two fp32 moments (14)."""
RETUNE_WINDOW_STEPS = 20
"""The snapshot cadence follows the median time of this many latest steps."""


def snapshot_interval_s(trained_parameters: int) -> float:
    """Seconds of training between two automatic snapshots of this many trained parameters."""
    return max(SNAPSHOT_INTERVAL_S, trained_parameters * SNAPSHOT_BYTES_PER_PARAMETER / SNAPSHOT_BYTES_PER_S)


def snapshot_every_for(interval_s: float, step_s: float) -> int:
    """Steps between snapshots: as many as take ``interval_s`` at ``step_s`` each, at least one."""
    return max(1, round(interval_s / max(step_s, 1e-9)))


class Watchers(Protocol):
    def step(self, record: StepRecord) -> None: ...
    def evaluated(self, record: StepRecord) -> None: ...
    def rewound(self, last_step: int) -> None: ...
    def event(self, event: RunEvent) -> None: ...
    def restored(self) -> None: ...


class KLState(Protocol):
    def coefs(self) -> dict[str, float]: ...
    def update(self, reports: dict[str, Any]) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class Recovery:
    """Timings of the recovery under way, for its ``recovered`` event."""

    noticed: float
    step: int
    what: list[str] = field(default_factory=list)
    workers_s: float = 0.0
    build_s: float = 0.0
    faults: int = 0


JOINED_TAKERS = (", and so does a worker that joins the cluster now: a CPU worker for a CPU slot, one serving the "
                 "same GPU model for a GPU slot")
"""On a joined cluster, who else takes a lost slot (``Cluster.take_over``)."""


class Driver:
    def __init__(
        self, graph: PipelineGraph, cluster: Cluster, folder: RunFolder, source: PromptSource, watcher: Watchers,
        base_dir: Path | None, replanner: Replanner, kl: KLState, evaluator: Evaluator,
        start: FoundCheckpoint | None, records: list[StepRecord], evaluations: list[tuple[int, dict[str, float]]],
    ) -> None:
        self.graph = graph
        self.cluster = cluster
        self.folder = folder
        self.source = source
        self.watcher = watcher
        self.base_dir = base_dir
        self.replanner = replanner
        self.kl = kl
        self.initial_kl = kl.state_dict()
        self.evaluator = evaluator
        self.start = start
        self.start_restored = False
        self.records = records
        self.evaluations = evaluations
        self.session: Session | None = None
        self.addresses: dict[str, str] = {}
        self._interrupt_signal = "SIGINT"
        """The signal that stopped the loop (``_InterruptFlag.signal``), for its message."""
        self._reward_hangs: dict[str, int] = {}
        """Score node -> its reward function's hangs since a step last went through."""
        """Slot -> worker address the current session was built on."""
        self.snapshot: dict[str, Any] | None = None
        """The newest snapshot that arrived whole (a recovery restores it), of step ``snapshot_step``."""
        self.snapshot_kl: dict[str, Any] = {}
        self.snapshot_step = 0
        self.snapshot_interval_s: float | None = None
        """Seconds of steps between snapshots when ``snapshot_every`` is left to the run."""
        self.pending_snapshot: tuple[PendingSnapshot, dict[str, Any], int] | None = None
        """A snapshot on its way to the driver, with the KL state and step it belongs to."""
        self.nonfinite = NonFiniteGuard(graph.spec.trainer.max_nonfinite_updates, folder.checkpoints)
        self.rewards = RewardFailureGuard(graph, folder.checkpoints)
        self.recovery: Recovery | None = None
        self.interrupt = _InterruptFlag()
        """Stop signals while the loop runs (``run``)."""
        self.started = time.perf_counter()
        self.resumed_s = 0.0
        """The run's elapsed seconds at the checkpoint this process resumed from
        (``StepRecord.resumed_s``)."""
        self.built_once = False
        self.standby_started = False
        spec = graph.spec
        self.machine = lc.Lifecycle(
            num_steps=spec.trainer.steps,
            first_step=start.step + 1 if start is not None else 1,
            checkpoint_every=spec.trainer.checkpoint_every or 0,
            evaluate_first=start is None and evaluator.due(0),
            resumed_from=start.step if start is not None else None,
            max_recoveries=spec.runtime.max_recoveries,
            window_steps=spec.runtime.recovery_window_steps,
        )

    # ---- the loop ---------------------------------------------------------------------

    def run(self) -> None:
        with _InterruptFlag() as interrupt:
            self.interrupt = interrupt
            self._loop(interrupt)

    def _loop(self, interrupt: _InterruptFlag) -> None:
        instruction = self.machine.start()
        error: BaseException | None = None
        failed_at: lc.Instruction | None = None
        while not isinstance(instruction, (lc.Stop, lc.Finish)):
            try:
                with interrupt.armed():
                    event = self.carry_out(instruction)
            except KeyboardInterrupt:
                event = lc.Interrupted(interrupt.signal, self._last_finished())
            except Exception as failure:  # noqa: BLE001 - every failure becomes an event
                failure = self._hung_reward(failure)
                error, failed_at = failure, instruction
                event = lc.Failed(self.fault_of(failure, instruction))
                if event.fault.kind != "error":
                    self._noticed(event.fault)
            if interrupt.raised:
                # Ctrl-C came, even if the KeyboardInterrupt it raised was swallowed on the
                # way (C code that clears Python errors): the run stops all the same.
                event = lc.Interrupted(interrupt.signal, self._last_finished())
            instruction = self.machine.handle(event)
        if isinstance(instruction, lc.Stop):
            self._interrupt_signal = interrupt.signal
            self._stop(instruction, error, failed_at)

    def _last_finished(self) -> int:
        """The last step whose record was written (the checkpoint's after a restore)."""
        return self.records[-1].step if self.records else self.machine.first_step - 1

    def close(self) -> None:
        if self.session is not None:
            self.session.close()

    def carry_out(self, instruction: lc.Instruction) -> lc.Event:
        if isinstance(instruction, lc.Build):
            return self._build()
        if isinstance(instruction, lc.Restore):
            return self._restore(instruction.source)
        if isinstance(instruction, lc.Evaluate):
            return self._evaluate_first()
        if isinstance(instruction, lc.Snapshot):
            return self._snapshot(instruction.step)
        if isinstance(instruction, lc.Replan):
            self.replanner.before_step(instruction.step)
            return lc.Replanned(instruction.step)
        if isinstance(instruction, lc.RunStep):
            done = self._run_step(instruction.step)
            self._reward_hangs.clear()  # a step went through: a later hang is a first one again
            return done
        if isinstance(instruction, lc.Checkpoint):
            return self._checkpoint(instruction.step)
        if isinstance(instruction, lc.SaveFinal):
            return self._save_final(instruction.step)
        if isinstance(instruction, lc.AwaitWorkers):
            return self._await_workers(instruction)
        if isinstance(instruction, lc.ShrinkPlan):
            return self._shrink(instruction.gone)
        raise lc.LifecycleError(f"cannot carry out {instruction!r}")

    # ---- instructions -----------------------------------------------------------------

    def _build(self) -> lc.Event:
        started = time.perf_counter()
        if self.session is not None:
            self._settle_snapshot(lenient=True)  # before the old session's hosts forget it
            old, self.session = self.session, None
            old.release(set(lost_slots(old.hosts, old.addresses, self.cluster.addresses())))
        plan = self.replanner.plan
        session = Session(self.cluster, self.graph, plan, self.base_dir)
        self.session = session
        self.addresses = dict(session.addresses)
        infos = session.load_models()
        self.replanner.session = session
        if not self.built_once:
            self.built_once = True
            sizes = {}
            for info in infos:
                if info["trains"]:
                    sizes[info["model"]] = info["trained_parameters"]
                # a copy no update trains (generation's, on another worker) trains nothing
                adapters = info["trains"] and info["trained_parameters"] < info["num_parameters"]
                self.watcher.event(RunEvent(
                    "model", f"{info['model']} on {info['device']}: {info['num_parameters']:,} parameters"
                    + (f" ({info['trained_parameters']:,} trainable, in adapters)" if adapters else ""), 0))
            self.machine.snapshot_every = self._snapshot_every(sum(sizes.get(m, 0) for m in session.trained_models()))
        elif not self.standby_started:
            self._start_standby()  # after a fault: the next one should find a spare
        if self.recovery is not None:
            self.recovery.build_s += time.perf_counter() - started
        return lc.Built()

    def _snapshot_every(self, trained_parameters: int) -> int:
        every = self.graph.spec.runtime.snapshot_every
        if every is None:
            # until step times are known (``_retune_snapshots``), one at the start
            self.snapshot_interval_s = snapshot_interval_s(trained_parameters)
            return 1 if trained_parameters <= AUTO_SNAPSHOT_PARAMETERS else 0
        return every

    def _retune_snapshots(self) -> None:
        """``snapshot_every: null``: steps between snapshots from the median of the last
        steps' times."""
        if self.snapshot_interval_s is None or not self.machine.snapshot_every:
            return
        profiled = self.graph.spec.trainer.torch_profile  # slower steps, not the run's pace
        recent = [record.metrics["timing_s/step"] for record in self.records[-RETUNE_WINDOW_STEPS:]
                  if record.step not in profiled]
        if recent:
            self.machine.snapshot_every = snapshot_every_for(self.snapshot_interval_s, statistics.median(recent))

    def _restore(self, source: str) -> lc.Event:
        session = self._session()
        started = time.perf_counter()
        back_to, what = 0, "the initial models"
        if source == "snapshot":
            self._settle_snapshot(lenient=True)
        if source == "snapshot" and self.snapshot is not None:
            session.restore(self.snapshot)
            self.kl.load_state_dict(self.snapshot_kl)
            back_to, what = self.snapshot_step, f"the in-memory snapshot of step {self.snapshot_step}"
        elif source in ("snapshot", "checkpoint") and (found := self._checkpoint_to_restore()) is not None:
            session.load_checkpoint(found.path)
            if found is self.start:
                self.start_restored = True
                kept = found.trainer_state.get("elapsed_s")
                self.resumed_s = float(kept) if isinstance(kept, (int, float)) else self.folder.elapsed_at(found.step)
                self.watcher.restored()
            self.kl.load_state_dict(found.trainer_state.get("kl", {}))
            if self.recovery is None:  # a resumed run: what the scheduler had learned (a live one still knows)
                self.replanner.load_state_dict(found.trainer_state.get("scheduler", {}))
            back_to, what = found.step, f"checkpoint {found.path.name}"
        else:
            self.kl.load_state_dict(self.initial_kl)
        dropped = self.folder.truncate_logs(back_to)
        if dropped:
            self.watcher.rewound(back_to)
        self.records[:] = [record for record in self.records if record.step <= back_to]
        if self.recovery is not None:
            self._recovered(back_to, what, dropped, time.perf_counter() - started)
        elif self.start is not None:
            self.watcher.event(RunEvent(
                "resume", f"resumed from {self.start.path} at step {back_to + 1} "
                f"({dropped} logged steps after it will run again"
                f"{'; their lines moved to metrics.rewound.jsonl' if dropped else ''})", back_to))
        return lc.Restored(back_to)

    def _elapsed(self) -> float:
        """The run's seconds: this process's, after those of the run it resumed."""
        return self.resumed_s + time.perf_counter() - self.started

    def _checkpoint_to_restore(self) -> FoundCheckpoint | None:
        """The checkpoint a resume starts from until it is restored (a roll-back moves the later
        ones aside only then), afterwards the newest."""
        if self.start is not None and not self.start_restored:
            return self.start
        return newest_checkpoint(self.folder.checkpoints)

    def _evaluate_first(self) -> lc.Event:
        values, timings = self.evaluator.run(self._session(), 0, self.watcher.event)
        if values:
            self.evaluations.append((0, values))
            self.watcher.evaluated(StepRecord(0, self.graph.spec.trainer.steps, values, elapsed_s=self._elapsed()))
        for timing in timings:
            self.folder.append_node(0, timing)
        return lc.Evaluated(0)

    def _snapshot(self, step: int) -> lc.Event:
        """Copy the state aside on the workers and let it travel to the driver during the next
        step; the previous snapshot, which had a whole step to arrive, becomes the one a
        recovery restores."""
        self._settle_snapshot()
        self.pending_snapshot = (self._session().stage_snapshot(), self.kl.state_dict(), step)
        return lc.SnapshotTaken(step)

    def _settle_snapshot(self, lenient: bool = False) -> None:
        """Wait for the snapshot in flight, if any, and keep it. ``lenient``: after a fault, a
        snapshot whose worker was lost before it arrived is dropped (the one before serves);
        otherwise that loss raises, as any call's would."""
        if self.pending_snapshot is None:
            return
        pending, kl, step = self.pending_snapshot
        self.pending_snapshot = None
        try:
            taken = pending.result()
        except Exception:  # noqa: BLE001 - see lenient
            if lenient:
                return
            raise
        self.snapshot, self.snapshot_kl, self.snapshot_step = taken, kl, step

    def _run_step(self, step: int) -> lc.Event:
        """Every remote call of the step first; the record is written only when all of them
        succeeded, so a fault leaves no trace of the step."""
        session = self._session()
        num_steps = self.graph.spec.trainer.steps
        step_started = time.perf_counter()
        batch = self.source.next_batch(step - 1)
        trainer = self.graph.spec.trainer
        profile_dir = ""
        if step in trainer.torch_profile:
            profile_dir = str(self.folder.path.resolve() / "torch_profile" / f"step-{step}")
        reports = session.run_step(step, batch, self.kl.coefs(), profile_dir)
        step_s = time.perf_counter() - step_started
        devices = session.sample_devices()
        values: dict[str, float] = {}
        timings: list[Any] = []
        if self.evaluator.due(step):
            values, timings = self.evaluator.run(session, step, self.watcher.event)
        if profile_dir:
            self.watcher.event(RunEvent("profile", f"torch profile of step {step}: {profile_dir} (NODE.txt, "
                                                   "NODE.trace.json on each node's machine; a worker that cannot "
                                                   "write there writes to its temporary folder, "
                                                   f"{fallback_folder(profile_dir)})", step))
        samples: list[dict[str, Any]] = []
        if trainer.log_samples and (step % trainer.log_samples_every == 0 or step == num_steps):
            samples = session.samples(step, trainer.log_samples, self.graph.spec.runtime.node_timeout_s)
        metrics, nodes = step_metrics(self.graph, reports, step_s, num_devices=session.num_slots_in_use)
        self.kl.update(reports)
        metrics.update(self.source.length_metrics(batch))
        metrics.update(values)
        if values:
            self.evaluations.append((step, values))
        for timing in timings:
            self.folder.append_node(step, timing)
        record = StepRecord(step, num_steps, metrics, nodes, devices, self._elapsed(),
                            first_step=self.machine.first_step, resumed_s=self.resumed_s)
        with self.interrupt.held():
            self.records.append(record)
            self.watcher.step(record)
            self.folder.append_samples(step, samples)
        self.nonfinite.check(record, self.watcher)
        self.rewards.check(step, reports, self.watcher.event)
        self.replanner.after_step(record, step_s)
        self._retune_snapshots()
        # The run's length is judged from this step's time once two steps are done: the first
        # ones warm up (the models' first shapes), and the time since the driver started
        # counts building the models too; at step 1 of the 120-step quick start that average
        # (about 0.7 s per step) called for a spare a 12 s run never needs.
        remaining_s = (num_steps - step) * step_s
        if not self.standby_started and step - self.machine.first_step >= 2 and remaining_s > STANDBY_MIN_REMAINING_S:
            self._start_standby()
        return lc.StepDone(step)

    def _start_standby(self) -> None:
        self.standby_started = True
        self.cluster.keep_standby(self.graph.spec.runtime.standby_workers)

    def _checkpoint(self, step: int) -> lc.Event:
        staging = self.folder.checkpoint_staging(step)
        try:
            self._session().save_models(staging, with_state=True)
        except BaseException:
            self.folder.discard_staging(staging)
            raise
        # the run's clock at the step, where a resume from this checkpoint sets it on
        elapsed_s = self.records[-1].elapsed_s if self.records and self.records[-1].step == step else self._elapsed()
        state = {"kl": self.kl.state_dict(), "scheduler": self.replanner.state_dict(), "elapsed_s": elapsed_s}
        final = self.folder.commit_checkpoint(staging, step, state, self.graph.spec.trainer.keep_checkpoints)
        self.watcher.event(RunEvent("checkpoint", f"saved {final}", step))
        return lc.CheckpointWritten(step)

    def _save_final(self, step: int) -> lc.Event:
        """final/ is the trained policy's directory (ready for from_pretrained); any other
        trained model (a critic, which AutoModelForTokenClassification opens) goes to
        final/<name>/ inside it. Weights are split at ``trainer.max_shard_size``."""
        session = self._session()
        staging = self.folder.path / ".final.tmp"
        final = self.folder.path / "final"
        for path in (staging, final):
            if path.exists():
                shutil.rmtree(path)
        session.save_models(staging, with_state=False)
        kinds = {name: self.graph.spec.models[name].kind for name in session.trained_models()}
        policies = sorted(name for name, kind in kinds.items() if kind == "policy")
        if len(policies) == 1:
            (staging / policies[0]).rename(final)
            for name in sorted(kinds):
                if name != policies[0]:
                    (staging / name).rename(final / name)
            shutil.rmtree(staging)
        else:
            staging.rename(final)
        self.watcher.event(RunEvent("final", f"saved {final}", step))
        self.folder.write_run_info({**self.folder.read_run_info(), "finished_steps": step})
        return lc.FinalSaved(step)

    def _await_workers(self, instruction: lc.AwaitWorkers) -> lc.Event:
        """A warm spare takes each lost or hung slot at once when there is one; else the slot
        waits for its worker's replacement, and a new worker is started for it when none
        came within ``NEW_WORKER_AFTER_S`` (its nanny may be gone too)."""
        started = time.perf_counter()
        if instruction.backoff_s:
            time.sleep(instruction.backoff_s)
        runtime = self.graph.spec.runtime
        wanted = set(instruction.slots)
        taken = self.cluster.take_over(wanted, set(instruction.hung))
        restart = sorted(set(instruction.hung) - set(taken))
        if restart:
            self.cluster.restart(restart, runtime.recovery_timeout_s)
        deadline = time.monotonic() + runtime.recovery_timeout_s
        new_after = time.monotonic() + NEW_WORKER_AFTER_S
        added: list[str] = []
        missing = sorted(wanted - self.cluster.alive())
        if missing:
            self.watcher.event(RunEvent(
                "waiting", f"waiting up to {runtime.recovery_timeout_s:g} s (runtime.recovery_timeout_s) for "
                f"{', '.join(missing)} to come back (a worker started again under the same name takes its slot"
                f"{JOINED_TAKERS if self.cluster.joined else ''}); after that the run goes on without them",
                self.machine.step))
        while not wanted <= self.cluster.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
            taken += self.cluster.take_over(wanted, set())
            for note in self.cluster.take_notes():
                self.watcher.event(RunEvent("warning", note, self.machine.step))
            if not added and time.monotonic() > new_after:
                added = self.cluster.add_workers(wanted - self.cluster.alive())
        back: list[str] = []
        if wanted <= self.cluster.alive():
            # a joined cluster's workers back under their own names: perhaps on another machine
            back = self.cluster.returned(wanted - set(taken))
            for note in self.cluster.take_notes():
                self.watcher.event(RunEvent("warning", note, self.machine.step))
        self._note_machines(set(taken) | set(back))
        if self.recovery is not None:
            self.recovery.workers_s += time.perf_counter() - started
            if taken:
                # a warm spare of a local cluster, or a worker started on a joined one: the slot
                # keeps its name, another worker serves it
                self.recovery.what.extend(f"slot {slot} now served by worker {self.cluster.worker_of(slot)}"
                                          for slot in sorted(set(taken)))
            if added:
                self.recovery.what.append(f"new worker(s) {', '.join(added)} started")
        if wanted <= self.cluster.alive():
            return lc.WorkersJoined(instruction.slots)
        return lc.DeadlinePassed(tuple(sorted(wanted - self.cluster.alive())))

    def _note_machines(self, taken: set[str]) -> None:
        """On a joined cluster, tell the policy each slot's device and machine as the worker
        that took it reports them: it may be another machine (cores, speed), and the
        planner's sharing of cores and its calibration go by the machine."""
        if not taken or not self.cluster.joined:
            return
        inventory = self.cluster.inventory()
        events: list[DeviceReplaced] = []
        for slot in sorted(taken):
            device, machine = inventory.by_id(slot), self.cluster.machine_of(slot)
            if device is not None and machine is not None:
                events.append(DeviceReplaced(device, machine))
        self.replanner.note(events)

    def _shrink(self, gone: tuple[str, ...]) -> lc.Event:
        """The replacements did not come in time: place the plan again onto the survivors."""
        step = self.machine.step
        alive = self.cluster.alive()
        survivors = [slot.name for slot in self.cluster.slots if slot.name in alive]
        try:
            shrunk = self.replanner.shrink(step, list(gone), survivors)
        except PlacementError as problem:
            raise RunStopped(f"step {step}: {problem}; the run stopped: {self._kept('once the cluster has workers again')}"
                             ) from None
        self.folder.write_plan(step, {"runtime": shrunk.to_dict(), "reason": f"lost {', '.join(gone)}"})
        self.watcher.event(RunEvent(
            "replan",
            f"step {step}: {', '.join(gone)} did not come back within "
            f"{self.graph.spec.runtime.recovery_timeout_s:g} s (runtime.recovery_timeout_s); re-planned onto "
            f"{', '.join(sorted(set(shrunk.node_slots.values())))}: {'; '.join(shrunk.reasons)}",
            step,
        ))
        return lc.Shrunk()

    # ---- faults -----------------------------------------------------------------------

    def fault_of(self, error: BaseException, instruction: lc.Instruction) -> lc.Fault:
        """Whether ``error`` came from a lost or hung worker (retried) or from anything else
        (not retried). The driver hears of a dead worker (its calls fail) before the
        scheduler does: an error that looks like a connection loss waits up to
        ``LOSS_NOTICE_S`` for the scheduler to agree."""
        detail = f"{type(error).__name__}: {error}"
        if isinstance(error, WorkerLost):
            return lc.Fault("lost", error.slots, detail)
        if isinstance(error, NodeTimeout):
            return timeout_fault(error, detail, self._lost)
        if isinstance(error, FlowrlError) or isinstance(instruction, lc.ShrinkPlan):
            return lc.Fault("error", (), detail)
        if not self.cluster.connected() and self.cluster.reconnect_s > 0:
            # Dask tries to reach a lost scheduler for its connect timeout before giving up:
            # said now, not only when the run stops
            step = self.machine.step
            self.watcher.event(RunEvent(
                "warning", f"step {step}: the connection to the Dask scheduler {self.graph.spec.runtime.scheduler_address} "
                f"was lost; waiting up to {self.cluster.reconnect_s:.0f} s for it to come back before the run stops",
                step))
        in_use = set(self.addresses) if self.session is None else set(self.session.hosts) | set(self.addresses)
        lost = self._lost(in_use, LOSS_NOTICE_S if _looks_lost(error) else 0.0)
        if lost:
            return lc.Fault("lost", tuple(lost), detail)
        return lc.Fault("error", (), detail)

    def _hung_reward(self, error: Exception) -> Exception:
        """A reward function's call past ``runtime.node_timeout_s`` on workers that still answer
        is the function hanging (a call that never returns, a remote judge that never replies),
        not a worker fault. The first time, the step runs again on a new worker as for a hung
        one (a judge may have stalled once); the second time in a row, a RewardError stops the
        run, where more retries would each hang as long. Any other error as it is."""
        if not isinstance(error, NodeTimeout) or error.node is None:
            return error
        spec = self.graph.spec.nodes.get(error.node)
        if not isinstance(spec, ScoreNode) or spec.fn is None:
            return error
        addresses = [self.addresses[slot] for slot in error.slots if slot in self.addresses]
        if not addresses or not _all_answer(self.cluster, addresses):
            return error  # hung or lost, as it was: a new worker takes over
        hangs = self._reward_hangs[error.node] = self._reward_hangs.get(error.node, 0) + 1
        if hangs < 2:
            return error
        timeout = self.graph.spec.runtime.node_timeout_s
        return RewardError(
            f"the reward function '{spec.fn_name}' of score node '{error.node}' did not return within {timeout:g} s "
            f"(runtime.node_timeout_s), twice in a row, while its worker answers: the function hangs, and a new "
            f"worker waited on it as long; the run stopped at step {self.machine.step}"
            f"{resume_note(self.folder.checkpoints, 'fix the function, or give it more time')}")

    def _lost(self, in_use: set[str], wait_s: float) -> list[str]:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                now = self.cluster.addresses()
            except (OSError, TimeoutError, asyncio.TimeoutError) as error:
                raise self._scheduler_lost(error) from None
            lost = lost_slots(in_use, self.addresses, now)
            if lost or time.monotonic() >= deadline:
                return lost
            time.sleep(0.1)

    def _noticed(self, fault: lc.Fault) -> None:
        step = self.machine.step
        what = f"worker(s) {', '.join(fault.slots)} {'lost' if fault.kind == 'lost' else 'hung'}"
        self.watcher.event(RunEvent("fault", f"step {step}: {what} ({fault.detail})", step))
        if self.recovery is None:
            self.recovery = Recovery(time.perf_counter(), step)
        self.recovery.faults += 1

    def _recovered(self, back_to: int, source: str, dropped: int, restore_s: float) -> None:
        recovery = self.recovery
        assert recovery is not None
        self.recovery = None
        lost_s = time.perf_counter() - recovery.noticed
        how = f"; {', '.join(recovery.what)}" if recovery.what else ""
        more = f" after {recovery.faults} faults" if recovery.faults > 1 else ""
        session = self._session()
        self.watcher.event(RunEvent(
            "recovered",
            f"step {recovery.step}: roles rebuilt on slot(s) {', '.join(sorted(session.hosts))}{more}, state from {source}; "
            f"running again from step {back_to + 1} ({dropped} logged step(s)"
            f"{' moved to metrics.rewound.jsonl' if dropped else ' dropped'}){how}; "
            f"{lost_s:.1f} s lost "
            f"({recovery.workers_s:.1f} s getting workers, {recovery.build_s:.1f} s starting role hosts and "
            f"loading models, {restore_s:.1f} s restoring state)",
            recovery.step,
            {"lost_s": lost_s, "faults": recovery.faults, "workers_s": recovery.workers_s,
             "build_s": recovery.build_s, "restore_s": restore_s, "back_to": back_to},
        ))

    def _stop(self, stop: lc.Stop, error: BaseException | None, failed_at: lc.Instruction | None) -> None:
        if stop.reason == "interrupted":
            written = newest_written(self.folder.checkpoints)
            every = self.graph.spec.trainer.checkpoint_every
            if written is not None:
                kept = f"the newest checkpoint is {written}. {self._resume_hint()}"
            else:
                kept = (f"no checkpoint was written yet (trainer.checkpoint_every: {every}"
                        f"{', none at all' if every == 0 else ''}), so a resume would start over at step 1")
            raise RunInterrupted(f"{stop.message}; {kept}", self._interrupt_signal)
        if stop.reason == "error" and error is not None:
            writing = isinstance(failed_at, (lc.Checkpoint, lc.SaveFinal))
            if writing and (isinstance(error, CheckpointError) or not isinstance(error, FlowrlError)):
                what = (f"checkpoint step-{failed_at.step} to {self.folder.checkpoints}"
                        if isinstance(failed_at, lc.Checkpoint) else f"the final model to {self.folder.path / 'final'}")
                written = newest_written(self.folder.checkpoints)
                kept = (f"the checkpoint before it, {written}, is intact (free disk space or fix the folder, then "
                        f"`flowrl resume {self.folder.path}`)" if written is not None else
                        "no checkpoint was written before it (trainer.checkpoint_every sets how often one is), so "
                        "the steps trained are lost; free disk space or fix the folder and run again")
                if isinstance(error, CheckpointError):  # a worker's, which names what it could not write
                    raise CheckpointError(f"{error}; {kept}") from error
                raise CheckpointError(f"cannot write {what}: {type(error).__name__}: {error}; {kept}") from error
            raise error
        found = newest_checkpoint(self.folder.checkpoints)
        self.watcher.event(RunEvent("stopped", stop.message, self.machine.step - 1))  # the last step finished
        raise RunStopped(f"{stop.message}; the run stopped: {self._kept(newest=found.path if found else None, checked=True)}"
                         ) from None

    def _scheduler_lost(self, error: BaseException) -> RunStopped:
        """The scheduler itself is gone: no worker can be asked or replaced, so the run stops
        with what it kept."""
        step = self.machine.step
        message = (f"step {step}: the Dask scheduler cannot be reached ({type(error).__name__}: {str(error)[:200]}); "
                   f"the run stopped: {self._kept('once the scheduler and its workers are back')} (a scheduler at "
                   "another address: add runtime.scheduler_address=tcp://HOST:PORT)")
        self.watcher.event(RunEvent("stopped", message, step - 1))  # the last step finished
        return RunStopped(message)

    def _kept(self, when: str = "", newest: Path | None = None, checked: bool = False) -> str:
        """Which checkpoint a resume would start from and the command, ``when`` it can run,
        for a message about a stopped run; without one, that a resume would start over at
        step 1. ``checked``: ``newest`` is the newest intact checkpoint (None: none is
        intact), else the newest written is named."""
        written = newest if checked else newest_written(self.folder.checkpoints)
        later = f" {when}" if when else ""
        if written is None:
            none = "no intact checkpoint was written" if checked else "no checkpoint was written yet"
            return f"{none}, so a resume (`flowrl resume {self.folder.path}`){later} would start over at step 1"
        return f"the newest{' intact' if checked else ''} checkpoint is {written}. {self._resume_hint()}{later}"

    def _resume_hint(self) -> str:
        return (f"Resume it with `flowrl resume {self.folder.path}` (from Python: "
                f"`run(pipeline, output_dir='{self.folder.path}', resume=True)`)")

    def _session(self) -> Session:
        if self.session is None:
            raise lc.LifecycleError("no session: Build comes first")
        return self.session


ANSWER_S = 5.0
"""Seconds a worker has to answer the driver's question whether it is there at all."""


def _answer() -> bool:
    """Run on a worker: that it runs at all is the answer."""
    return True


def _all_answer(cluster: Cluster, addresses: list[str]) -> bool:
    """Whether every worker at ``addresses`` runs a function within ``ANSWER_S`` (a worker that
    never answers leaves the question behind, not the run)."""
    outcome = call_within(lambda: cluster.client.run(_answer, workers=addresses), ANSWER_S, "flowrl-answer")
    answers = outcome.result if outcome.finished and outcome.error is None else {}
    return all(answers.get(address) is True for address in addresses)


def timeout_fault(error: NodeTimeout, detail: str, lost_within: Callable[[set[str], float], list[str]]) -> lc.Fault:
    """The fault of a call past its deadline, or of a group whose collective failed.

    A rank of a group died (the others' collective fails at once) or stopped answering. In a
    group of CPU slots (gloo), a death the scheduler confirms within ``PEER_LOSS_NOTICE_S``
    (``lost_within(slots, wait_s)``) is a lost worker, and the other ranks keep their
    processes: their collective failed at once, and the rebuilt session forms a new group.
    Else the whole group counts as hung and restarts: a rank that stopped answering, and any
    group with a GPU slot, whose NCCL communicator may hang when torn down after a peer died
    or have the process killed by NCCL's error handling."""
    if error.collective and all(slot.startswith("cpu-") for slot in error.slots):
        lost = lost_within(set(error.slots), PEER_LOSS_NOTICE_S)
        if lost:
            return lc.Fault("lost", tuple(lost), detail)
    return lc.Fault("hung", error.slots, detail)


def _looks_lost(error: BaseException) -> bool:
    """A call that failed the way calls to a dead worker fail (connection, lost actor)."""
    for link in error_chain(error):
        text = f"{type(link).__name__}: {link}"
        if isinstance(link, OSError) or "lost" in text or "CommClosed" in text or "contact" in text:
            return True
    return False


STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")
"""Signals that stop a run as Ctrl-C does: a batch system's preemption or a job's end
(SIGTERM) and a closed terminal (SIGHUP) say where the run stopped and how to resume too."""


class _InterruptFlag:
    """A stop signal (``STOP_SIGNALS``) is remembered, so that the loop stops at the next
    instruction, and while an instruction is carried out (:meth:`armed`) it also raises
    KeyboardInterrupt, as Python's own handler does for SIGINT, to cut a long wait short.
    Between instructions it raises nothing: a KeyboardInterrupt there would escape the loop's
    handling (the run would end without saying where). Only the main thread may set signal
    handlers; elsewhere (a run started from a thread) nothing changes."""

    def __init__(self) -> None:
        self.raised = False
        self.signal = "SIGINT"
        """The name of the signal that came (SIGINT until one came)."""
        self._armed = False
        self._previous: dict[int, Any] = {}

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        self._armed = True
        try:
            yield
        finally:
            self._armed = False

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Inside an armed block: a stop signal waits for this block to end, and is raised
        then (a finished step's record reaches every file, the terminal and the trackers
        alike, or none of them). A tracker's call that hangs in it is left with the third
        stop signal, as a clean-up that hangs is."""
        armed, came = self._armed, self.raised
        self._armed = False
        try:
            yield
        finally:
            self._armed = armed
        if armed and self.raised and not came:
            raise KeyboardInterrupt

    def __enter__(self) -> _InterruptFlag:
        if threading.current_thread() is not threading.main_thread():
            return self
        for name in STOP_SIGNALS:
            number = getattr(signal, name, None)
            # A process started with a signal ignored (Ctrl-C in a script's background job,
            # SIGHUP under nohup) keeps ignoring it.
            if number is not None and signal.getsignal(number) is not signal.SIG_IGN:
                self._previous[number] = signal.signal(number, self._handle)
        handed_over()
        earlier = stopping_for()
        if earlier is not None:
            # the command was interrupted before the loop, and its KeyboardInterrupt was
            # swallowed on the way: the run stops after the first instruction all the same, as
            # the Ctrl-Cs after it are ignored
            self.raised, self.signal = True, earlier
        return self

    def __exit__(self, *exc: object) -> None:
        handed_over()
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        retry = took_retry()
        if retry and not owed():
            return  # a retry whose KeyboardInterrupt was raised already, or whose block ended
        first = not self.raised
        if first:
            self.signal = signal.Signals(signum).name
            note_stop_signal(self.signal)  # the handler handed back afterwards knows the stop is under way
        elif not retry:
            repeated_signal()  # the stop under way cleans up whole; the command leaves at the third
        self.raised = True
        # a second one would cut short what the first one's stop cleans up; one inside an
        # import waits for it to end (a half-imported library fails later)
        if self._armed and (first or retry):
            raise_outside_imports(signum, frame, retry)
        elif retry:
            handed_over()  # the block ended: the loop stops on ``raised``
