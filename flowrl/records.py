"""Plain records that flow from a run to whoever watches it (live view, logs, files).

They hold numbers and names only, so every layer can produce or read them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class NodeTiming:
    """One node call of one step, as measured on the worker that ran it."""

    node: str
    role: str
    device: str
    latency_s: float
    """Wall time of the call on the worker, fetching inputs included."""
    wait_s: float
    """Part of ``latency_s`` spent fetching inputs from other workers."""
    tokens: int
    """Tokens the node processed (prompt + completion for generate, completion elsewhere)."""
    tokens_per_s: float


@dataclass(frozen=True)
class DeviceSample:
    """Utilisation and memory of one device slot, sampled by its worker."""

    device: str
    kind: Literal["cpu", "gpu"]
    utilization: float
    """Busy fraction in [0, 1] since the previous sample (CPU: the worker process)."""
    memory_gb: float
    """Memory in use: GPU memory, or the worker process's resident set on CPU."""
    memory_total_gb: float | None = None


@dataclass(frozen=True)
class StepRecord:
    """Everything known about one finished step."""

    step: int
    num_steps: int
    metrics: dict[str, float]
    nodes: list[NodeTiming] = field(default_factory=list)
    devices: list[DeviceSample] = field(default_factory=list)
    elapsed_s: float = 0.0
    """Seconds since the run's first step started."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RunEvent:
    """Something that happened outside the normal step flow: placement, checkpoint, warning."""

    kind: str
    message: str
    step: int | None = None
    data: dict[str, Any] = field(default_factory=dict)
