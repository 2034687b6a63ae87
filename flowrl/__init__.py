"""flowrl: reinforcement-learning dataflow for language models, placed and re-placed on Dask.

The user API: build a pipeline (``Pipeline`` or ``load_pipeline``) and ``run`` it.
Heavy modules (torch, dask) load on first use, so importing flowrl is cheap.
"""

from __future__ import annotations

import sys
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flowrl.api.builder import Pipeline
    from flowrl.api.run import Observer, RunResult
    from flowrl.graph import PipelineGraph

__version__ = "0.1.0"

_EXPORTS = {
    "Pipeline": "flowrl.api.builder",
    "PipelineGraph": "flowrl.graph",
    "load_pipeline": "flowrl.spec.loader",
    "validate": "flowrl.api.run",
    "RunResult": "flowrl.api.run",
    "FlowrlError": "flowrl.errors",
}

__all__ = sorted([*_EXPORTS, "run"])


def run(
    pipeline: PipelineGraph | Pipeline,
    steps: int | None = None,
    output_dir: str | Path | None = None,
    scheduler_address: str | None = None,
    cpu_slots: int | None = None,
    seed: int | None = None,
    observer: Observer | None = None,
    base_dir: str | Path | None = None,
    resume: bool = False,
    force: bool = False,
    overwrite: bool = False,
    quiet: bool = False,
) -> RunResult:
    """Train ``pipeline`` (:func:`flowrl.api.run.run`, whose arguments these are), printing a
    line per step and per event (placements, warnings, evaluations, checkpoints) to stdout as
    ``flowrl run --plain`` does; ``observer`` (an object with ``on_step(record)`` and
    ``on_event(event)``) receives them instead, and ``quiet`` prints nothing."""
    from flowrl.api.run import run as run_pipeline

    if observer is None and not quiet:
        from flowrl.ui.plain import PlainLog

        observer = PlainLog(sys.stdout)
    return run_pipeline(pipeline, steps, output_dir, scheduler_address, cpu_slots, seed, observer, base_dir,
                        resume, force, overwrite=overwrite)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'flowrl' has no attribute {name!r}")


def __dir__() -> list[str]:
    # the public names, lazily imported ones included (tab completion in a notebook)
    return sorted([*__all__, "__version__"])
