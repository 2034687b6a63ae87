"""Real faults on a real LocalCluster: a worker process killed mid-step, the driver killed
with SIGKILL and resumed, updates that go NaN."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from flowrl.api.run import run
from flowrl.errors import FlowrlError
from flowrl.spec.loader import load_pipeline
from tests.integration.conftest import StopAtStep, tiny_grpo

pytestmark = pytest.mark.integration

def _reward_module(action: str) -> str:
    """A reward module (the digits reward) whose third call does ``action`` once: the fault
    lands in the middle of step 3, on whichever worker runs the score node."""
    return f'''
import os, signal, time
from pathlib import Path
from typing import Any

from flowrl.rewards.builtin import digit_match

MARK = Path(__file__).with_name("fault-done")


def score(completions, max_new_tokens, **kwargs):
    calls = Path(__file__).with_name("calls")
    count = int(calls.read_text()) + 1 if calls.exists() else 1
    calls.write_text(str(count))
    if count == 3 and not MARK.exists():
        MARK.write_text("x")
        {action}
    return digit_match(completions=completions, max_new_tokens=max_new_tokens)
'''


KILLER = _reward_module("os.kill(os.getpid(), signal.SIGKILL)")
SLEEPER = _reward_module("time.sleep(600)  # far past runtime.node_timeout_s")


def _steps(output: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (output / "metrics.jsonl").read_text().splitlines()]


def _events(output: Path) -> list[dict]:
    return [json.loads(line) for line in (output / "events.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(("snapshot_every", "restored_from", "again_from"), [
    (1, "the in-memory snapshot of step 2", 3),  # a snapshot every step
    (0, "checkpoint step-2", 3),                 # no snapshots: back to the newest checkpoint
    # left to the run: one at the start, the next after about 10 s of steps; checkpoint 2 is
    # newer than that snapshot of step 0, so the run goes back to it (on a machine so busy that
    # the first steps took seconds each, a snapshot of step 2 came first: either is step 2's state)
    (None, ("checkpoint step-2", "the in-memory snapshot of step 2"), 3),
])
def test_a_worker_killed_mid_step_is_replaced_and_the_run_completes(
    tmp_path: Path, snapshot_every: int | None, restored_from: str | tuple[str, ...], again_from: int
) -> None:
    (tmp_path / "killer.py").write_text(KILLER)
    output = tmp_path / "out"
    pipeline = tiny_grpo(output, steps=6, reward="killer:score", checkpoint_every=2,
                         runtime={"snapshot_every": snapshot_every})
    result = run(pipeline, base_dir=tmp_path)

    assert (tmp_path / "fault-done").exists()
    assert _steps(output) == [1, 2, 3, 4, 5, 6]  # no gap, no step twice
    assert [record.step for record in result.records] == [1, 2, 3, 4, 5, 6]
    kinds = [event["kind"] for event in _events(output)]
    assert "fault" in kinds and "recovered" in kinds and kinds[-1] == "final"
    fault = next(e for e in _events(output) if e["kind"] == "fault")
    recovered = next(e for e in _events(output) if e["kind"] == "recovered")
    assert fault["step"] == 3 and "lost" in fault["message"]
    sources = (restored_from,) if isinstance(restored_from, str) else restored_from
    assert any(source in recovered["message"] for source in sources), recovered["message"]
    assert f"running again from step {again_from}" in recovered["message"]
    assert " s lost" in recovered["message"]


def test_a_rank_of_a_sharded_update_killed_mid_step_is_replaced_and_the_run_completes(tmp_path: Path) -> None:
    # Both workers are ranks of the actor's sharding group; one dies in step 3. The survivor
    # leaves the dead group (its process's default group), the restarted worker joins a new
    # one, and the sharded model is restored from the snapshot of step 2.
    (tmp_path / "killer.py").write_text(KILLER)
    output = tmp_path / "out"
    spec = tiny_grpo(output, steps=5, reward="killer:score", runtime={"snapshot_every": 1}).to_dict()
    spec["models"]["actor"]["sharded"] = True
    spec["devices"]["actor_group"]["count"] = 2
    from flowrl.spec.loader import pipeline_from_dict

    graph = pipeline_from_dict(spec)
    result = run(graph, base_dir=tmp_path)
    assert (tmp_path / "fault-done").exists()
    assert _steps(output) == [1, 2, 3, 4, 5]
    assert [record.step for record in result.records] == [1, 2, 3, 4, 5]
    recovered = next(e for e in _events(output) if e["kind"] == "recovered")
    assert "the in-memory snapshot of step 2" in recovered["message"]
    plan = json.loads((output / "plan-0.json").read_text())["runtime"]
    assert len(plan["node_shards"]["train"]) == 2  # trained sharded over both workers
    # the update still ran on both ranks after the fault
    assert sorted(node.device for node in result.records[-1].nodes if node.node == "train") == ["cpu-0", "cpu-1"]


def test_a_worker_that_does_not_come_back_in_time_leaves_its_roles_to_the_survivor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A killed local worker is started again by its nanny (which lives in this process) at
    # once; its comeback is held back 5 s here, far past the run's recovery_timeout_s, so the
    # outcome does not depend on how fast a worker starts.
    import asyncio

    from distributed.nanny import WorkerProcess

    start = WorkerProcess.start

    async def slow_start(self: WorkerProcess) -> Any:
        if (tmp_path / "fault-done").exists():
            await asyncio.sleep(5)
        return await start(self)

    monkeypatch.setattr(WorkerProcess, "start", slow_start)
    (tmp_path / "killer.py").write_text(KILLER)
    output = tmp_path / "out"
    pipeline = tiny_grpo(output, steps=5, reward="killer:score",
                         runtime={"recovery_timeout_s": 0.05, "standby_workers": 0})  # no spare to take over
    run(pipeline, base_dir=tmp_path)
    assert _steps(output) == [1, 2, 3, 4, 5]
    waiting = next(e for e in _events(output) if e["kind"] == "waiting")
    assert waiting["step"] == 3 and "waiting up to 0.05 s (runtime.recovery_timeout_s) for cpu-" in waiting["message"]
    replan = next(e for e in _events(output) if e["kind"] == "replan")
    assert replan["step"] == 3 and "did not come back within 0.05 s" in replan["message"]
    plan = json.loads((output / "plan-3.json").read_text())["runtime"]
    assert len(set(plan["node_slots"].values())) == 1  # everything on the one worker left


def test_a_hung_worker_is_restarted_and_its_step_run_again(tmp_path: Path) -> None:
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    output = tmp_path / "out"
    pipeline = tiny_grpo(output, steps=5, reward="sleeper:score", runtime={"node_timeout_s": 5})
    run(pipeline, base_dir=tmp_path)
    assert (tmp_path / "fault-done").exists()
    assert _steps(output) == [1, 2, 3, 4, 5]
    fault = next(e for e in _events(output) if e["kind"] == "fault")
    assert fault["step"] == 3 and "hung" in fault["message"] and "did not finish within 5 s" in fault["message"]
    assert any(e["kind"] == "recovered" and "running again from step 3" in e["message"] for e in _events(output))


def _write_pipeline(folder: Path, output: Path, steps: int) -> Path:
    data = tiny_grpo(output, steps=steps, checkpoint_every=3).to_dict()
    path = folder / "pipeline.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-c", "from flowrl.cli.main import app; app()", *args]


def test_resume_after_kill_9_of_the_driver_ends_with_the_weights_of_an_uninterrupted_run(tmp_path: Path) -> None:
    steps = 8
    whole = tmp_path / "whole"
    run(load_pipeline(_write_pipeline(tmp_path, whole, steps)))

    killed = tmp_path / "killed"
    pipeline_file = _write_pipeline(tmp_path, killed, steps)
    process = subprocess.Popen(_cli("run", str(pipeline_file), "--plain"), start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not (killed / "checkpoints" / "step-6" / "trainer_state.json").exists():
        assert process.poll() is None and time.monotonic() < deadline, "the run ended before its step-6 checkpoint"
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)  # the driver and the workers it started
    process.wait()
    assert not (killed / "final").exists()

    # a resume to fewer steps than the run was started with says so (and the summary names
    # the steps this process trained); a resume to all of them then ends where an
    # uninterrupted run ends
    shorter = subprocess.run(_cli("resume", str(killed), "--plain", "--steps", "7"), capture_output=True, text=True)
    assert shorter.returncode == 0, shorter.stderr
    assert any(e["kind"] == "warning" and "trainer.steps is 7, fewer than the 8 steps" in e["message"]
               for e in _events(killed))
    assert "reward mean since the resume: step 7 " in shorter.stdout, shorter.stdout
    resumed = subprocess.run(_cli("run", str(pipeline_file), "--plain", "--resume"), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert _steps(killed) == list(range(1, steps + 1))
    assert any(e["kind"] == "resume" and "step 7" in e["message"] for e in _events(killed))
    assert any(e["kind"] == "resume" and "step 8" in e["message"] for e in _events(killed))
    expected = load_file(str(whole / "final" / "model.safetensors"))
    actual = load_file(str(killed / "final" / "model.safetensors"))
    assert expected.keys() == actual.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=1e-6)

    # resuming a finished run says so and trains nothing
    again = subprocess.run(_cli("resume", str(killed), "--plain"), capture_output=True, text=True)
    assert again.returncode == 0 and "already finished all 8 steps" in again.stdout
    fewer = subprocess.run(_cli("resume", str(killed), "--plain", "--steps", "5"), capture_output=True, text=True)
    assert fewer.returncode == 0 and "already finished 8 steps, more than the 5 asked for" in fewer.stdout

    # a changed pipeline is refused with what changed, exit code 2
    data = yaml.safe_load(pipeline_file.read_text())
    data["nodes"]["train"]["lr"] = 1e-3
    pipeline_file.write_text(yaml.safe_dump(data, sort_keys=False))
    changed = subprocess.run(_cli("run", str(pipeline_file), "--resume"), capture_output=True, text=True)
    assert changed.returncode == 2
    assert "the pipeline differs" in changed.stderr and "nodes.train.lr: 0.0005 -> 0.001" in changed.stderr
    assert "--force" in changed.stderr

    # a fresh run there would leave the old checkpoints for a later resume to take: refused;
    # --overwrite deletes them (and the old final model) and starts over
    fresh = subprocess.run(_cli("run", str(pipeline_file), "--plain"), capture_output=True, text=True)
    assert fresh.returncode == 2 and "Traceback" not in fresh.stderr
    # (two kept: the last step's is one of them)
    assert "holds checkpoints of an earlier run (step-7, step-8)" in fresh.stderr and "--overwrite" in fresh.stderr
    assert _steps(killed) == list(range(1, steps + 1))  # nothing of that run was touched
    over = subprocess.run(_cli("run", str(pipeline_file), "--plain", "--overwrite", "--steps", "4"),
                          capture_output=True, text=True)
    assert over.returncode == 0, over.stderr
    assert _steps(killed) == [1, 2, 3, 4]
    # every 3 steps, and the last one
    assert sorted(path.name for path in (killed / "checkpoints").glob("step-*")) == ["step-3", "step-4"]

    # more steps are no change of the pipeline: the run goes on from its last step's checkpoint
    config = killed / "config.yaml"
    assert "steps: 4" in config.read_text()
    extended = subprocess.run(_cli("resume", str(killed), "--plain", "--steps", "6"), capture_output=True, text=True)
    assert extended.returncode == 0, extended.stderr
    assert _steps(killed) == [1, 2, 3, 4, 5, 6] and "steps: 6" in config.read_text()
    assert any(e["kind"] == "resume" and "step 5" in e["message"] for e in _events(killed))
    # an edit of config.yaml itself is a change, refused without --force; with it, the
    # changes are recorded
    config.write_text(config.read_text().replace("lr: 0.001", "lr: 0.002"))
    edited = subprocess.run(_cli("resume", str(killed), "--plain"), capture_output=True, text=True)
    assert edited.returncode == 2 and "the pipeline differs" in edited.stderr
    assert "nodes.train.lr: 0.001 -> 0.002" in edited.stderr, edited.stderr
    config.write_text(config.read_text().replace("steps: 6", "steps: 7"))
    forced = subprocess.run(_cli("resume", str(killed), "--plain", "--force"), capture_output=True, text=True)
    assert forced.returncode == 0, forced.stderr
    assert any(e["kind"] == "warning" and "resumed with a pipeline that differs" in e["message"]
               and "nodes.train.lr: 0.001 -> 0.002" in e["message"] for e in _events(killed))
    # overrides of the saved config are changes too, named with where they came from
    overridden = subprocess.run(_cli("resume", str(killed), "nodes.train.lr=0.003", "--steps", "8", "--plain"),
                                capture_output=True, text=True)
    assert overridden.returncode == 2 and "the pipeline differs" in overridden.stderr
    assert "nodes.train.lr: 0.002 -> 0.003" in overridden.stderr and "Traceback" not in overridden.stderr
    clash = subprocess.run(_cli("resume", str(killed), "trainer.steps=8", "--steps", "8"), capture_output=True, text=True)
    assert clash.returncode == 2 and "--steps" in clash.stderr and "trainer.steps" in clash.stderr
    # the command line rolls back too: from the older of the two checkpoints kept
    older, newer = sorted((killed / "checkpoints").glob("step-*"), key=lambda path: int(path.name[5:]))
    rolled = subprocess.run(_cli("resume", str(killed), "--checkpoint", older.name, "--plain"),
                            capture_output=True, text=True)
    assert rolled.returncode == 0, rolled.stderr
    assert f"rolled back to {older.name}" in rolled.stdout and (killed / "rolled_back").is_dir()
    assert _steps(killed) == list(range(1, 8)) and newer.is_dir()  # written again by the steps after it
    # a damaged run record is said to be one, not taken for a run without a pipeline folder
    record = killed / "run.json"
    record.write_text(record.read_text()[:40])
    damaged = subprocess.run(_cli("resume", str(killed), "--plain"), capture_output=True, text=True)
    assert damaged.returncode == 2 and f"{record} cannot be read" in damaged.stderr, damaged.stderr


def test_a_resume_from_an_earlier_checkpoint_rolls_back_and_trains_the_same_steps_again(tmp_path: Path) -> None:
    """--checkpoint step-4 of a finished run of 6 steps: step-6 and the final model move into
    rolled_back/, steps 5 and 6 train again, and on a CPU with the same seed the new final
    model equals the one rolled back, bit for bit."""
    out = tmp_path / "out"
    pipeline = tiny_grpo(out, steps=6, checkpoint_every=2)
    run(pipeline)
    assert sorted(path.name for path in (out / "checkpoints").glob("step-*")) == ["step-4", "step-6"]
    with pytest.raises(FlowrlError, match=r"has no checkpoint step-3 to resume from \(its checkpoints: step-4, step-6\)"):
        run(pipeline, resume=True, checkpoint=3)
    with pytest.raises(FlowrlError, match="add --resume"):
        run(pipeline, checkpoint=4)
    # a roll-back that the checkpoint then refuses (forced past adapters it does not hold)
    # leaves the run as it was: nothing moved, the next plain resume would take step-6
    from flowrl.spec.loader import pipeline_from_dict

    adapted = pipeline.to_dict()
    adapted["models"]["actor"]["lora"] = {"rank": 4}
    with pytest.raises(FlowrlError, match="has no adapter/adapter_model.safetensors"):
        run(pipeline_from_dict(adapted), resume=True, checkpoint=4, force=True)
    assert not (out / "rolled_back").exists() and (out / "final").is_dir()
    assert json.loads((out / "run.json").read_text())["finished_steps"] == 6  # still a finished run
    assert sorted(path.name for path in (out / "checkpoints").glob("step-*")) == ["step-4", "step-6"]
    import flowrl as fr

    again = run(pipeline, resume=True, checkpoint=4)
    assert [record.step for record in again.records] == [5, 6] and _steps(out) == [1, 2, 3, 4, 5, 6]
    # read back from the folder: every step, the resumed ones as this process logged them
    logged = fr.load_run(out)
    assert [record.step for record in logged.records] == [1, 2, 3, 4, 5, 6] and logged.finished_steps == 6
    assert logged.metric("critic/score/mean")[4:] == pytest.approx(again.metric("critic/score/mean"), rel=1e-6)
    # the run's clock goes on from step 4's (it started again at 0 in each process)
    elapsed = [record.elapsed_s for record in logged.records]
    assert elapsed == sorted(elapsed) and again.records[0].resumed_s == pytest.approx(elapsed[3], abs=1e-3)
    assert json.loads((out / "checkpoints" / "step-4" / "trainer_state.json").read_text())["elapsed_s"] > 0
    (rolled,) = (out / "rolled_back").iterdir()
    assert rolled.name.startswith("after-step-4-")
    assert {p.name for p in rolled.iterdir()} >= {"events.jsonl", "final", "metrics.jsonl", "profile.jsonl", "step-6"}
    # the logs as they were: the rolled-back steps' lines kept there
    assert _steps(rolled) == [1, 2, 3, 4, 5, 6] and fr.load_run(rolled).finished_steps == 0
    before, after = load_file(rolled / "final" / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[key], after[key]) for key in before)
    assert any(e["kind"] == "warning" and f"rolled back to step-4: the later checkpoints and the final model were "
               f"moved to {rolled}" in e["message"] for e in _events(out))


def test_nan_updates_are_skipped_then_the_run_stops(tmp_path: Path) -> None:
    """A learning rate of 1e30 sends the weights to infinity in one step: every later loss
    is NaN, those updates are skipped, and the second in a row stops the run."""
    pipeline = tiny_grpo(tmp_path / "out", steps=10, lr=1e30, max_nonfinite_updates=2)
    with pytest.raises(FlowrlError, match="2 steps in a row skipped an update for a NaN or infinite loss"):
        run(pipeline)
    warnings = [e["step"] for e in _events(tmp_path / "out") if e["kind"] == "warning"]
    assert len(warnings) == 2 and warnings[1] == warnings[0] + 1
    skipped = [json.loads(line).get("actor/nonfinite_skipped") for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert skipped[-2:] == [1.0, 1.0] and skipped[0] == 0.0


def test_resume_restores_the_sampling_rng_of_a_generator_on_another_worker(tmp_path: Path) -> None:
    """Generation on one worker, the update on the other: a resumed run's sampling (and so
    its weights) continue exactly as in a run that was never stopped."""
    from flowrl.spec.loader import pipeline_from_dict

    def split(output: Path) -> Any:
        spec = tiny_grpo(output, steps=6, kl_coef=0.0, checkpoint_every=3).to_dict()
        spec["devices"]["gen_group"] = {"type": "cpu", "exclusive": True}
        spec["nodes"]["rollout"]["device_group"] = "gen_group"
        spec["models"].pop("reference")
        spec["devices"].pop("ref_group")
        return pipeline_from_dict(spec)

    run(split(tmp_path / "whole"))

    stopped = tmp_path / "stopped"
    with pytest.raises(KeyboardInterrupt):
        run(split(stopped), observer=StopAtStep(4))  # checkpoint step-3 is on disk
    assert (stopped / "checkpoints" / "step-3" / "actor" / "generators.pt").exists()
    run(split(stopped), resume=True)
    assert _steps(stopped) == [1, 2, 3, 4, 5, 6]
    expected = load_file(str(tmp_path / "whole" / "final" / "model.safetensors"))
    actual = load_file(str(stopped / "final" / "model.safetensors"))
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=1e-6)


def test_a_resume_with_no_checkpoint_starts_over_and_keeps_the_first_tries_lines_aside(tmp_path: Path) -> None:
    """Stopped after step 3 with no checkpoint written: the resume trains steps 1-4 again, and
    the lines of the steps the stopped run trained go to metrics.rewound.jsonl (they were
    overwritten before), its events stay in events.jsonl."""
    output = tmp_path / "out"
    pipeline = tiny_grpo(output, steps=4, own_ref_worker=False)
    with pytest.raises(KeyboardInterrupt):
        run(pipeline, observer=StopAtStep(3))
    assert not list((output / "checkpoints").glob("step-*"))
    first_try = (output / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in first_try] == [1, 2, 3]
    run(pipeline, resume=True)
    assert _steps(output) == [1, 2, 3, 4]
    assert (output / "metrics.rewound.jsonl").read_text().splitlines() == first_try
    events = [json.loads(line) for line in (output / "events.jsonl").read_text().splitlines()]
    assert [event["kind"] for event in events].count("stopped") == 1
    assert any("no intact checkpoint to resume from" in event["message"] for event in events)


def test_a_final_model_that_cannot_be_written_is_a_clear_error_that_says_what_was_kept(tmp_path: Path) -> None:
    """A full disk or a broken folder at the final save: what failed, and that without a
    checkpoint the steps are lost (a traceback from safetensors before)."""
    from flowrl.errors import CheckpointError

    output = tmp_path / "out"
    output.mkdir()
    (output / "final").write_text("a file where the final model's folder goes")
    with pytest.raises(CheckpointError, match=r"cannot write the final model to .*final: NotADirectoryError.*"
                                              r"no checkpoint was written before it"):
        run(tiny_grpo(output, steps=1))


def test_a_reward_function_that_never_returns_stops_the_run_naming_it(tmp_path: Path) -> None:
    """Past runtime.node_timeout_s with its worker still answering, the function hangs: the
    step runs again on a new worker once (a judge may stall once: the test above), and the
    second hang in a row stops the run (a RewardError, exit 2), where more recoveries would
    each wait as long."""
    from flowrl.errors import RewardError

    (tmp_path / "hang_rewards.py").write_text(
        "import time\n\ndef forever(completions, **kwargs):\n    time.sleep(3600)\n")
    pipeline = tiny_grpo(tmp_path / "out", steps=3, reward="hang_rewards:forever",
                         runtime={"node_timeout_s": 4})
    started = time.monotonic()
    with pytest.raises(RewardError, match=r"the reward function 'hang_rewards:forever' of score node '.+' did not "
                                          r"return within 4 s \(runtime.node_timeout_s\), twice in a row, while its worker answers"):
        run(pipeline, base_dir=tmp_path)
    assert time.monotonic() - started < 90
    assert sum(e["kind"] == "fault" for e in _events(tmp_path / "out")) == 1


def test_a_node_timeout_too_short_to_load_the_models_stops_the_run_before_any_step_and_names_the_setting(
        tmp_path: Path) -> None:
    """Loading the models outlasts a 1 ms ``runtime.node_timeout_s``: every retry times out too,
    the run stops at step 1 with the setting named, and its log says no step finished."""
    from flowrl.errors import RunStopped

    output = tmp_path / "out"
    with pytest.raises(RunStopped, match=r"step 1: NodeTimeout: loading models on cpu-\d(, cpu-\d)? did not finish within "
                                         r"0\.001 s \(runtime\.node_timeout_s\)"):
        run(tiny_grpo(output, steps=2, runtime={"node_timeout_s": 0.001}))
    events = [json.loads(line) for line in (output / "events.jsonl").read_text().splitlines()]
    stopped = [event for event in events if event["kind"] == "stopped"]
    assert [event["step"] for event in stopped] == [0]  # the last step finished: none
    assert (output / "metrics.jsonl").read_text() == ""
