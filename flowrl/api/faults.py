"""Surviving a lost or hung worker, and updates that go non-finite.

A worker that dies mid-step (its process killed, its machine gone) makes the step's calls
fail; one that hangs makes a node run past ``runtime.node_timeout_s`` and is restarted. Either
way the run treats it as a placement event: it waits for the worker's replacement (the nanny
starts one under the same name), builds every role again on a fresh session, puts back the
newest snapshot of the trained models (kept by the driver every ``runtime.snapshot_every``
steps; else the newest checkpoint), and runs the interrupted step again. Steps after the
snapshot are dropped from the metric files before they run again, so ``metrics.jsonl`` never
has a gap or a step twice. ``events.jsonl`` gets a ``fault`` line (what failed) and a
``recovered`` line (what was done, the time lost).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Protocol

from flowrl.api.outputs import RunFolder
from flowrl.api.recovery import newest_checkpoint
from flowrl.errors import ClusterError, FlowrlError, NodeTimeout, PlacementError
from flowrl.graph import PipelineGraph
from flowrl.planner.placement import Plan, without_slots
from flowrl.records import RunEvent, StepRecord
from flowrl.roles.update import NONFINITE_METRIC
from flowrl.runtime.cluster import Cluster
from flowrl.runtime.session import Session



LOSS_NOTICE_S = 15.0
"""Longest wait for the scheduler to see a worker loss that the driver already saw."""
AUTO_SNAPSHOT_PARAMETERS = 50_000_000
"""Up to this many trained parameters, ``snapshot_every: null`` snapshots every step: pulling
weights and optimizer to the driver costs little next to a step. Above, checkpoints serve."""


class Events(Protocol):
    def event(self, event: RunEvent) -> None: ...


class KLState(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class FaultHandler:
    """Snapshots the trained models as the run goes, and rebuilds the session after a fault."""

    def __init__(self, graph: PipelineGraph, cluster: Cluster, folder: RunFolder, events: Events,
                 base_dir: Path | None, trained_parameters: int) -> None:
        self.graph = graph
        every = graph.spec.runtime.snapshot_every
        if every is None:
            every = 1 if trained_parameters <= AUTO_SNAPSHOT_PARAMETERS else 0
        self.snapshot_every = every
        self.cluster = cluster
        self.folder = folder
        self.events = events
        self.base_dir = base_dir
        self.recoveries = 0
        self._addresses = cluster.addresses()
        """The workers the current session's roles were built on."""
        self._snapshot: dict[str, Any] | None = None
        self._snapshot_step = 0
        self._kl_state: dict[str, Any] = {}

    def remember(self, session: Session, step: int, kl: KLState) -> None:
        """Snapshot after ``step`` (0: before the first) when ``snapshot_every`` says so."""
        every = self.snapshot_every
        if every and step % every == 0:
            self._snapshot = session.snapshot()
            self._snapshot_step = step
            self._kl_state = kl.state_dict()

    def recover(self, error: BaseException, session: Session, step: int, kl: KLState, replanner: Any,
                records: list[StepRecord]) -> tuple[Session, int]:
        """A new session after a lost or hung worker, and the step to run next; re-raises
        ``error`` when no worker was lost (a bug or bad input is not retried)."""
        in_use = set(session.hosts)
        hung = sorted(error.slots) if isinstance(error, NodeTimeout) else []
        lost = self._lost(in_use, wait_s=LOSS_NOTICE_S if not hung and _looks_lost(error) else 0.0)
        if not lost and not hung:
            raise error
        runtime = self.graph.spec.runtime
        what = f"worker(s) {', '.join(lost)} lost" if lost else f"worker(s) {', '.join(hung)} hung"
        self.events.event(RunEvent("fault", f"step {step}: {what} ({type(error).__name__}: {error})", step))
        if self.recoveries >= runtime.max_recoveries:
            raise ClusterError(
                f"step {step}: {what}, after {self.recoveries} recoveries already (runtime.max_recoveries); "
                f"the run stopped. Resume it with `flowrl resume {self.folder.path}`"
            ) from error
        self.recoveries += 1
        started = time.perf_counter()
        if hung:
            self.cluster.restart(hung, runtime.recovery_timeout_s)
        plan = session.plan
        if not self.cluster.wait_for(in_use, runtime.recovery_timeout_s):
            plan = self._without_lost(plan, in_use, step, error)
        came_back = time.perf_counter()
        session.release(set(lost) | set(hung))
        fresh = Session(self.cluster, self.graph, plan, self.base_dir)
        hosts_started = time.perf_counter()
        fresh.load_models()
        back_to, source = self._restore(fresh, kl)
        restored = time.perf_counter()
        dropped = self.folder.truncate_logs(back_to)
        records[:] = [record for record in records if record.step <= back_to]
        replanner.session = fresh
        self._addresses = self.cluster.addresses()
        lost_s = time.perf_counter() - started
        self.events.event(RunEvent(
            "recovered",
            f"step {step}: roles rebuilt on {', '.join(sorted(fresh.hosts))}, state from {source}; "
            f"running again from step {back_to + 1} ({dropped} logged step(s) dropped); {lost_s:.1f} s lost "
            f"({came_back - started:.1f} s waiting for the worker, {hosts_started - came_back:.1f} s starting "
            f"role hosts, {restored - hosts_started:.1f} s loading and restoring models)",
            step,
        ))
        return fresh, back_to + 1

    def _without_lost(self, plan: Plan, in_use: set[str], step: int, error: BaseException) -> Plan:
        """The replacement did not come in time: re-plan onto the workers still there."""
        alive = self.cluster.alive()
        gone = in_use - alive
        survivors = [slot.name for slot in self.cluster.slots if slot.name in alive]
        try:
            shrunk = without_slots(self.graph, plan, gone, survivors, step)
        except PlacementError as problem:
            raise ClusterError(
                f"step {step}: {problem}; the run stopped. Resume it with `flowrl resume {self.folder.path}` "
                "once the cluster has workers again"
            ) from error
        self.folder.write_plan(step, {"runtime": shrunk.to_dict(), "reason": f"lost {', '.join(sorted(gone))}"})
        self.events.event(RunEvent(
            "replan",
            f"step {step}: {', '.join(sorted(gone))} did not come back within "
            f"{self.graph.spec.runtime.recovery_timeout_s:g} s (runtime.recovery_timeout_s); re-planned onto "
            f"{', '.join(sorted(set(shrunk.node_slots.values())))}: {'; '.join(shrunk.reasons)}",
            step,
        ))
        return shrunk

    def _lost(self, in_use: set[str], wait_s: float) -> list[str]:
        """Slots whose worker is gone or was replaced since the roles were built. The driver
        hears of a dead worker (its calls fail) before the scheduler does: a connection
        error waits up to ``wait_s`` for the scheduler to agree."""
        deadline = time.monotonic() + wait_s
        while True:
            now = self.cluster.addresses()
            lost = sorted(slot for slot in in_use if now.get(slot) != self._addresses.get(slot))
            if lost or time.monotonic() >= deadline:
                return lost
            time.sleep(0.1)

    def _restore(self, session: Session, kl: KLState) -> tuple[int, str]:
        if self._snapshot is not None:
            session.restore(self._snapshot)
            kl.load_state_dict(self._kl_state)
            return self._snapshot_step, f"the in-memory snapshot of step {self._snapshot_step}"
        found = newest_checkpoint(self.folder.checkpoints)
        if found is None:
            return 0, "the initial models (no snapshot, no checkpoint)"
        session.load_checkpoint(found.path)
        kl.load_state_dict(found.trainer_state.get("kl", {}))
        return found.step, f"checkpoint {found.path.name}"


def _looks_lost(error: BaseException) -> bool:
    """A call that failed the way calls to a dead worker fail (connection, lost actor)."""
    chain: BaseException | None = error
    while chain is not None:
        text = f"{type(chain).__name__}: {chain}"
        if isinstance(chain, OSError) or "lost" in text or "CommClosed" in text or "contact" in text:
            return True
        chain = chain.__cause__ or chain.__context__
    return False


class NonFiniteGuard:
    """Counts updates skipped for a non-finite loss; too many in a row stop the run."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_a_row = 0

    def check(self, record: StepRecord, events: Events) -> None:
        if not record.metrics.get(NONFINITE_METRIC):
            self.in_a_row = 0
            return
        self.in_a_row += 1
        events.event(RunEvent(
            "warning", f"step {record.step}: the update's loss or gradient was NaN or infinite; the update was skipped",
            record.step))
        if self.in_a_row >= self.limit:
            raise FlowrlError(
                f"step {record.step}: {self.in_a_row} updates in a row had a NaN or infinite loss or gradient "
                "(trainer.max_nonfinite_updates); the run stopped, its newest checkpoint is kept. Lower the "
                "learning rate or check the reward scale, then resume"
            )
