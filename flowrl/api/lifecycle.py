"""The run's lifecycle as a pure state machine: events in, instructions out.

The driver loop (``api/driver.py``) carries out one instruction at a time and feeds back
what happened as one event; this module decides what comes next. It knows nothing of Dask,
torch or files, so every path through it (a loss before step 1, a second loss during a
recovery, a loss while a checkpoint is written) is tested by feeding it events.

    Build -> Restore -> [Evaluate 0] -> [Snapshot] -> Replan k -> RunStep k -> [Checkpoint k]
          -> [Snapshot k] -> Replan k+1 ... -> SaveFinal -> Finish

    Failed(lost | hung) anywhere -> AwaitWorkers -> WorkersJoined   -> Build -> Restore -> ...
                                                 -> DeadlinePassed  -> ShrinkPlan -> Build ...
    Failed(error) -> Stop (the error is the user's or a bug: it is not retried)
    more than ``max_recoveries`` faults within ``window_steps`` -> Stop (exit code 1)
    Interrupted -> Stop

A step's record is written only when every remote call of the step succeeded, so a fault at
any moment leaves the metric files at the last committed step; ``Restore`` goes back to the
newest snapshot (else checkpoint, else the initial models) and the steps after it run again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union

FaultKind = Literal["lost", "hung", "error"]


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    """lost: a worker died or was replaced; hung: a call ran past its deadline; error:
    anything else (bad input, a bug), which is not retried."""
    slots: tuple[str, ...]
    detail: str


# ---- events (what happened) -----------------------------------------------------------


@dataclass(frozen=True)
class Built:
    """Role hosts started and models loaded on the current plan."""


@dataclass(frozen=True)
class Restored:
    step: int
    """The step whose state the trained models now hold (0: the initial models)."""


@dataclass(frozen=True)
class Evaluated:
    step: int


@dataclass(frozen=True)
class SnapshotTaken:
    step: int


@dataclass(frozen=True)
class Replanned:
    step: int


@dataclass(frozen=True)
class StepDone:
    step: int


@dataclass(frozen=True)
class CheckpointWritten:
    step: int


@dataclass(frozen=True)
class FinalSaved:
    step: int


@dataclass(frozen=True)
class WorkersJoined:
    slots: tuple[str, ...]


@dataclass(frozen=True)
class DeadlinePassed:
    """The lost workers' replacements did not register in time."""

    slots: tuple[str, ...]


@dataclass(frozen=True)
class Shrunk:
    """The plan was placed again onto the workers still there."""


@dataclass(frozen=True)
class Failed:
    fault: Fault


@dataclass(frozen=True)
class Interrupted:
    signal: str = "SIGINT"
    finished: int = 0
    """The last step whose record was written: the step under way when it is that one."""


Event = Union[Built, Restored, Evaluated, SnapshotTaken, Replanned, StepDone, CheckpointWritten,
              FinalSaved, WorkersJoined, DeadlinePassed, Shrunk, Failed, Interrupted]


# ---- instructions (what to do next) -----------------------------------------------------


@dataclass(frozen=True)
class Build:
    """Start role hosts on the plan's workers (those already there are kept) and load models."""


@dataclass(frozen=True)
class Restore:
    source: Literal["initial", "snapshot", "checkpoint"]


@dataclass(frozen=True)
class Evaluate:
    step: int


@dataclass(frozen=True)
class Snapshot:
    step: int


@dataclass(frozen=True)
class Replan:
    """Let the scheduler decide before ``step``, and carry out a move it accepts."""

    step: int


@dataclass(frozen=True)
class RunStep:
    step: int


@dataclass(frozen=True)
class Checkpoint:
    step: int


@dataclass(frozen=True)
class SaveFinal:
    step: int


@dataclass(frozen=True)
class AwaitWorkers:
    """Get workers for ``slots`` again: restart the ``hung`` ones, take a warm standby or wait
    for the replacement, after ``backoff_s`` (a loss right after another)."""

    slots: tuple[str, ...]
    hung: tuple[str, ...]
    backoff_s: float


