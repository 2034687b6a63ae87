"""Checkpoints are sealed with a manifest: half-written and corrupt ones are found and skipped."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.api.outputs import RunFolder
from flowrl.api.recovery import checkpoint_problem, config_changes, newest_checkpoint
from flowrl.errors import CheckpointError


def _checkpoint(folder: RunFolder, step: int, payload: bytes) -> Path:
    staging = folder.checkpoint_staging(step)
    (staging / "actor").mkdir()
    (staging / "actor" / "model.safetensors").write_bytes(payload)
    (staging / "actor" / "state.pt").write_bytes(b"state" + payload)
    return folder.commit_checkpoint(staging, step, {"kl": {}}, keep=5)


def test_the_newest_intact_checkpoint_is_chosen_and_damaged_ones_are_named(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path)
    _checkpoint(folder, 2, b"two")
    _checkpoint(folder, 4, b"four")
    newest = _checkpoint(folder, 6, b"six")
    found = newest_checkpoint(folder.checkpoints)
    assert found is not None and found.step == 6 and found.skipped == ()

    # one flipped byte in the newest: it is skipped for the one before
    (newest / "actor" / "model.safetensors").write_bytes(b"siX")
    found = newest_checkpoint(folder.checkpoints)
    assert found is not None and found.step == 4
    assert found.skipped == ("step-6: corrupt files (checksum differs): actor/model.safetensors",)

    # half-written: the manifest (written last) is missing, or a file is gone
    (folder.checkpoints / "step-4" / "trainer_state.json").unlink()
    (folder.checkpoints / "step-2" / "actor" / "state.pt").unlink()
    assert newest_checkpoint(folder.checkpoints) is None
    assert checkpoint_problem(folder.checkpoints / "step-4") == "no trainer_state.json (the write did not finish)"
    assert checkpoint_problem(folder.checkpoints / "step-2") == "missing files: actor/state.pt"


def test_a_staging_folder_never_counts_and_a_failed_commit_keeps_the_previous(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path)
    _checkpoint(folder, 3, b"three")
    staging = folder.checkpoint_staging(6)  # a write cut short: never renamed into place
    (staging / "actor").mkdir()
    found = newest_checkpoint(folder.checkpoints)
    assert found is not None and found.step == 3
    # the staging folder disappears mid-commit (disk gone): a clear error, step-3 intact
    folder.discard_staging(staging)
    with pytest.raises(CheckpointError, match="the previous one is intact"):
        folder.commit_checkpoint(staging, 6, {"kl": {}}, keep=2)
    assert checkpoint_problem(folder.checkpoints / "step-3") is None


def test_keep_prunes_only_after_the_new_one_is_in_place(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path)
    for step in (1, 2, 3):
        staging = folder.checkpoint_staging(step)
        (staging / "weights").write_bytes(bytes([step]))
        folder.commit_checkpoint(staging, step, {}, keep=2)
    assert sorted(p.name for p in folder.checkpoints.iterdir()) == ["step-2", "step-3"]


def test_truncating_logs_drops_later_steps_and_cut_lines(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"ste')
    (tmp_path / "profile.jsonl").write_text('{"step": 2, "type": "node"}\n{"step": 3, "type": "node"}\n')
    assert folder.truncate_logs(2) == 1
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert (tmp_path / "profile.jsonl").read_text() == '{"step": 2, "type": "node"}\n'
    # the dropped lines are kept aside (a run that stops before running them again keeps them)
    assert (tmp_path / "metrics.rewound.jsonl").read_text() == '{"step": 3}\n'
    assert (tmp_path / "profile.rewound.jsonl").read_text() == '{"step": 3, "type": "node"}\n'
    assert folder.truncate_logs(1) == 1  # appended
    assert (tmp_path / "metrics.rewound.jsonl").read_text() == '{"step": 3}\n{"step": 2}\n'


def test_config_changes_are_listed_as_a_diff() -> None:
    before = "name: a\ntrainer:\n  steps: 10\n  seed: 0\n"
    now = "name: a\ntrainer:\n  steps: 20\n  seed: 0\n"
    assert config_changes(before, now) == ["-  steps: 10", "+  steps: 20"]
    assert config_changes(before, before) == []


def test_a_log_line_that_cannot_be_written_is_a_clear_error(tmp_path: Path) -> None:
    """A full disk or a folder made read-only under the run: what could not be written and
    how to go on, not an OSError's traceback."""
    from flowrl.errors import FlowrlError
    from flowrl.records import RunEvent

    folder = RunFolder(tmp_path / "run")
    (folder.path / "events.jsonl").mkdir(parents=True)  # appending to it fails as a full disk would
    with pytest.raises(FlowrlError, match=r"cannot write events.jsonl in .*run: Is a directory; free disk space"):
        folder.append_event(RunEvent("warning", "w", 1))
    # no checkpoint yet: a resume starts over, and the message says so
    with pytest.raises(FlowrlError, match=r"no checkpoint was written, so it starts at step 1"):
        folder.append_event(RunEvent("warning", "w", 1))
    _checkpoint(folder, 2, b"two")
    with pytest.raises(FlowrlError, match=r"the checkpoints written are kept"):
        folder.append_event(RunEvent("warning", "w", 1))


def test_a_full_disk_under_torchs_file_writer_is_called_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch reports a full disk as "enforce fail ... unexpected pos": the free space names it."""
    import shutil
    from collections import namedtuple

    from flowrl.runtime.checkpoint import write_failure

    failure = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 878080 vs 878032\nmore")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 * 2**20, 10 * 2**20 - 2**19, 2**19))
    assert write_failure(failure, tmp_path) == ("no space left on the device (0.5 MiB free there; torch: [enforce fail "
                                                "at inline_container.cc:672] . unexpected pos 878080 vs 878032)")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**40, 0, 2**31))
    assert write_failure(failure, tmp_path).endswith("unexpected pos 878080 vs 878032; 2.0 GiB free there)")
    assert write_failure(OSError(28, "No space left on device"), tmp_path) == "[Errno 28] No space left on device"


def test_only_the_writers_failures_are_called_write_failures() -> None:
    import torch
    from safetensors import SafetensorError

    from flowrl.runtime.checkpoint import is_write_failure

    assert is_write_failure(OSError(28, "No space left on device"))
    assert is_write_failure(SafetensorError("Error while serializing: IoError(No space left on device)"))
    assert is_write_failure(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 8 vs 4"))
    assert not is_write_failure(torch.OutOfMemoryError("CUDA out of memory"))
    assert not is_write_failure(RuntimeError("NCCL error in: ProcessGroupNCCL.cpp"))
    assert not is_write_failure(ValueError("unexpected pos"))
