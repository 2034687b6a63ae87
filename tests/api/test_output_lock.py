"""One process writes a run's output folder at a time (``run.lock``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import flowrl
from flowrl.api.outputs import RunFolder
from flowrl.errors import FlowrlError

ROOT = Path(__file__).resolve().parents[2]
HOLD = ("import sys, time; from pathlib import Path; from flowrl.api.outputs import RunFolder; "
        "folder = RunFolder(Path(sys.argv[1])); print('held', flush=True); time.sleep(60)")


def test_a_held_folder_is_refused_with_its_holder_until_released(tmp_path: Path) -> None:
    first = RunFolder(tmp_path)
    with pytest.raises(FlowrlError, match=rf"being written by a run that is still going \(pid {os.getpid()} on "):
        RunFolder(tmp_path)
    first.release()
    assert (tmp_path / "run.lock").read_text() == ""  # no holder named once released
    RunFolder(tmp_path).release()


def test_a_run_into_a_folder_another_process_writes_is_refused_and_a_killed_holder_frees_it(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              cwd=ROOT)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        pipeline = flowrl.load_pipeline(ROOT / "pipelines" / "grpo_tiny.yaml")
        with pytest.raises(FlowrlError, match=rf"\(pid {holder.pid} on .*\): wait for it to end or stop it"):
            flowrl.run(pipeline, steps=1, output_dir=tmp_path)
        assert not (tmp_path / "config.yaml").exists()  # refused before writing anything
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    RunFolder(tmp_path).release()  # the kernel dropped the killed holder's lock


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in a folder without write permission")
def test_a_folder_that_cannot_be_written_is_a_clear_error(tmp_path: Path) -> None:
    tmp_path.chmod(0o555)
    try:
        with pytest.raises(FlowrlError, match="cannot write in the output folder"):
            RunFolder(tmp_path)
    finally:
        tmp_path.chmod(0o755)


def test_a_lock_that_cannot_be_opened_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "run.lock").mkdir()  # as a lock file this process may not open
    with pytest.raises(FlowrlError, match=r"cannot open the run's lock file .*run.lock: Is a directory; give the run a "
                                          r"folder it can write .* or remove the file if no run is writing the folder"):
        RunFolder(tmp_path)


def test_a_file_system_without_flock_leaves_the_folder_unguarded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import fcntl

    def no_flock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    first, second = RunFolder(tmp_path), RunFolder(tmp_path)  # not refused as held
    first.release()
    second.release()


def test_the_cli_says_a_run_is_going_before_what_the_folder_holds(tmp_path: Path) -> None:
    """A run going on in a folder with checkpoints: a second run is told about that run, not
    advised to resume it or --overwrite."""
    from typer.testing import CliRunner

    from flowrl.cli import main as cli

    (tmp_path / "checkpoints" / "step-2").mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              cwd=ROOT)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        result = CliRunner().invoke(cli.app, ["run", str(ROOT / "pipelines" / "grpo_tiny.yaml"), "-o", str(tmp_path),
                                              "--steps", "1", "--plain"])
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert result.exit_code == 2
    assert f"is being written by a run that is still going (pid {holder.pid} on " in result.output
    assert "holds checkpoints of an earlier run" not in result.output
