"""What moving from one plan to another must send, worker to worker (pure, no cluster).

A model's state lives in parts on the hosts that hold it:

    weights     every copy; the trained copy (on the update node's slot) is the current one
    optimizer   the update node's slot only (AdamW moments and the update count)
    generator   the generate node's slot (its sampling RNG)

For each model and each slot of the new plan, the slot pulls the parts it newly needs from
the slot that has them in the old plan. A model that is never trained is loaded from its
path on a new slot instead: its weights there are the weights everywhere, so sending them
would only cost time.
"""

from __future__ import annotations

from dataclasses import dataclass

from flowrl.graph import PipelineGraph
from flowrl.planner.placement import Plan


@dataclass(frozen=True)
class Transfer:
    """One slot taking over (parts of) one model's state."""

    model: str
    slot: str
    sources: tuple[tuple[str, tuple[str, ...]], ...]
    """(source slot, parts pulled from it); empty: load from the model's path only."""


def plan_transfers(pipeline: PipelineGraph, old: Plan, new: Plan) -> list[Transfer]:
    transfers = []
    for model in sorted(new.model_slots):
        train_old = _role_slot(pipeline, old, model, "update")
        ranks_old = _role_slots(pipeline, old, model, "update")
        ranks_new = _role_slots(pipeline, new, model, "update")
        gen_old = _role_slot(pipeline, old, model, "generate")
        gen_new = _role_slot(pipeline, new, model, "generate")
        holders_old = old.model_slots.get(model, [])
        for slot in new.model_slots[model]:
            wanted: dict[str, list[str]] = {}
            if slot not in holders_old and train_old is not None:
                wanted.setdefault(train_old, []).append("weights")
            if slot in ranks_new and train_old is not None and slot not in ranks_old:
                # every rank of a data-parallel update keeps the same optimizer state
                wanted.setdefault(train_old, []).append("optimizer")
            if slot == gen_new and gen_old is not None and slot != gen_old:
                wanted.setdefault(gen_old, []).append("generator")
            if slot in holders_old and not wanted:
                continue
            sources = tuple((source, tuple(parts)) for source, parts in sorted(wanted.items()))
            transfers.append(Transfer(model, slot, sources))
    return transfers


def _role_slots(pipeline: PipelineGraph, plan: Plan, model: str, role: str) -> list[str]:
    """Every slot of ``model``'s first node with ``role`` (several for a split node)."""
    for node in pipeline.topological_order():
        spec = pipeline.spec.nodes[node]
        if spec.model == model and spec.role == role and node in plan.node_slots:
            return plan.slots_of(node)
    return []


def _role_slot(pipeline: PipelineGraph, plan: Plan, model: str, role: str) -> str | None:
    """The slot of ``model``'s first node with ``role`` in ``plan`` (None when it has none)."""
    for node in pipeline.topological_order():
        spec = pipeline.spec.nodes[node]
        if spec.model == model and spec.role == role and node in plan.node_slots:
            return plan.node_slots[node]
    return None
