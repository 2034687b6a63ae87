"""The runtime's placement: which worker slot runs each node and holds each model.

It is read off the planner's ``CompiledPlan`` (a pure function of the pipeline, the device
match and the costs), so it is deterministic and testable without a cluster.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from flowrl.devices.groups import model_group
from flowrl.errors import PlacementError
from flowrl.graph import PipelineGraph
from flowrl.planner.compiled import CompiledPlan
from flowrl.planner.pushes import push_cycle


@dataclass(frozen=True)
class Plan:
    """Plain data (JSON-ready): where everything runs."""

    step: int
    group_slots: dict[str, list[str]]
    """Device group -> the slots that serve it."""
    model_slots: dict[str, list[str]]
    """Model -> the slots that hold a copy (every slot where one of its nodes runs)."""
    node_slots: dict[str, str]
    """Node -> the slot that runs it (a split node: the slot of its first shard, which
    joins the parts and serves the result)."""
    reasons: list[str] = field(default_factory=list)
    """One line per decision."""
    node_shards: dict[str, list[str]] = field(default_factory=dict)
    """Nodes split by rows over several slots (data-parallel inference) -> those slots, in
    shard order."""

    node_shares: dict[str, list[float]] = field(default_factory=dict)
    """Split nodes whose parts get unequal rows (faster devices more) -> relative shares;
    a split node not listed shares equally."""

    def shares_of(self, node: str) -> tuple[float, ...]:
        slots = self.slots_of(node)
        shares = self.node_shares.get(node)
        return tuple(shares) if shares and len(shares) == len(slots) else tuple(1.0 for _ in slots)

    def slots_of(self, node: str) -> list[str]:
        """Every slot that runs a part of ``node``."""
        return self.node_shards.get(node) or [self.node_slots[node]]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def weight_peers(self, node: str, model: str) -> list[str]:
        """Slots that hold ``model`` but do not train it, so must get its new weights."""
        own = self.slots_of(node)
        return [slot for slot in self.model_slots.get(model, []) if slot not in own]


def plan_from_compiled(pipeline: PipelineGraph, compiled: CompiledPlan, slots: list[str]) -> Plan:
    """The runtime's placement from the planner's: every node on its one device.

    A node planned over several devices runs over their workers as its role splits
    (``split``): generation by prompts, inference by rows, an update (policy or critic)
    data-parallel. A node whose role does not split (an advantage) is refused with the fix
    rather than silently narrowed.
    """
    node_slots: dict[str, str] = {}
    node_shards: dict[str, list[str]] = {}
    reasons: list[str] = []
    for node in compiled.nodes:
        if len(node.devices) > 1:
            if not splittable(pipeline, node.node):
                group = node_group(pipeline, node.node) or node.node
                raise PlacementError(
                    f"devices.{group}: node '{node.node}' is planned over {len(node.devices)} devices; "
                    "its role runs on one device. Set `count: 1`."
                )
            node_shards[node.node] = list(node.devices)
        missing = [device for device in node.devices if device not in slots]
        if missing:
            raise PlacementError(
                f"nodes.{node.node}: planned on {', '.join(missing)}, but no Dask worker serves it "
                f"(workers: {', '.join(slots)}). Start a worker for it (a joined cluster names its "
                "workers after their devices) or set `type: cpu` for its device group."
            )
        node_slots[node.node] = node.devices[0]
        reasons.append(f"{node.node} -> {', '.join(node.devices)}: {node.reason}")
    return plan_for(pipeline, node_slots, compiled.step, reasons, node_shards)


def plan_for(
    pipeline: PipelineGraph,
    node_slots: dict[str, str],
    step: int = 0,
    reasons: list[str] | None = None,
    node_shards: dict[str, list[str]] | None = None,
) -> Plan:
    """The plan that runs each node on its slot in ``node_slots`` (and each split node on
    its ``node_shards``); groups and model copies follow from it."""
    shards = {node: list(slots) for node, slots in (node_shards or {}).items() if len(slots) > 1}
    node_slots = {**node_slots, **{node: slots[0] for node, slots in shards.items()}}
    every = {node: shards.get(node, [slot]) for node, slot in node_slots.items()}
    group_slots: dict[str, list[str]] = {}
    model_slots: dict[str, list[str]] = {}
    for node, slots in every.items():
        group = node_group(pipeline, node)
        model = pipeline.spec.nodes[node].model
        for slot in slots:
            if group is not None and slot not in group_slots.setdefault(group, []):
                group_slots[group].append(slot)
            if model is not None and slot not in model_slots.setdefault(model, []):
                model_slots[model].append(slot)
    deadlock = push_cycle(pipeline, every)
    if deadlock is not None:
        raise PlacementError(deadlock)
    return Plan(step, group_slots, model_slots, dict(node_slots), list(reasons or []), shards)


def splittable(pipeline: PipelineGraph, node: str) -> bool:
    """Whether ``node`` can run over several devices: generation splits by prompts, inference
    by rows, an update trains data-parallel (its role's ``split``)."""
    return pipeline.spec.nodes[node].split != "none"


def node_group(pipeline: PipelineGraph, node: str) -> str | None:
    """The device group a node runs in: its own, else its model's; None for model-less nodes."""
    spec = pipeline.spec.nodes[node]
    return spec.device_group or (model_group(pipeline, spec.model) if spec.model else None)


def without_slots(pipeline: PipelineGraph, plan: Plan, lost: set[str], survivors: list[str], step: int) -> Plan:
    """``plan`` with the slots in ``lost`` gone: a split node keeps its surviving shards, and a
    node left without a slot moves to where its model already runs on a survivor, else to the
    survivor that runs the fewest nodes (first in ``survivors`` on a tie), and the other nodes
    of its model follow it there: the move makes no copy of a model that an update would have
    to push its weights to. Where those homes would make two updates push weights to each
    other's workers (:func:`push_cycle`), every moved node goes to one survivor that makes no
    such cycle. Raises PlacementError when no survivor is left, or every choice deadlocks."""
    if not survivors:
        raise PlacementError(f"no worker is left to run the pipeline (lost: {', '.join(sorted(lost))}; no other "
                             "worker of the cluster answers)")
    shards = {node: [slot for slot in slots if slot not in lost] for node, slots in plan.node_shards.items()}
    load = {slot: 0 for slot in survivors}
    home: dict[str, str] = {}
    """Model -> the survivor its moved nodes go to: where one of its nodes stays, else where
    the first of its moved nodes went."""
    for node, slot in plan.node_slots.items():
        kept = shards.get(node, [slot] if slot not in lost else [])
        for part in kept:
            if part in load:
                load[part] += 1
        model = pipeline.spec.nodes[node].model
        if kept and model is not None:
            home.setdefault(model, kept[0])
    node_slots: dict[str, str] = {}
    reasons = []
    moved: list[str] = []
    for node, slot in plan.node_slots.items():
        kept = shards.get(node, [slot] if slot not in lost else [])
        if kept:
            node_slots[node] = kept[0]
            continue
        moved.append(node)
        model = pipeline.spec.nodes[node].model
        target = home.get(model) if model is not None else None
        if target is None:
            target = min(survivors, key=lambda name: (load[name], survivors.index(name)))
            if model is not None:
                home[model] = target
        load[target] += 1
        node_slots[node] = target
        reasons.append(f"{node} -> {target}: {slot} was lost")
    kept_shards = {node: slots for node, slots in shards.items() if len(slots) > 1}

    def layout(slots: dict[str, str]) -> dict[str, list[str]]:
        return {node: kept_shards.get(node, [slot]) for node, slot in slots.items()}

    if moved and push_cycle(pipeline, layout(node_slots)) is not None:
        # the models' homes made updates push weights to each other's workers: every moved
        # node on one survivor instead, the least busy first, where that makes no such cycle
        for target in sorted(survivors, key=lambda name: (load[name], survivors.index(name))):
            together = {**node_slots, **{node: target for node in moved}}
            if push_cycle(pipeline, layout(together)) is None:
                node_slots = together
                reasons = [f"{node} -> {target}: {plan.node_slots[node]} was lost" for node in moved]
                break
    return plan_for(pipeline, node_slots, step, reasons, kept_shards)
