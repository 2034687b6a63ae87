"""``--scheduler``: run on a separately started `dask scheduler` with two `dask worker` processes."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent
DASK = [sys.executable, "-m"]
"""``dask scheduler`` / ``dask worker`` as their modules (``distributed.cli.dask_*``): the
same programs, found wherever ``distributed`` is importable, with or without its scripts."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_for_port(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on port {port} after {timeout_s} s")


@contextlib.contextmanager
def dask_processes(folder: Path, workers: dict[str, tuple[dict[str, str], list[str]]]) -> Iterator[str]:
    """A `dask scheduler` and one `dask worker` per entry of ``workers`` (name -> extra
    environment, extra arguments), logs in ``folder``; yields the scheduler's address and
    stops them all on the way out."""
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    logs = [open(folder / f"{name}.log", "w") for name in ("scheduler", *workers)]
    processes = [
        subprocess.Popen(
            [*DASK, "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"],
            stdout=logs[0], stderr=subprocess.STDOUT, env=env,
        )
    ]
    try:
        _wait_for_port(port, 30)
        for (name, (extra_env, extra_args)), log in zip(workers.items(), logs[1:]):
            processes.append(
                subprocess.Popen(
                    [*DASK, "distributed.cli.dask_worker", address, "--name", name, "--nthreads", "1",
                     "--memory-limit", "0", "--no-dashboard", "--host", "127.0.0.1", *extra_args],
                    stdout=log, stderr=subprocess.STDOUT, env={**env, **extra_env},
                )
            )
        yield address
    finally:
        for process in reversed(processes):
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
        for log in logs:
            log.close()


@pytest.fixture
def dask_cluster(tmp_path: Path) -> Iterator[str]:
    with dask_processes(tmp_path, {"node-a": ({}, []), "node-b": ({}, [])}) as address:
        yield address