@dataclass(frozen=True)
class ShrinkPlan:
    gone: tuple[str, ...]


@dataclass(frozen=True)
class Stop:
    reason: Literal["error", "faults", "interrupted"]
    message: str
    fault: Fault | None = None


@dataclass(frozen=True)
class Finish:
    step: int


Instruction = Union[Build, Restore, Evaluate, Snapshot, Replan, RunStep, Checkpoint, SaveFinal,
                    AwaitWorkers, ShrinkPlan, Stop, Finish]

Phase = Literal["new", "building", "restoring", "evaluating", "snapshotting", "replanning",
                "stepping", "checkpointing", "finalizing", "awaiting", "shrinking", "finished", "stopped"]

BACKOFF_S = (0.0, 0.5, 1.0, 2.0, 4.0)
"""Pause before the n-th retry of one recovery: the first retry goes at once (the standby or
the replacement is usually there); a loss that keeps coming back waits longer each time."""


class LifecycleError(RuntimeError):
    """An event that cannot happen in the current phase: a bug in the driver loop."""


@dataclass
class Lifecycle:
    num_steps: int
    first_step: int = 1
    checkpoint_every: int = 0
    snapshot_every: int = 0
    evaluate_first: bool = False
    """Evaluate before step 1 (a fresh run whose evaluation is due at step 0)."""
    resumed_from: int | None = None
    """The checkpoint's step when the run resumes from one."""
    max_recoveries: int = 3
    window_steps: int = 100
    """Faults count against ``max_recoveries`` while their step is within this many steps of
    the newest fault, so a long run survives faults spread over it."""

    phase: Phase = "new"
    step: int = 0
    """The step to run next (or being run)."""
    snapshot_step: int | None = None
    checkpoint_step: int | None = None
    fault_steps: list[int] = field(default_factory=list)
    retries: int = 0
    """Faults since the last step that completed: picks the backoff."""
    pending: tuple[str, ...] = ()
    """Slots lost or hung in the recovery under way (a second loss adds to them)."""
    hung: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.step = self.first_step
        if self.resumed_from is not None:
            self.checkpoint_step = self.resumed_from

    def start(self) -> Instruction:
        if self.phase != "new":
            raise LifecycleError(f"start() in phase {self.phase}")
        self.phase = "building"
        return Build()

    def handle(self, event: Event) -> Instruction:
        if self.phase in ("new", "finished", "stopped"):
            raise LifecycleError(f"{type(event).__name__} after the run {self.phase}")
        if isinstance(event, Interrupted):
            if self.phase == "finalizing":
                where = f"after step {self.num_steps}, while the final model was saved"
            else:
                where = f"after step {self.step}" if event.finished >= self.step else f"during step {self.step}"
            return self._stop("interrupted", f"interrupted ({event.signal}) {where}")
        if isinstance(event, Failed):
            return self._failed(event.fault)
        expected = _EXPECTED[self.phase]
        if not isinstance(event, expected):
            names = " or ".join(kind.__name__ for kind in (expected if isinstance(expected, tuple) else (expected,)))
            raise LifecycleError(f"{type(event).__name__} in phase {self.phase} (expected {names})")
        return self._advance(event)

    # ---- the happy path ---------------------------------------------------------------

    def _advance(self, event: Event) -> Instruction:
        if isinstance(event, Built):
            self.phase = "restoring"
            return Restore(self._restore_source())
        if isinstance(event, Restored):
            self.step = event.step + 1
            if self.snapshot_step is not None and self.snapshot_step > event.step:
                # the newest snapshot was lost on its way and an older state came back: the
                # next one is due counting from there
                self.snapshot_step = event.step
            self.pending, self.hung = (), ()
            if self.evaluate_first:
                self.phase = "evaluating"
                return Evaluate(0)
            return self._snapshot_or_next(event.step)
        if isinstance(event, Evaluated):
            self.evaluate_first = False
            return self._snapshot_or_next(self.step - 1)
        if isinstance(event, SnapshotTaken):
            self.snapshot_step = event.step
            return self._next()
        if isinstance(event, Replanned):
            self.phase = "stepping"
            return RunStep(self.step)
        if isinstance(event, StepDone):
            self.retries = 0
            every = self.checkpoint_every
            # the last step too: a run with checkpoints can be resumed for more steps from its end
            if every and (event.step % every == 0 or event.step == self.num_steps):
                self.phase = "checkpointing"
                return Checkpoint(event.step)
            return self._after_step(event.step)
        if isinstance(event, CheckpointWritten):
            self.checkpoint_step = event.step
            return self._after_step(event.step)
        if isinstance(event, FinalSaved):
            self.phase = "finished"
            return Finish(event.step)
        if isinstance(event, WorkersJoined):
            self.phase = "building"
            return Build()
        if isinstance(event, DeadlinePassed):
            self.phase = "shrinking"
            return ShrinkPlan(event.slots)
        # Shrunk
        self.phase = "building"
        return Build()

    def _after_step(self, step: int) -> Instruction:
        self.step = step + 1
        return self._snapshot_or_next(step)

    def _snapshot_or_next(self, step: int) -> Instruction:
        every, last = self.snapshot_every, self.snapshot_step
        # Counted from the newest snapshot, so a cadence the driver changes mid-run (or a
        # restore from a checkpoint) neither skips nor doubles one.
        if every and (last is None or step - last >= every):
            self.phase = "snapshotting"
            return Snapshot(step)
        return self._next()

    def _next(self) -> Instruction:
        if self.step > self.num_steps:
            self.phase = "finalizing"
            return SaveFinal(self.num_steps)
        self.phase = "replanning"
        return Replan(self.step)

    def _restore_source(self) -> Literal["initial", "snapshot", "checkpoint"]:
        """The newer of the snapshot and the checkpoint (the snapshot when they are of one
        step: it is in memory)."""
        snapshot, checkpoint = self.snapshot_step, self.checkpoint_step
        if snapshot is not None and (checkpoint is None or snapshot >= checkpoint):
            return "snapshot"
        if checkpoint is not None:
            return "checkpoint"
        return "initial"

    # ---- faults -----------------------------------------------------------------------

    def _failed(self, fault: Fault) -> Instruction:
        if fault.kind == "error":
            return self._stop("error", fault.detail, fault)
        if self.phase == "shrinking":  # no placement fits the survivors: nothing left to retry
            return self._stop("faults", fault.detail, fault)
        self.fault_steps.append(self.step)
        recent = [step for step in self.fault_steps if step > self.step - self.window_steps]
        if len(recent) > self.max_recoveries:
            return self._stop(
                "faults",
                f"step {self.step}: {fault.detail}; {len(recent)} fault{'s' if len(recent) != 1 else ''} within "
                f"{self.window_steps} steps "
                f"(runtime.max_recoveries: {self.max_recoveries} per runtime.recovery_window_steps)",
                fault,
            )
        self.pending = tuple(sorted(set(self.pending) | set(fault.slots)))
        if fault.kind == "hung":
            self.hung = tuple(sorted(set(self.hung) | set(fault.slots)))
        backoff = BACKOFF_S[min(self.retries, len(BACKOFF_S) - 1)]
        self.retries += 1
        self.phase = "awaiting"
        return AwaitWorkers(self.pending, self.hung, backoff)

    def _stop(self, reason: Literal["error", "faults", "interrupted"], message: str, fault: Fault | None = None) -> Stop:
        self.phase = "stopped"
        return Stop(reason, message, fault)


_EXPECTED: dict[str, type | tuple[type, ...]] = {
    "building": Built,
    "restoring": Restored,
    "evaluating": Evaluated,
    "snapshotting": SnapshotTaken,
    "replanning": Replanned,
    "stepping": StepDone,
    "checkpointing": CheckpointWritten,
    "finalizing": FinalSaved,
    "awaiting": (WorkersJoined, DeadlinePassed),
    "shrinking": Shrunk,
}
