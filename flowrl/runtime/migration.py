"""What moving from one plan to another must send, worker to worker (pure, no cluster).

A model's state lives in parts on the hosts that hold it:

    weights     every copy; the trained copies (the update node's slots) are current
    optimizer   the update node's slots (the same state on every rank of a data-parallel update)
    generator   each slot of the generate node: one sampling stream per part

For each model and each slot of the new plan, the slot pulls the parts it newly needs from
the slot that has them in the old plan. A model that is never trained is loaded from its
path on a new slot instead: its weights there are the weights everywhere, so sending them
would only cost time.
"""

from __future__ import annotations

from dataclasses import dataclass

from flowrl.graph import PipelineGraph
from flowrl.planner.placement import Plan
from flowrl.spec.schema import GenerateNode, NodeBase, UpdateNode


RESEED_BASE = 1000
"""Seed offsets of restarted sampling streams: 1000 x the step of the re-plan + the part."""


@dataclass(frozen=True)
class Transfer:
    """One slot taking over (parts of) one model's state."""

    model: str
    slot: str
    sources: tuple[tuple[str, tuple[str, ...]], ...]
    """(source slot, parts pulled from it); empty: load from the model's path only."""
    seed_offset: int = 0
    """Added to the run's seed when the slot loads the model: part k of a split generate
    node samples with its own stream (seed + k)."""
    reseed: bool = False
    """Restart the slot's sampling stream at seed + ``seed_offset``: the stream its part
    had was on a worker that is gone, and keeping another part's would duplicate it."""


def plan_transfers(pipeline: PipelineGraph, old: Plan, new: Plan, alive: set[str] | None = None) -> list[Transfer]:
    """What each slot of ``new`` pulls; only slots in ``alive`` (None: all) can send."""
    transfers = []
    for model in sorted(new.model_slots):
        ranks_old = _role_slots(pipeline, old, model, UpdateNode)
        ranks_new = _role_slots(pipeline, new, model, UpdateNode)
        # Every rank of a data-parallel update holds the same weights and optimizer state:
        # any live one can send them.
        live_ranks = [slot for slot in ranks_old if alive is None or slot in alive]
        train_old = live_ranks[0] if live_ranks else None
        gen_old = _role_slots(pipeline, old, model, GenerateNode)
        gen_new = _role_slots(pipeline, new, model, GenerateNode)
        holders_old = old.model_slots.get(model, [])
        for slot in new.model_slots[model]:
            wanted: dict[str, list[str]] = {}
            if slot not in holders_old and train_old is not None:
                wanted.setdefault(train_old, []).append("weights")
            if slot in ranks_new and train_old is not None and slot not in ranks_old:
                wanted.setdefault(train_old, []).append("optimizer")
            # part k of generation continues part k's sampling stream, wherever it was
            part = gen_new.index(slot) if slot in gen_new else None
            reseed = False
            offset = part or 0  # as stream_offset: seed + part
            if part is not None and part < len(gen_old) and gen_old[part] != slot:
                if alive is None or gen_old[part] in alive:
                    wanted.setdefault(gen_old[part], []).append("generator")
                else:  # a fresh stream, distinct from every stream of the first plan
                    reseed, offset = True, RESEED_BASE * max(1, new.step) + part
            if slot in holders_old and not wanted and not reseed:
                continue
            sources = tuple((source, tuple(parts)) for source, parts in sorted(wanted.items()))
            transfers.append(Transfer(model, slot, sources, offset, reseed))
    return transfers


def stream_offset(pipeline: PipelineGraph, plan: Plan, model: str, slot: str) -> int:
    """Seed offset of ``slot``'s sampling stream for ``model``: its part of the split
    generate node (0 when generation is not split or runs elsewhere)."""
    parts = _role_slots(pipeline, plan, model, GenerateNode)
    return parts.index(slot) if slot in parts else 0


def _role_slots(pipeline: PipelineGraph, plan: Plan, model: str, role: type[NodeBase]) -> list[str]:
    """Every slot of ``model``'s first node of ``role`` (several for a split node)."""
    for node in pipeline.nodes_of(role):
        spec = pipeline.spec.nodes[node]
        if spec.model == model and node in plan.node_slots:
            return plan.slots_of(node)
    return []