def test_run_joins_an_existing_scheduler(tmp_path: Path, dask_cluster: str, make_pipeline) -> None:
    from distributed import Client

    # The run waits for at least one worker; wait for both so that placement is stable.
    with Client(dask_cluster, timeout=30) as client:
        client.wait_for_workers(2, timeout=60)

    from flowrl.runtime.cluster import Cluster

    output = tmp_path / "out"
    command = [str(BIN / "flowrl"), "run", str(_write(make_pipeline(output, steps=4), tmp_path)),
               "--scheduler", dask_cluster, "--plain"]
    # Another run (here this test's own client) holds the cluster: the run is refused at once.
    other = Cluster.join(dask_cluster)
    try:
        other.claim("/runs/other")
        refused = subprocess.run(command, capture_output=True, text=True, timeout=300)
    finally:
        other.close()
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "Traceback" not in refused.stderr
    assert (f"another flowrl run is using the Dask cluster at {dask_cluster}: /runs/other (on "
            in " ".join(refused.stderr.split()))
    assert "give this run a scheduler and workers of its own" in " ".join(refused.stderr.split())
    # That run has left: its mark no longer counts.
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"Dask scheduler {dask_cluster}: 2 workers (node-a, node-b)" in result.stdout
    plan = json.loads((output / "plan-0.json").read_text())
    # The workers' own names are the device slots: the reference on one (its group is
    # exclusive), the actor's nodes on the other.
    slots = plan["runtime"]["node_slots"]
    assert {slots["rollout"], slots["ref"]} == {"node-a", "node-b"} and slots["train"] == slots["rollout"]
    steps = [json.loads(line)["step"] for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert (output / "final" / "model.safetensors").exists()
    with Client(dask_cluster, timeout=30) as client:  # the finished run took its mark off
        assert client.get_metadata(["flowrl", "run"], default=None) is None
    after = Cluster.join(dask_cluster)
    try:
        after.claim("/runs/after")
    finally:
        after.close()


def test_plan_and_devices_show_the_workers_of_a_running_scheduler(tmp_path: Path, dask_cluster: str,
                                                                    make_pipeline) -> None:
    from distributed import Client

    with Client(dask_cluster, timeout=30) as client:
        client.wait_for_workers(2, timeout=60)
    pipeline = _write(make_pipeline(tmp_path / "out", steps=4), tmp_path)
    shown = subprocess.run([str(BIN / "flowrl"), "devices", "--scheduler", dask_cluster, "--json"],
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert [device["id"] for device in json.loads(shown.stdout)["inventory"]["devices"]] == ["node-a", "node-b"]
    # the pipeline's own scheduler_address (here an override) is planned for as a run would place it
    for how in (["--scheduler", dask_cluster], [f"runtime.scheduler_address={dask_cluster}"]):
        planned = subprocess.run([str(BIN / "flowrl"), "plan", str(pipeline), *how, "--json"],
                                 capture_output=True, text=True, timeout=120)
        assert planned.returncode == 0, planned.stdout + planned.stderr
        devices = {device["device"] for device in json.loads(planned.stdout)["devices"]}
        assert devices <= {"node-a", "node-b"} and devices, planned.stdout
    with Client(dask_cluster, timeout=30) as client:  # planning left the cluster as it was
        assert len(client.scheduler_info()["workers"]) == 2


def _write(pipeline, folder: Path) -> Path:
    path = folder / "pipeline.yaml"
    path.write_text(pipeline.to_yaml())
    return path


def _run_to_step_3(pipeline: Path, address: str) -> subprocess.Popen[str]:
    """`flowrl run` on the scheduler at ``address`` once both its workers are there, read
    until step 3 is logged; the rest of its output is the caller's."""
    from distributed import Client

    with Client(address, timeout=30) as client:
        client.wait_for_workers(2, timeout=60)
    process = subprocess.Popen([str(BIN / "flowrl"), "run", str(pipeline), "--scheduler", address, "--plain"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("step 3/"):
            break
    return process


def test_a_lost_scheduler_stops_the_run_with_one_message(tmp_path: Path, make_pipeline) -> None:
    """The scheduler is killed mid-run: no worker can be asked or replaced, so the run stops
    (exit 1) saying so and what it kept, without a traceback."""
    output = tmp_path / "out"
    pipeline = _write(make_pipeline(output, steps=2000), tmp_path)
    with dask_processes(tmp_path, {"node-a": ({}, []), "node-b": ({}, [])}) as address:
        process = _run_to_step_3(pipeline, address)
        scheduler = next(child for child in _children_listening(address))
        scheduler.terminate()
        rest, _ = process.communicate(timeout=240)
    assert process.returncode == 1, rest
    assert "the Dask scheduler cannot be reached" in rest and "flowrl resume" in rest, rest
    # said when the connection went, not only after Dask's reconnect window (the join's 30 s)
    waiting = f"the connection to the Dask scheduler {address} was lost; waiting up to 30 s for it to come back"
    assert waiting in rest and rest.index(waiting) < rest.index("the Dask scheduler cannot be reached"), rest
    assert "Traceback" not in rest and "Failed to reconnect" not in rest, rest


def _children_listening(address: str) -> Iterator[Any]:
    """The scheduler process of ``address`` (the one listening on its port)."""
    import psutil

    port = int(address.rsplit(":", 1)[1])
    for process in psutil.process_iter():
        try:
            if any(connection.laddr and connection.laddr.port == port and connection.status == psutil.CONN_LISTEN
                   for connection in process.net_connections(kind="tcp")):
                yield process
        except (psutil.AccessDenied, psutil.NoSuchProcess):
            continue


def _kill_worker(name: str) -> None:
    """SIGKILL the `dask worker` started as ``--name name`` and its worker process, as a lost
    machine would: its nanny does not bring it back."""
    import psutil

    for process in psutil.process_iter(["cmdline"]):
        command = process.info["cmdline"] or []
        if "distributed.cli.dask_worker" in command and command[command.index("--name") + 1] == name:
            children = process.children(recursive=True)
            process.kill()
            for child in children:
                child.kill()
            return
    raise AssertionError(f"no dask worker named {name}")


def test_a_worker_that_joins_after_a_loss_takes_the_lost_slot(tmp_path: Path, make_pipeline) -> None:
    """A joined worker and its nanny are killed mid-run; another worker joins under a new
    name (as a batch system starts a replacement): it takes the lost slot at once, without
    waiting out runtime.recovery_timeout_s, and the run finishes every step."""
    output = tmp_path / "out"
    pipeline = make_pipeline(output, steps=40, runtime={"recovery_timeout_s": 600})
    path = _write(pipeline, tmp_path)
    with dask_processes(tmp_path, {"node-a": ({}, []), "node-b": ({}, [])}) as address:
        process = _run_to_step_3(path, address)
        plan = json.loads((output / "plan-0.json").read_text())
        lost = plan["runtime"]["node_slots"]["ref"]  # the reference's own worker
        _kill_worker(lost)
        with open(tmp_path / "node-c.log", "w") as log:
            newcomer = subprocess.Popen(
                [*DASK, "distributed.cli.dask_worker", address, "--name", "node-c", "--nthreads", "1",
                 "--memory-limit", "0", "--no-dashboard", "--host", "127.0.0.1"],
                stdout=log, stderr=subprocess.STDOUT)
            try:
                rest, _ = process.communicate(timeout=400)
            finally:
                newcomer.terminate()
                newcomer.wait(timeout=30)
    assert process.returncode == 0, rest
    steps = [json.loads(line)["step"] for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 41))
    events = [json.loads(line) for line in (output / "events.jsonl").read_text().splitlines()]
    (recovered,) = [event for event in events if event["kind"] == "recovered"]
    assert f"slot {lost} now served by worker node-c" in recovered["message"], recovered["message"]
    assert recovered["data"]["workers_s"] < 120, recovered["message"]
    assert not [event for event in events if event["kind"] == "replan"], events
