"""What a run does before its first step: the driver's imports, the checks before any worker
starts, and a local cluster that starts while the driver sets up."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from flowrl.backends import arith_model, builtin, tiny_rm
from flowrl.backends.catalog import BUILTIN_MODELS, builtin_folder

ROOT = Path(__file__).resolve().parents[2]


def test_the_driver_imports_neither_transformers_nor_the_roles() -> None:
    # transformers costs the driver seconds of start-up; only the workers load models
    code = ("import sys, flowrl.api.run, flowrl.cli.main; "
            "print(sorted(m for m in ('transformers', 'flowrl.roles.registry', 'flowrl.roles.generate') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_checks_before_the_workers_start_import_neither_torch_nor_dask() -> None:
    # they run before the local cluster starts: torch there would delay the workers' start
    code = "import sys, flowrl.api.checks; print(sorted(m for m in ('torch', 'distributed') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(("override", "expected"), [
    # placed at the override that brought the mistake in
    ("nodes.reward.fn=nope", "command line: nodes.reward.fn=nope: unknown reward function 'nope'"),
    ("data.source=no/such/prompts.jsonl",
     "command line: data.source=no/such/prompts.jsonl: data source 'no/such/prompts.jsonl' not found"),
])
def test_the_usual_mistakes_are_reported_before_any_worker_starts(
    override: str, expected: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from flowrl.cli.main import app
    from flowrl.runtime import cluster

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a local cluster was started")

    monkeypatch.setattr(cluster, "PendingCluster", refuse)
    monkeypatch.setattr(cluster.Cluster, "start_local", refuse)
    result = CliRunner().invoke(app, ["run", str(ROOT / "pipelines" / "grpo_tiny.yaml"), override,
                                      "-o", str(tmp_path / "out"), "--plain"])
    assert result.exit_code == 2, result.output
    assert expected in result.output


def test_a_fresh_run_into_an_earlier_run_s_checkpoints_is_refused_before_any_worker_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from flowrl.cli.main import app
    from flowrl.runtime import cluster

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a local cluster was started")

    monkeypatch.setattr(cluster, "PendingCluster", refuse)
    monkeypatch.setattr(cluster.Cluster, "start_local", refuse)
    (tmp_path / "out" / "checkpoints" / "step-2").mkdir(parents=True)
    result = CliRunner().invoke(app, ["run", str(ROOT / "pipelines" / "grpo_tiny.yaml"), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert f"the output folder {tmp_path / 'out'} holds checkpoints of an earlier run (step-2)" in result.output


def test_a_fresh_run_into_an_earlier_run_s_final_model_is_refused_and_a_resume_cannot_extend_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A run without checkpoints leaves only final/: a second fresh run would replace it, and a
    resume would train it over from step 1."""
    from typer.testing import CliRunner

    from flowrl.cli.main import app
    from flowrl.runtime import cluster

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a local cluster was started")

    monkeypatch.setattr(cluster, "PendingCluster", refuse)
    monkeypatch.setattr(cluster.Cluster, "start_local", refuse)
    out = tmp_path / "out"
    (out / "final").mkdir(parents=True)
    (out / "final" / "model.safetensors").write_bytes(b"weights")
    (out / "run.json").write_text('{"finished_steps": 3}')
    pipeline = str(ROOT / "pipelines" / "grpo_tiny.yaml")
    fresh = CliRunner().invoke(app, ["run", pipeline, "-o", str(out)])
    assert fresh.exit_code == 2, fresh.output
    assert f"holds the final model of an earlier run ({out / 'final'}), which this run would replace" in fresh.output
    resumed = CliRunner().invoke(app, ["run", pipeline, "-o", str(out), "--resume", "--steps", "5"])
    assert resumed.exit_code == 2, resumed.output
    assert "ended after 3 steps and kept no checkpoint" in " ".join(resumed.output.split())
    assert (out / "final" / "model.safetensors").read_bytes() == b"weights"
    # fewer steps than the newest checkpoint would save its weights as a shorter run's final model
    (out / "checkpoints" / "step-4").mkdir(parents=True)
    (out / "run.json").write_text('{"finished_steps": null}')
    short = CliRunner().invoke(app, ["run", pipeline, "-o", str(out), "--resume", "--steps", "3"])
    assert short.exit_code == 2, short.output
    assert "has a checkpoint of step 4, past the 3 steps asked for" in " ".join(short.output.split())


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_builtin_folder_names_what_the_builder_writes(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver checks for a built model by ``builtin_folder`` without importing its builder:
    the folder and the file written last must be the builder's own."""
    written: list[tuple[str, str]] = []

    def capture(target: Path, marker: str, build: Any, what: str, *args: Any) -> Path:
        written.append((target.name, marker))
        return target

    for module in (builtin, arith_model, tiny_rm):
        monkeypatch.setattr(module, "write_once", capture)
    from flowrl.backends.models import builtin_dir

    builtin_dir(name)
    assert written == [builtin_folder(name)]


@pytest.mark.integration
def test_a_pending_cluster_is_taken_when_it_has_the_run_s_settings_and_closed_otherwise() -> None:
    from flowrl.runtime.cluster import PendingCluster

    pending = PendingCluster(2)
    other = PendingCluster(1)
    assert other.take(2, False, False) is None  # other settings: closed, the run starts its own
    cluster = pending.take(2, False, False)
    assert cluster is not None
    try:
        assert sorted(slot.name for slot in cluster.slots) == ["cpu-0", "cpu-1"]
        assert cluster.client.submit(sum, [1, 2]).result() == 3
    finally:
        cluster.close()
    pending.discard()  # taken: the run that took it closes it, not discard


_FORKED_CLUSTER = """
import os, sys
from flowrl.runtime.cluster import Cluster
if __name__ == "__main__":
    cluster = Cluster.start_local(1)
    views = cluster.client.run(lambda: {"ppid": os.getppid(), "warm": "flowrl.runtime.warm" in sys.modules})
    timers = cluster.client.run(lambda dask_worker: {name: dask_worker.periodic_callbacks[name].callback_time
                                                     for name in ("tick", "monitor")})
    os.environ["FLOWRL_TEST_VARIABLE"] = "set after the server started"
    cluster.close()
    again = Cluster.start_local(1)
    seen = again.client.run(lambda: os.environ.get("FLOWRL_TEST_VARIABLE"))
    again.close()
    (view,) = views.values()
    (value,) = seen.values()
    (timer,) = timers.values()
    print(os.getpid(), view["ppid"], view["warm"], timer["tick"], timer["monitor"], value)
"""


@pytest.mark.integration
def test_cpu_workers_are_forked_from_one_warm_server_that_ends_with_the_process() -> None:
    import psutil

    done = subprocess.run([sys.executable, "-c", _FORKED_CLUSTER], capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert done.returncode == 0, done.stderr
    driver, server, warm, tick_ms, monitor_ms, value = done.stdout.split(maxsplit=5)
    # the worker's parent is the fork server (not the driver), which had imported the role
    # hosts for it
    assert server != driver and warm == "True"
    # a variable set in the driver after the server started still reaches a new worker
    assert value.strip() == "set after the server started"
    # the worker's event-loop tick and system monitor wake it seldom (Dask: 20 ms and 500 ms)
    assert (float(tick_ms), float(monitor_ms)) == (500.0, 2000.0)
    # the server was stopped (and reaped) when the process exited, not left to wind down
    assert not psutil.pid_exists(int(server))


@pytest.mark.integration
def test_the_workers_registered_come_from_the_scheduler_not_the_client_s_cached_copy() -> None:
    from distributed.client import SchedulerInfo

    from flowrl.runtime.cluster import Cluster

    cluster = Cluster.start_local(2)

    async def refreshed_by_the_periodic_callback(**kwargs: Any) -> None:
        # the client's periodic refresh (no workers, totals only) landing right after a
        # caller's own refresh, before the caller reads the cache
        cluster.client._scheduler_identity = SchedulerInfo({"workers": {}})

    try:
        cluster.client._update_scheduler_info = refreshed_by_the_periodic_callback  # type: ignore[method-assign]
        assert sorted(cluster.addresses()) == ["cpu-0", "cpu-1"]
        assert cluster.alive() == {"cpu-0", "cpu-1"}
    finally:
        cluster.close()


_UNGUARDED = """
import flowrl as fr
print("imported")
p = fr.Pipeline("unguarded")
actor = p.model("actor", path="builtin:tiny-llama")
rollout = p.generate(actor, p.source("builtin:digits", batch_size=2), n=2, max_new_tokens=4)
p.update(actor, rollout, p.advantage("grpo", p.score("digits", rollout)))
p.trainer(steps=1, output_dir="out")
fr.run(p)
"""


@pytest.mark.integration
def test_a_script_that_runs_without_the_main_guard_gets_one_short_error(tmp_path: Path) -> None:
    """Worker processes import the main script again: their import of it stops quietly at
    fr.run, and the script's own call fails with what to do, not with multiprocessing's
    start-up tracebacks from every worker."""
    script = tmp_path / "train.py"
    script.write_text(_UNGUARDED)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=180)
    said = done.stdout + done.stderr
    assert done.returncode == 1
    assert 'put that call under `if __name__ == "__main__":`' in said
    assert "bootstrapping phase" not in said and said.count("Traceback") == 1
    assert len(done.stderr.splitlines()) < 12, done.stderr


@pytest.mark.integration
def test_a_script_read_from_stdin_runs(tmp_path: Path) -> None:
    """``python - < train.py``: the main module's file is ``<stdin>``, which spawned workers
    cannot run again; they start as for ``python -c``."""
    guarded = _UNGUARDED.replace("fr.run(p)", 'if __name__ == "__main__":\n    print("steps", len(fr.run(p).records))')
    done = subprocess.run([sys.executable, "-"], input=guarded, capture_output=True, text=True, cwd=tmp_path,
                          timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "steps 1" in done.stdout and "Traceback" not in done.stderr


def test_files_in_the_working_directory_named_as_imported_modules_are_named_when_workers_fail(tmp_path: Path) -> None:
    """Workers start in the working directory, first on their import path: a random.py there
    replaces Python's random in them, and only their log said so."""
    import yaml  # noqa: F401 - imported by flowrl in any case

    from flowrl.runtime.cluster import _shadowing_hint

    assert _shadowing_hint(tmp_path) == ""
    (tmp_path / "notes.py").write_text("")
    (tmp_path / "random.py").write_text("def score(completions, **kwargs):\n    return [0.5] * len(completions)\n")
    (tmp_path / "yaml").mkdir()
    (tmp_path / "yaml" / "__init__.py").write_text("")
    assert _shadowing_hint(tmp_path) == (
        f" The working directory {tmp_path} holds random.py, yaml, named as modules Python or flowrl imports: the "
        "workers, which start there, import them instead; rename them, or run from another folder.")
    # a module of the folder's own (a reward's helper the driver imported from it) is no shadow
    import importlib
    import sys

    (tmp_path / "my_reward_helpers.py").write_text("WEIGHT = 2\n")
    sys.path.insert(0, str(tmp_path))
    try:
        importlib.import_module("my_reward_helpers")
        assert "my_reward_helpers" not in _shadowing_hint(tmp_path)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("my_reward_helpers", None)
