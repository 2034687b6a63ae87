"""Workers killed (SIGKILL, for real) at the moments between node calls: while the driver
samples the devices after a step, while another loss is being recovered, while a checkpoint
is written, and more times than ``runtime.max_recoveries`` allows. Each run either completes
with a continuous metrics file or stops with its message; none hangs."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from flowrl.api.recovery import checkpoint_problem, newest_checkpoint
from flowrl.api.run import run
from flowrl.errors import RunStopped
from flowrl.runtime.session import Session
from tests.integration.conftest import tiny_grpo

pytestmark = pytest.mark.integration
SPARE = {"standby_workers": 1}


def _steps(output: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (output / "metrics.jsonl").read_text().splitlines()]


def _events(output: Path, kind: str) -> list[dict[str, Any]]:
    lines = (output / "events.jsonl").read_text().splitlines()
    return [event for event in map(json.loads, lines) if event["kind"] == kind]


def kill_worker(session: Session, slot: str) -> None:
    """SIGKILL the worker process of ``slot`` and wait until the scheduler has seen it go."""
    address = session.cluster.addresses()[slot]
    pid = session.cluster.client.run(os.getpid, workers=[address])[address]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while session.cluster.addresses().get(slot) == address and time.monotonic() < deadline:
        time.sleep(0.02)


def kill_before(monkeypatch: pytest.MonkeyPatch, method: str, slot: str, when: Callable[..., bool]) -> list[int]:
    """Make ``Session.<method>`` kill ``slot``'s worker just before it runs, once, on the
    first call ``when(*args)`` accepts; returns a list that records that it happened."""
    original = getattr(Session, method)
    done: list[int] = []

    def wrapped(self: Session, *args: Any, **kwargs: Any) -> Any:
        if not done and when(*args, **kwargs):
            done.append(1)
            kill_worker(self, slot)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Session, method, wrapped)
    return done


def test_a_worker_killed_between_steps_while_the_devices_are_sampled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    killed = kill_before(monkeypatch, "sample_devices", "cpu-1", lambda: calls.append(1) or len(calls) == 3)
    output = tmp_path / "out"
    result = run(tiny_grpo(output, steps=5, runtime=SPARE), base_dir=tmp_path)
    assert killed
    assert _steps(output) == [1, 2, 3, 4, 5] and [r.step for r in result.records] == [1, 2, 3, 4, 5]
    fault, = _events(output, "fault")
    assert fault["step"] == 3 and "cpu-1" in fault["message"]
    recovered, = _events(output, "recovered")
    assert "running again from step 3" in recovered["message"]


def test_a_second_worker_killed_during_the_recovery_of_the_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    samples = []
    first = kill_before(monkeypatch, "sample_devices", "cpu-1", lambda: samples.append(1) or len(samples) == 2)
    # the first load after the fault (a recovery rebuilding roles) loses the other worker
    second = kill_before(monkeypatch, "load_models", "cpu-0", lambda: bool(first))
    output = tmp_path / "out"
    run(tiny_grpo(output, steps=4, runtime={**SPARE, "max_recoveries": 2}), base_dir=tmp_path)
    assert first and second
    assert _steps(output) == [1, 2, 3, 4]
    faults = _events(output, "fault")
    assert [f["step"] for f in faults] == [2, 2]
    assert "cpu-1" in faults[0]["message"] and "cpu-0" in faults[1]["message"]
    recovered, = _events(output, "recovered")
    assert "after 2 faults" in recovered["message"] and recovered["data"]["faults"] == 2


def test_a_worker_killed_while_a_checkpoint_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    killed = kill_before(monkeypatch, "save_models", "cpu-0",
                         lambda directory, with_state: with_state and "step-2" in str(directory))
    output = tmp_path / "out"
    run(tiny_grpo(output, steps=4, checkpoint_every=2, runtime=SPARE), base_dir=tmp_path)
    assert killed
    assert _steps(output) == [1, 2, 3, 4]
    fault, = _events(output, "fault")
    assert fault["step"] == 2
    found = newest_checkpoint(output / "checkpoints")
    assert found is not None and found.step == 4 and not found.skipped  # the last step's
    assert checkpoint_problem(output / "checkpoints" / "step-2") is None  # written again, intact
    assert not [path.name for path in (output / "checkpoints").iterdir() if not path.name.startswith("step-")]


def test_more_faults_than_max_recoveries_stop_the_run_with_a_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    kill_before(monkeypatch, "sample_devices", "cpu-1", lambda: calls.append(1) or len(calls) == 3)
    output = tmp_path / "out"
    with pytest.raises(RunStopped) as stopped:
        run(tiny_grpo(output, steps=5, checkpoint_every=2, runtime={"max_recoveries": 0}), base_dir=tmp_path)
    message = str(stopped.value)
    assert "1 fault within 100 steps (runtime.max_recoveries: 0" in message
    assert f"the newest intact checkpoint is {output / 'checkpoints' / 'step-2'}" in message
    assert f"flowrl resume {output}" in message and stopped.value.exit_code == 1
    assert _steps(output) == [1, 2]
    assert _events(output, "stopped")


def test_a_run_stopped_with_no_checkpoint_says_a_resume_starts_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    kill_before(monkeypatch, "sample_devices", "cpu-1", lambda: calls.append(1) or len(calls) == 2)
    output = tmp_path / "out"
    with pytest.raises(RunStopped) as stopped:
        run(tiny_grpo(output, steps=4, runtime={"max_recoveries": 0}), base_dir=tmp_path)
    assert (f"the run stopped: no intact checkpoint was written, so a resume (`flowrl resume {output}`) would start "
            "over at step 1") in str(stopped.value)
