"""What the driver sends to a worker to run one node, and what comes back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flowrl.spec.schema import NodeBase


@dataclass(frozen=True)
class InputRef:
    """Where a node finds one of its inputs: a key in some host's store."""

    name: str
    role: str
    """The producer's role: a role reads its inputs by it (``roles.registry``)."""
    key: str
    host: Any | None
    """The Dask actor handle of the host that holds it; None when it is the caller."""
    rollout: bool = False
    """It is the rollout the consumer descends from (a node split by rows divides it)."""


@dataclass(frozen=True)
class NodeCall:
    step: int
    node: str
    role: str
    spec: NodeBase
    """The node's spec: its role's class in ``flowrl.spec.schema``."""
    model: str | None
    inputs: tuple[InputRef, ...] = ()
    prompts: tuple[Any, ...] = ()
    """Data-source examples, for generate nodes only."""
    group_size: int = 1
    weight_peers: tuple[Any, ...] = ()
    """Hosts that keep a copy of ``model`` for generation: updated weights go to them."""
    kl_coef: float = 0.0
    """Advantage nodes: this step's KL reward-penalty coefficient (fixed or adaptive)."""
    lr: float | None = None
    """Update nodes: this step's learning rate on the node's schedule; None: the node's ``lr``."""
    shard: tuple[int, int] = (0, 1)
    """(index, count): this call computes part ``index`` of ``count`` of its node's rows
    (``weighted_rows`` with ``shares``)."""
    shard_peers: tuple[Any, ...] = ()
    """Shard 0 only: the hosts of shards 1..count-1, whose parts it joins."""
    shares: tuple[float, ...] = ()
    """Relative rows per part (empty: equal): split inference, split generation and the
    ranks of a data-parallel update all use them."""
    threads: int = 0
    """Torch threads for this call (``flowrl.runtime.threads``); 0: the worker's own setting."""
    profile_dir: str = ""
    """Where the call writes its ``torch.profiler`` trace and table (``trainer.torch_profile``);
    empty: not profiled."""

    @property
    def part_shares(self) -> tuple[float, ...]:
        """``shares``, or equal ones for every part."""
        return self.shares or (1.0,) * self.shard[1]


@dataclass(frozen=True)
class EvalCall:
    """Evaluate the held-out prompts with a model on the host that holds it."""

    step: int
    """The step just finished (0: before training)."""
    model: str
    examples: tuple[Any, ...]
    settings: Any
    """``flowrl.records.EvalSettings``."""
    scorers: tuple[tuple[str, Any, dict[str, Any]], ...]
    """(score node, its ``fn`` spec, its params) for every reward function applied."""
    keep: bool = False
    """Keep the completions in the host's store (under :data:`EVAL_KEY`) for reward models
    on other hosts to score (:class:`HeldOutScoreCall`)."""


EVAL_KEY = "eval"
"""The store key's node part of an evaluation's kept completions (``store_key(step, EVAL_KEY)``:
dropped with the step's other outputs)."""


@dataclass(frozen=True)
class HeldOutScoreCall:
    """Score an evaluation's kept completions with a reward model, on the host that holds it."""

    step: int
    node: str
    """The score node whose reward model scores (its weight is not applied)."""
    model: str
    micro_batch_tokens: int | None
    sources: tuple[Any | None, ...]
    """The hosts that generated the completions, in prompt order (None: this host)."""
    n: int
    """Completions per prompt (consecutive)."""
    retokenize: bool = False
    """The reward model reads the texts with its own tokenizer (``ScoreNode.retokenize``)."""


@dataclass(frozen=True)
class NodeReport:
    """Sent back to the driver: small numbers only, never batches."""

    node: str
    role: str
    device: str
    key: str
    wall_s: float
    """Arrival on the worker to result stored: waiting for inputs and computing."""
    compute_s: float
    wait_s: float
    """Waiting for inputs: upstream nodes still running, and fetching from other workers."""
    tokens_in: int
    tokens_out: int
    metrics: dict[str, float] = field(default_factory=dict)
    peak_memory_gb: float = 0.0
    """Most GPU memory the call's tensors held at once (0 off a GPU)."""
    device_memory_gb: float = 0.0
    """The GPU's whole memory (0 off a GPU)."""
    messages: tuple[str, ...] = ()
    """What the run's log should say about this call (a reward function's first error)."""
    shards: tuple["NodeReport", ...] = ()
    """A node split over devices: the reports of shards 1.. (this one is shard 0's)."""
    arrived_at: float = 0.0
    """When the call reached the worker (seconds since the epoch, the worker's clock)."""


def store_key(step: int, node: str, shard: int = 0) -> str:
    """Where a node's output waits on its host; a shard > 0 keeps its part under its own key."""
    return f"{step}:{node}" if shard == 0 else f"{step}:{node}#{shard}"


def key_step(key: str) -> int:
    return int(key.split(":", 1)[0])
