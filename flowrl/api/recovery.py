"""What a run needs to continue after a fault: verified checkpoints and in-memory snapshots.

A checkpoint directory (``checkpoints/step-<n>/``) is complete only when its
``trainer_state.json`` exists (it is written last, before the rename) and every file listed in
that file's ``files`` manifest has the SHA-256 recorded there. :func:`newest_checkpoint`
walks the checkpoints newest first and skips (and names) any that is half-written or corrupt,
so a damaged checkpoint never silently becomes the starting point.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowrl.errors import FlowrlError

TRAINER_STATE = "trainer_state.json"
CHUNK = 1 << 20


def file_digests(directory: Path) -> dict[str, str]:
    """SHA-256 of every file under ``directory`` (relative path -> hex), the trainer state aside."""
    digests = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file() and path.name != TRAINER_STATE:
            digest = hashlib.sha256()
            with open(path, "rb") as handle:
                for block in iter(lambda: handle.read(CHUNK), b""):
                    digest.update(block)
            digests[path.relative_to(directory).as_posix()] = digest.hexdigest()
    return digests


def checkpoint_problem(directory: Path) -> str | None:
    """None when the checkpoint is complete and intact; else what is wrong with it."""
    state_file = directory / TRAINER_STATE
    if not state_file.is_file():
        return f"no {TRAINER_STATE} (the write did not finish)"
    try:
        state = json.loads(state_file.read_text())
        expected = state["files"]
        int(state["step"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"{TRAINER_STATE} is unreadable ({type(error).__name__}: {error})"
    actual = file_digests(directory)
    missing = sorted(set(expected) - set(actual))
    if missing:
        return f"missing files: {', '.join(missing[:3])}"
    changed = sorted(name for name, digest in expected.items() if actual[name] != digest)
    if changed:
        return f"corrupt files (checksum differs): {', '.join(changed[:3])}"
    return None


@dataclass(frozen=True)
class FoundCheckpoint:
    step: int
    path: Path
    trainer_state: dict[str, Any]
    skipped: tuple[str, ...]
    """One line per newer checkpoint that was skipped, saying why."""


def checkpoint_dirs(checkpoints: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every ``step-<n>`` folder under ``checkpoints``, oldest first,
    whatever state it is in."""
    if not checkpoints.is_dir():
        return []
    steps = []
    for path in checkpoints.glob("step-*"):
        suffix = path.name.removeprefix("step-")
        if path.is_dir() and suffix.isdigit():
            steps.append((int(suffix), path))
    return sorted(steps)


def newest_written(checkpoints: Path) -> Path | None:
    """The newest checkpoint whose write finished (its trainer state exists), without reading
    its files again: what a message may name at once (checking every checksum of a large
    model's checkpoint takes minutes)."""
    return next((path for _, path in reversed(checkpoint_dirs(checkpoints)) if (path / TRAINER_STATE).is_file()), None)


def resume_note(checkpoints: Path | None, fix: str, changes_pipeline: bool = False) -> str:
    """What a run stopped by a guard leaves to resume from: its newest checkpoint and the
    command (after ``fix``; ``changes_pipeline``: a fix in the pipeline, which a resume
    takes only with --force), or that none was written."""
    if checkpoints is None:
        return ""
    written = newest_written(checkpoints)
    if written is None:
        return ("; no checkpoint was written (trainer.checkpoint_every sets how often one is), so a rerun starts "
                "from step 1")
    force = " --force" if changes_pipeline else ""
    python = ", force=True" if changes_pipeline else ""
    return (f"; its newest checkpoint is {written} ({fix}, then `flowrl resume {checkpoints.parent}{force}`; from "
            f"Python: `run(pipeline, output_dir='{checkpoints.parent}', resume=True{python})`)")


def newest_checkpoint(checkpoints: Path) -> FoundCheckpoint | None:
    """The newest complete and intact checkpoint under ``checkpoints`` (None if there is none)."""
    skipped: list[str] = []
    for step, path in reversed(checkpoint_dirs(checkpoints)):
        problem = checkpoint_problem(path)
        if problem is None:
            state = json.loads((path / TRAINER_STATE).read_text())
            return FoundCheckpoint(step, path, state, tuple(skipped))
        skipped.append(f"{path.name}: {problem}")
    return None


def config_changes(old: str, new: str) -> list[str]:
    """The lines of a unified diff between two resolved pipeline files (empty: the same)."""
    return [
        line.rstrip("\n")
        for line in difflib.unified_diff(old.splitlines(), new.splitlines(), "before", "now", lineterm="", n=0)
        if not line.startswith(("---", "+++", "@@"))
    ]


@dataclass(frozen=True)
class RollBack:
    """What a resume from an earlier checkpoint moves aside once that checkpoint is restored:
    the checkpoints after it and a final model (a resume refused or stopped before then
    leaves the run as it was)."""

    output_dir: Path
    step: int
    folders: tuple[Path, ...]

    def move(self) -> Path:
        """Move ``folders`` into ``rolled_back/`` with a copy of the run's logs as they were
        (the resume drops their lines after ``step``); returns the folder they went to."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        moved = self.output_dir / "rolled_back" / f"after-step-{self.step}-{stamp}"
        number = 1
        while moved.exists():  # a second roll-back within the same second
            number += 1
            moved = self.output_dir / "rolled_back" / f"after-step-{self.step}-{stamp}-{number}"
        done: list[str] = []
        try:
            moved.mkdir(parents=True)
            for name in (*LOG_FILES, *map(rewound_name, LOG_FILES)):
                if (self.output_dir / name).is_file():
                    shutil.copy2(self.output_dir / name, moved / name)
            for folder in self.folders:
                folder.rename(moved / folder.name)
                done.append(folder.name)
        except OSError as error:
            kept = f"; {', '.join(done)} moved there already" if done else ""
            raise FlowrlError(f"rolling back to step-{self.step} failed moving files into {moved} ({error}){kept}") \
                from error
        return moved


def roll_back(output_dir: Path, checkpoints: Path, step: int) -> tuple[FoundCheckpoint, RollBack | None]:
    """The intact checkpoint of ``step``, to resume from instead of the newest, and what
    moves aside once it is restored (:class:`RollBack`; None: nothing comes after it): the
    checkpoints after it and a final model, kept in ``rolled_back/`` and no longer taken for
    the run's own (the run goes on from ``step`` and writes new ones)."""
    written = checkpoint_dirs(checkpoints)
    path = checkpoints / f"step-{step}"
    if not path.is_dir():
        have = ", ".join(folder.name for _, folder in written) or "none"
        raise FlowrlError(f"{output_dir} has no checkpoint step-{step} to resume from (its checkpoints: {have})")
    problem = checkpoint_problem(path)
    if problem is not None:
        raise FlowrlError(f"checkpoint {path} cannot be resumed from: {problem}; choose another (--checkpoint)")
    later = [folder for number, folder in written if number > step]
    final = output_dir / "final"
    state = json.loads((path / TRAINER_STATE).read_text())
    found = FoundCheckpoint(step, path, state, ())
    if not later and not final.is_dir():
        return found, None
    return found, RollBack(output_dir, step, (*later, *([final] if final.is_dir() else [])))


def rewound_name(name: str) -> str:
    """Where ``RunFolder.truncate_logs`` keeps the lines of steps run again: metrics.jsonl ->
    metrics.rewound.jsonl."""
    return name.replace(".jsonl", ".rewound.jsonl")


LOG_FILES = ("metrics.jsonl", "profile.jsonl", "samples.jsonl", "events.jsonl")
"""The run's logs, whose lines after a resumed step are dropped (copied aside by a roll-back)."""
