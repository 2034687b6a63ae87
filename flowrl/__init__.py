"""flowrl: reinforcement-learning dataflow for language models, placed and re-placed on Dask.

The user API: build a pipeline (``Pipeline`` or ``load_pipeline``) and ``run`` it.
Heavy modules (torch, dask) load on first use, so importing flowrl is cheap.
"""

from __future__ import annotations

import sys
from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    from flowrl.api.builder import Pipeline
    from flowrl.api.result import RunResult
    from flowrl.graph import PipelineGraph

__version__ = "0.1.0"

_EXPORTS = {
    "Pipeline": "flowrl.api.builder",
    "PipelineGraph": "flowrl.graph",
    "load_pipeline": "flowrl.spec.loader",
    "validate": "flowrl.api.run",
    "RunResult": "flowrl.api.result",
    "load_run": "flowrl.api.result",
    "FlowrlError": "flowrl.errors",
}

__all__ = sorted([*_EXPORTS, "run"])


def run(pipeline: PipelineGraph | Pipeline | str | Path, *args: Any, quiet: bool = False, **kwargs: Any) -> RunResult:
    """Train ``pipeline``: :func:`flowrl.api.run.run`, whose arguments these are (``steps``,
    ``output_dir``, ``scheduler_address``, ``cpu_slots``, ``seed``, ``observer``, ``base_dir``,
    ``resume``, ``force``, ``overwrite``, ``checkpoint``), printing a line per step and per event
    (placements, warnings, evaluations, checkpoints) to stdout as ``flowrl run --plain`` does;
    ``observer`` (an object with ``on_step(record)`` and ``on_event(event)``, or one of them)
    receives them instead, and ``quiet`` prints nothing. ``pipeline``: a builder's, a loaded
    one, or the path of its file (whose folder relative paths are then read from)."""
    from flowrl.api.run import run as run_pipeline

    observer_given = len(args) > OBSERVER_POSITION or kwargs.get("observer") is not None
    if not observer_given and not quiet:
        from flowrl.ui.plain import PlainLog

        kwargs["observer"] = PlainLog(sys.stdout)
    return run_pipeline(pipeline, *args, **kwargs)


OBSERVER_POSITION = 5
"""``observer``'s place among :func:`flowrl.api.run.run`'s arguments after the pipeline."""


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'flowrl' has no attribute {name!r}")


def __dir__() -> list[str]:
    # the public names, lazily imported ones included (tab completion in a notebook)
    return sorted([*__all__, "__version__"])
