"""The run's state machine, driven by events alone: no Dask, no models."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from flowrl.api import lifecycle as lc

LOST = lc.Fault("lost", ("cpu-1",), "OSError: Unable to contact Actor's worker")
LOST_TOO = lc.Fault("lost", ("cpu-0",), "WorkerLost")
HUNG = lc.Fault("hung", ("cpu-0",), "node 'rollout' did not finish within 5 s")
BUG = lc.Fault("error", (), "ValueError: bad reward")


def ok(instruction: lc.Instruction) -> lc.Event:
    """The event of an instruction carried out without trouble."""
    if isinstance(instruction, lc.Build):
        return lc.Built()
    if isinstance(instruction, lc.Restore):
        return lc.Restored(RESTORE_STEP.get(instruction.source, 0))
    if isinstance(instruction, lc.Evaluate):
        return lc.Evaluated(instruction.step)
    if isinstance(instruction, lc.Snapshot):
        return lc.SnapshotTaken(instruction.step)
    if isinstance(instruction, lc.Replan):
        return lc.Replanned(instruction.step)
    if isinstance(instruction, lc.RunStep):
        return lc.StepDone(instruction.step)
    if isinstance(instruction, lc.Checkpoint):
        return lc.CheckpointWritten(instruction.step)
    if isinstance(instruction, lc.SaveFinal):
        return lc.FinalSaved(instruction.step)
    if isinstance(instruction, lc.AwaitWorkers):
        return lc.WorkersJoined(instruction.slots)
    if isinstance(instruction, lc.ShrinkPlan):
        return lc.Shrunk()
    raise AssertionError(instruction)


RESTORE_STEP: dict[str, int] = {}


def drive(machine: lc.Lifecycle, react: Callable[[lc.Instruction], lc.Event | None] = lambda _: None,
          limit: int = 500) -> list[lc.Instruction]:
    """Run the machine to its end; ``react`` may answer an instruction with another event
    (a fault) instead of its success. Returns every instruction, the last one included."""
    seen = [machine.start()]
    while not isinstance(seen[-1], (lc.Stop, lc.Finish)):
        instruction = seen[-1]
        event = react(instruction) or ok(instruction)
        if isinstance(instruction, lc.Restore) and isinstance(event, lc.Restored):
            # the driver restores what the machine asked for: the step it knows of
            source = instruction.source
            step = {"snapshot": machine.snapshot_step, "checkpoint": machine.checkpoint_step}.get(source) or 0
            event = lc.Restored(step)
        seen.append(machine.handle(event))
        assert len(seen) < limit
    return seen


def names(instructions: list[lc.Instruction]) -> list[str]:
    out = []
    for item in instructions:
        step = getattr(item, "step", None)
        out.append(type(item).__name__ + (f" {step}" if step is not None else ""))
    return out


def once(kind: type, step: int | None, event: lc.Event) -> Callable[[lc.Instruction], lc.Event | None]:
    """Answer the first ``kind`` instruction (of ``step``) with ``event``."""
    fired = []

    def react(instruction: lc.Instruction) -> lc.Event | None:
        if not fired and isinstance(instruction, kind) and (step is None or getattr(instruction, "step", None) == step):
            fired.append(True)
            return event
        return None

    return react


def test_an_undisturbed_run_in_order() -> None:
    machine = lc.Lifecycle(num_steps=4, checkpoint_every=2, snapshot_every=1, evaluate_first=True)
    assert names(drive(machine)) == [
        "Build", "Restore", "Evaluate 0", "Snapshot 0",
        "Replan 1", "RunStep 1", "Snapshot 1",
        "Replan 2", "RunStep 2", "Checkpoint 2", "Snapshot 2",
        "Replan 3", "RunStep 3", "Snapshot 3",
        # a checkpoint at the last step too: a resume for more steps starts from the run's end
        "Replan 4", "RunStep 4", "Checkpoint 4", "Snapshot 4",
        "SaveFinal 4", "Finish 4",
    ]


def test_a_worker_lost_before_step_1_is_awaited_and_the_run_starts_from_the_initial_models() -> None:
    machine = lc.Lifecycle(num_steps=2, snapshot_every=1)
    seen = drive(machine, once(lc.Build, None, lc.Failed(LOST)))
    assert names(seen)[:6] == ["Build", "AwaitWorkers", "Build", "Restore", "Snapshot 0", "Replan 1"]
    assert seen[1] == lc.AwaitWorkers(("cpu-1",), (), 0.0)
    assert seen[3] == lc.Restore("initial")
    assert isinstance(seen[-1], lc.Finish)


def test_a_second_loss_during_recovery_adds_its_slot_and_backs_off() -> None:
    machine = lc.Lifecycle(num_steps=5, snapshot_every=1)
    faults = iter([lc.Failed(LOST), lc.Failed(LOST_TOO)])

    def react(instruction: lc.Instruction) -> lc.Event | None:
        # the first loss in step 3, the second while the roles are rebuilt
        if isinstance(instruction, lc.RunStep) and instruction.step == 3 and machine.retries == 0:
            return next(faults, None)
        if isinstance(instruction, lc.Build) and machine.retries == 1:
            return next(faults, None)
        return None

    seen = drive(machine, react)
    awaits = [item for item in seen if isinstance(item, lc.AwaitWorkers)]
    assert awaits == [lc.AwaitWorkers(("cpu-1",), (), 0.0), lc.AwaitWorkers(("cpu-0", "cpu-1"), (), 0.5)]
    at = names(seen).index("RunStep 3")
    assert names(seen)[at:at + 9] == [
        "RunStep 3", "AwaitWorkers", "Build", "AwaitWorkers", "Build", "Restore", "Replan 3", "RunStep 3", "Snapshot 3"]
    assert seen[at + 5] == lc.Restore("snapshot")
    assert machine.fault_steps == [3, 3] and machine.retries == 0  # a completed step resets the backoff
    assert isinstance(seen[-1], lc.Finish)


def test_a_loss_during_a_checkpoint_write_goes_back_to_the_snapshot_and_writes_it_again() -> None:
    machine = lc.Lifecycle(num_steps=4, checkpoint_every=2, snapshot_every=1)
    seen = names(drive(machine, once(lc.Checkpoint, 2, lc.Failed(LOST))))
    at = seen.index("Checkpoint 2")
    assert seen[at:at + 8] == [
        "Checkpoint 2", "AwaitWorkers", "Build", "Restore", "Replan 2", "RunStep 2", "Checkpoint 2", "Snapshot 2"]
    assert machine.checkpoint_step == 4  # and the last step's


@pytest.mark.parametrize("kind", [lc.Replan, lc.RunStep, lc.Snapshot, lc.Evaluate])
def test_a_loss_during_a_migration_a_step_device_sampling_a_snapshot_or_an_evaluation_runs_the_step_again(
    kind: type,
) -> None:
    machine = lc.Lifecycle(num_steps=3, snapshot_every=1, evaluate_first=True)
    step = 0 if kind in (lc.Evaluate,) else 2
    seen = names(drive(machine, once(kind, step, lc.Failed(LOST))))
    assert seen[-2:] == ["SaveFinal 3", "Finish 3"]
    ran = [name for name in seen if name.startswith("RunStep")]
    if kind is lc.Evaluate:  # the step-0 evaluation is done again, then the run starts
        assert seen[:7] == ["Build", "Restore", "Evaluate 0", "AwaitWorkers", "Build", "Restore", "Evaluate 0"]
        assert ran == ["RunStep 1", "RunStep 2", "RunStep 3"]
    elif kind is lc.Snapshot:  # the snapshot of step 2 failed: back to step 1's
        assert ran == ["RunStep 1", "RunStep 2", "RunStep 2", "RunStep 3"]
    else:
        assert ran == ["RunStep 1", "RunStep 2", "RunStep 2", "RunStep 3"] if kind is lc.RunStep else \
            ["RunStep 1", "RunStep 2", "RunStep 3"]


def test_a_loss_while_the_final_model_is_saved_saves_it_again() -> None:
    machine = lc.Lifecycle(num_steps=2, snapshot_every=1)
    seen = names(drive(machine, once(lc.SaveFinal, 2, lc.Failed(LOST))))
    assert seen[-6:] == ["SaveFinal 2", "AwaitWorkers", "Build", "Restore", "SaveFinal 2", "Finish 2"]


def test_without_snapshots_a_recovery_goes_back_to_the_newest_checkpoint_else_the_initial_models() -> None:
    machine = lc.Lifecycle(num_steps=6, checkpoint_every=2, snapshot_every=0)
    seen = drive(machine, once(lc.RunStep, 5, lc.Failed(LOST)))
    at = names(seen).index("RunStep 5")
    assert seen[at + 3] == lc.Restore("checkpoint")
    assert names(seen)[at + 4:at + 6] == ["Replan 5", "RunStep 5"]

    machine = lc.Lifecycle(num_steps=3, snapshot_every=0)
    seen = drive(machine, once(lc.RunStep, 2, lc.Failed(LOST)))
    assert lc.Restore("initial") in seen[3:]
    assert names(seen).count("RunStep 1") == 2  # back to the start: step 1 runs again


def test_a_resumed_run_restores_its_checkpoint_first() -> None:
    machine = lc.Lifecycle(num_steps=6, first_step=5, resumed_from=4, snapshot_every=1)
    seen = drive(machine)
    assert seen[1] == lc.Restore("checkpoint")
    assert names(seen)[2:5] == ["Snapshot 4", "Replan 5", "RunStep 5"]


def test_a_hung_worker_is_named_for_restart() -> None:
    machine = lc.Lifecycle(num_steps=2, snapshot_every=1)
    seen = drive(machine, once(lc.RunStep, 1, lc.Failed(HUNG)))
    assert lc.AwaitWorkers(("cpu-0",), ("cpu-0",), 0.0) in seen


def test_a_replacement_that_does_not_come_shrinks_the_plan_onto_the_survivors() -> None:
    machine = lc.Lifecycle(num_steps=2, snapshot_every=1)
    fired = []

    def react(instruction: lc.Instruction) -> lc.Event | None:
        if isinstance(instruction, lc.RunStep) and not fired:
            fired.append(1)
            return lc.Failed(LOST)
        if isinstance(instruction, lc.AwaitWorkers):
            return lc.DeadlinePassed(("cpu-1",))
        return None

    assert names(drive(machine, react))[5:10] == ["AwaitWorkers", "ShrinkPlan", "Build", "Restore", "Replan 1"]

    machine = lc.Lifecycle(num_steps=2, snapshot_every=1)
    seen = drive(machine, lambda i: lc.Failed(LOST) if isinstance(i, lc.RunStep) else
                 lc.DeadlinePassed(("cpu-1",)) if isinstance(i, lc.AwaitWorkers) else
                 lc.Failed(lc.Fault("error", (), "no worker is left")) if isinstance(i, lc.ShrinkPlan) else None)
    assert seen[-1] == lc.Stop("error", "no worker is left", lc.Fault("error", (), "no worker is left"))


def test_faults_past_max_recoveries_within_the_window_stop_the_run_with_a_message() -> None:
    machine = lc.Lifecycle(num_steps=10, snapshot_every=1, max_recoveries=2, window_steps=100)
    seen = drive(machine, lambda i: lc.Failed(LOST) if isinstance(i, lc.RunStep) and i.step == 4 else None)
    stop = seen[-1]
    assert isinstance(stop, lc.Stop) and stop.reason == "faults"
    assert "3 faults within 100 steps" in stop.message and "runtime.max_recoveries: 2" in stop.message
    assert names(seen).count("AwaitWorkers") == 2
    with pytest.raises(lc.LifecycleError):
        machine.handle(lc.StepDone(4))  # nothing happens after a stop


def test_faults_spread_wider_than_the_window_never_stop_the_run() -> None:
    machine = lc.Lifecycle(num_steps=60, snapshot_every=1, max_recoveries=1, window_steps=10)
    hit: set[int] = set()

    def react(instruction: lc.Instruction) -> lc.Event | None:
        if isinstance(instruction, lc.RunStep) and instruction.step % 15 == 0 and instruction.step not in hit:
            hit.add(instruction.step)
            return lc.Failed(LOST)
        return None

    seen = drive(machine, react)
    assert isinstance(seen[-1], lc.Finish) and machine.fault_steps == [15, 30, 45, 60]


def test_an_error_that_is_not_a_lost_worker_stops_at_once() -> None:
    machine = lc.Lifecycle(num_steps=3, snapshot_every=1)
    seen = drive(machine, once(lc.RunStep, 2, lc.Failed(BUG)))
    assert seen[-1] == lc.Stop("error", BUG.detail, BUG)
    assert machine.fault_steps == []


@pytest.mark.parametrize("kind", [lc.Build, lc.Restore, lc.RunStep, lc.Checkpoint, lc.AwaitWorkers, lc.SaveFinal])
def test_an_interrupt_at_any_moment_stops(kind: type) -> None:
    machine = lc.Lifecycle(num_steps=2, checkpoint_every=1, snapshot_every=1)
    first_fault = once(lc.RunStep, 1, lc.Failed(LOST)) if kind is lc.AwaitWorkers else (lambda _: None)

    def react(instruction: lc.Instruction) -> lc.Event | None:
        if isinstance(instruction, kind):
            return lc.Interrupted()
        return first_fault(instruction)

    stop = drive(machine, react)[-1]
    assert isinstance(stop, lc.Stop) and stop.reason == "interrupted"


def test_an_interrupt_names_the_step_under_way_or_the_one_whose_record_was_written() -> None:
    """A signal that came as step 25's record was being written stopped the run with step 25
    in metrics.jsonl, and the message said 'during step 25'."""
    def stopped(finished: int) -> str:
        machine = lc.Lifecycle(num_steps=3)
        stop = drive(machine, once(lc.RunStep, 2, lc.Interrupted("SIGINT", finished)))[-1]
        assert isinstance(stop, lc.Stop)
        return stop.message

    assert stopped(1) == "interrupted (SIGINT) during step 2"
    assert stopped(2) == "interrupted (SIGINT) after step 2"
    machine = lc.Lifecycle(num_steps=3)
    stop = drive(machine, once(lc.SaveFinal, 3, lc.Interrupted("SIGTERM", 3)))[-1]
    assert isinstance(stop, lc.Stop) and stop.message == "interrupted (SIGTERM) after step 3, while the final model was saved"


PHASE_EVENTS: list[lc.Event] = [
    lc.Built(), lc.Restored(0), lc.Evaluated(0), lc.SnapshotTaken(0), lc.Replanned(1), lc.StepDone(1),
    lc.CheckpointWritten(1), lc.FinalSaved(1), lc.WorkersJoined(("cpu-1",)), lc.DeadlinePassed(("cpu-1",)),
    lc.Shrunk(), lc.Failed(LOST), lc.Failed(BUG), lc.Interrupted(),
]
ACCEPTS = {
    "building": lc.Built, "restoring": lc.Restored, "evaluating": lc.Evaluated, "snapshotting": lc.SnapshotTaken,
    "replanning": lc.Replanned, "stepping": lc.StepDone, "checkpointing": lc.CheckpointWritten,
    "finalizing": lc.FinalSaved, "awaiting": (lc.WorkersJoined, lc.DeadlinePassed), "shrinking": lc.Shrunk,
}


def machine_in(phase: str) -> lc.Lifecycle:
    """A machine driven (by successes and, for the recovery phases, one fault) to ``phase``."""
    machine = lc.Lifecycle(num_steps=2, checkpoint_every=1, snapshot_every=1, evaluate_first=True)
    instruction = machine.start()
    fault_sent = False
    for _ in range(50):
        if machine.phase == phase:
            return machine
        if phase in ("awaiting", "shrinking") and machine.phase == "stepping" and not fault_sent:
            fault_sent = True
            instruction = machine.handle(lc.Failed(LOST))
            continue
        if phase == "shrinking" and machine.phase == "awaiting":
            instruction = machine.handle(lc.DeadlinePassed(("cpu-1",)))
            continue
        instruction = machine.handle(ok(instruction))
    raise AssertionError(f"never reached {phase}")


@pytest.mark.parametrize("phase", sorted(ACCEPTS))
@pytest.mark.parametrize("event", PHASE_EVENTS, ids=lambda e: type(e).__name__ + (
    f"-{e.fault.kind}" if isinstance(e, lc.Failed) else ""))
def test_every_event_in_every_phase_has_a_defined_outcome(phase: str, event: lc.Event) -> None:
    machine = machine_in(phase)
    if isinstance(event, lc.Interrupted):
        assert machine.handle(event).reason == "interrupted"  # type: ignore[union-attr]
    elif isinstance(event, lc.Failed) and event.fault.kind == "error":
        assert machine.handle(event).reason == "error"  # type: ignore[union-attr]
    elif isinstance(event, lc.Failed):
        outcome = machine.handle(event)
        if phase == "shrinking":  # a loss while placing onto the survivors: nothing left to try
            assert isinstance(outcome, lc.Stop) and outcome.reason == "faults"
        else:
            assert isinstance(outcome, lc.AwaitWorkers) and "cpu-1" in outcome.slots
            assert machine.phase == "awaiting"
    elif isinstance(event, ACCEPTS[phase]):
        assert not isinstance(machine.handle(event), lc.Stop)
    else:
        with pytest.raises(lc.LifecycleError):
            machine.handle(event)


def test_events_before_start_or_after_the_end_are_bugs() -> None:
    machine = lc.Lifecycle(num_steps=1)
    with pytest.raises(lc.LifecycleError):
        machine.handle(lc.Built())
    drive(machine)
    assert machine.phase == "finished"
    with pytest.raises(lc.LifecycleError):
        machine.handle(lc.Failed(LOST))


def test_snapshots_are_counted_from_the_newest_one_when_the_cadence_changes() -> None:
    # The driver lengthens the cadence once it knows the step time (``snapshot_every: null``).
    machine = lc.Lifecycle(num_steps=9, snapshot_every=1)

    def react(instruction: lc.Instruction) -> lc.Event | None:
        if isinstance(instruction, lc.RunStep) and instruction.step == 1:
            machine.snapshot_every = 3
        return None

    seen = [name for name in names(drive(machine, react)) if name.startswith("Snapshot")]
    assert seen == ["Snapshot 0", "Snapshot 3", "Snapshot 6", "Snapshot 9"]


def test_a_recovery_to_an_older_state_counts_the_next_snapshot_from_that_state() -> None:
    # The snapshot of step 4 never arrived: the driver restored step 2's, and says so.
    machine = lc.Lifecycle(num_steps=8, snapshot_every=2)
    seen: list[lc.Instruction] = [machine.start()]
    fault_done = False
    while not isinstance(seen[-1], (lc.Stop, lc.Finish)):
        instruction = seen[-1]
        if isinstance(instruction, lc.RunStep) and instruction.step == 5 and not fault_done:
            fault_done = True
            event: lc.Event = lc.Failed(LOST)
        elif isinstance(instruction, lc.Restore) and fault_done:
            event = lc.Restored(2)
        else:
            event = ok(instruction)
        seen.append(machine.handle(event))
    after = names(seen)[names(seen).index("RunStep 5") + 1:]
    assert after[after.index("Replan 3"):after.index("Replan 3") + 6] == [
        "Replan 3", "RunStep 3", "Replan 4", "RunStep 4", "Snapshot 4", "Replan 5"]


def test_a_recovery_restores_a_checkpoint_newer_than_the_snapshot() -> None:
    # snapshots every 14 steps (a fast run's cadence), checkpoints every 5: a fault in step 12
    # goes back to checkpoint 10, not to the snapshot of step 0
    machine = lc.Lifecycle(num_steps=20, checkpoint_every=5, snapshot_every=14)
    seen = drive(machine, once(lc.RunStep, 12, lc.Failed(LOST)))
    at = names(seen).index("RunStep 12")
    assert lc.Restore("checkpoint") in seen[at:at + 4]
    assert names(seen)[at + 4:at + 6] == ["Replan 11", "RunStep 11"]
