"""Plain records that flow from a run to whoever watches it (live view, logs, files).

They hold numbers and names only, so every layer can produce or read them.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class NodeTiming:
    """One node call of one step, as measured on the worker that ran it."""

    node: str
    role: str
    device: str
    wall_s: float
    """From the call's arrival on the worker to its result: waiting and computing."""
    compute_s: float
    """Time on the worker's compute thread (what the device's speed decides)."""
    wait_s: float
    """Time waiting for inputs: upstream nodes still running, and transfers from other workers."""
    tokens_in: int
    """Tokens the node read (prompt for generate; prompt + completion elsewhere)."""
    tokens_out: int
    """Tokens the node produced (completions for generate; per-token outputs elsewhere)."""
    peak_memory_gb: float = 0.0
    """Most GPU memory the call's tensors held at once; 0 off a GPU."""
    memory_headroom_gb: float = 0.0
    """The GPU's memory minus that peak: what a larger batch could still use; 0 off a GPU."""
    rate_of_output: bool = False
    """Its throughput counts the tokens it produced (generation, evaluation), else those it read."""
    arrived_at: float = 0.0
    """When the call reached its worker (seconds since the epoch): where it sits on a step's
    timeline; 0 where not measured."""

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens/s where ``rate_of_output``, tokens read/s for every other node."""
        tokens = self.tokens_out if self.rate_of_output else self.tokens_in
        return tokens / self.compute_s if self.compute_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s}


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
    external_load: float | None = None
    """Share (0..1) of the slot's cores kept busy by other processes over the same span
    (CPU slots); None where it is not measured (GPUs, the simulator)."""


@dataclass(frozen=True)
class StepRecord:
    """Everything known about one finished step."""

    step: int
    num_steps: int
    metrics: dict[str, float]
    nodes: list[NodeTiming] = field(default_factory=list)
    devices: list[DeviceSample] = field(default_factory=list)
    elapsed_s: float = 0.0
    """Seconds of the run: since this process's run started, plus ``resumed_s`` (a resumed
    run's clock goes on from its checkpoint's step)."""
    first_step: int = 1
    """The first step this process ran (a resumed run's first step after its checkpoint)."""
    resumed_s: float = 0.0
    """The run's ``elapsed_s`` at the checkpoint this process resumed from (0 for a run that
    started here): ``elapsed_s - resumed_s`` is this process's time."""

    @property
    def process_s(self) -> float:
        """Seconds since this process's run started."""
        return self.elapsed_s - self.resumed_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RunEvent:
    """Something that happened outside the normal step flow: placement, checkpoint, warning."""

    kind: str
    message: str
    step: int | None = None
    data: dict[str, Any] = field(default_factory=dict)


def slowest_part_medians(calls: Iterable[tuple[str, int, float]]) -> dict[str, float]:
    """Per node, the median over steps of its seconds in a step, from (node, step, seconds)
    of every call: a node split over devices takes as long as its slowest part."""
    per_step: dict[str, dict[int, float]] = {}
    for node, step, seconds in calls:
        steps = per_step.setdefault(node, {})
        steps[step] = max(steps.get(step, 0.0), seconds)
    return {node: statistics.median(steps.values()) for node, steps in per_step.items()}


@dataclass(frozen=True)
class EvalSettings:
    """How completions are sampled for evaluation (a generate node's fields, plus chunking)."""

    n: int
    temperature: float
    """0 decodes greedily."""
    max_new_tokens: int
    top_p: float = 1.0
    top_k: int = 0
    engine: str = "auto"
    batch_size: int = 64
    """Prompts per generation call."""
    seed: int = 0


NONFINITE_METRICS = ("actor/nonfinite_skipped", "critic/nonfinite_skipped")
"""1.0 when a policy's (a critic's) optimizer step was skipped because its loss or gradient was
NaN or infinite."""
