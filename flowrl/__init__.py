"""flowrl: reinforcement-learning dataflow for language models, placed and re-placed on Dask.

The user API: build a pipeline (``Pipeline`` or ``load_pipeline``) and ``run`` it.
Heavy modules (torch, dask) load on first use, so importing flowrl is cheap.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Pipeline": "flowrl.api.builder",
    "PipelineGraph": "flowrl.graph",
    "load_pipeline": "flowrl.spec.loader",
    "run": "flowrl.api.run",
    "validate": "flowrl.api.run",
    "RunResult": "flowrl.api.run",
    "FlowrlError": "flowrl.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'flowrl' has no attribute {name!r}")
