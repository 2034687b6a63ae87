"""Static placement: which device slot hosts each device group, model and node.

This is the placement every run starts from. It is a pure function of the pipeline and
the slot names, so it is deterministic and testable without a cluster. Groups take slots
in the order they are declared, one group per slot while slots last, then sharing
round-robin (on a CPU machine with 2 slots and 3 groups, the third shares with the first).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from flowrl.devices.groups import AUTO_GROUP_PREFIX, model_group
from flowrl.errors import PlacementError
from flowrl.graph import PipelineGraph
from flowrl.planner.compiled import CompiledPlan



@dataclass(frozen=True)
class Plan:
    """Plain data (JSON-ready): where everything runs."""

    step: int
    group_slots: dict[str, list[str]]
    """Device group -> the slots that serve it."""
    model_slots: dict[str, list[str]]
    """Model -> the slots that hold a copy (every slot where one of its nodes runs)."""
    node_slots: dict[str, str]
    """Node -> the slot that runs it."""
    reasons: list[str] = field(default_factory=list)
    """One line per decision."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def weight_peers(self, node: str, model: str) -> list[str]:
        """Slots other than the node's own that hold ``model`` and must get its new weights."""
        own = self.node_slots[node]
        return [slot for slot in self.model_slots.get(model, []) if slot != own]


def plan_static(
    pipeline: PipelineGraph,
    slots: list[str],
    step: int = 0,
    assignment: dict[str, list[str]] | None = None,
    assignment_reasons: dict[str, str] | None = None,
) -> Plan:
    """Place the pipeline on ``slots``.

    ``assignment`` (group -> devices, from device-group matching) decides the group's slot
    where it is given; other groups take slots in declaration order.
    """
    if not slots:
        raise PlacementError("no device slots: the cluster has no workers")
    spec = pipeline.spec
    groups = _groups_in_use(pipeline)
    reasons: list[str] = []
    group_slots: dict[str, list[str]] = {}
    for index, group in enumerate(groups):
        if assignment and assignment.get(group):
            group_slots[group] = [_matched_slot(group, assignment[group], slots, pipeline)]
            why = (assignment_reasons or {}).get(group, "matched")
            reasons.append(f"{group} -> {group_slots[group][0]}: {why}")
        else:
            group_slots[group] = [_slot_for_group(pipeline, group, index, slots, reasons)]

    node_slots: dict[str, str] = {}
    for node in pipeline.topological_order():
        node_spec = spec.nodes[node]
        if node_spec.device_group is not None:
            node_slots[node] = group_slots[node_spec.device_group][0]
            reasons.append(f"{node} -> {node_slots[node]}: its own device_group '{node_spec.device_group}'")
        elif node_spec.model is not None:
            group = model_group(pipeline, node_spec.model)
            node_slots[node] = group_slots[group][0]
            reasons.append(f"{node} -> {node_slots[node]}: where model '{node_spec.model}' lives ({group})")
        else:
            producers = [p for p in pipeline.producers(node) if p in node_slots]
            node_slots[node] = node_slots[producers[0]] if producers else slots[0]
            source = producers[0] if producers else "the data source"
            reasons.append(f"{node} -> {node_slots[node]}: no model; next to its input {source} (no transfer)")

    return Plan(step, group_slots, _model_slots(pipeline, node_slots), node_slots, reasons)


def plan_from_compiled(pipeline: PipelineGraph, compiled: CompiledPlan, slots: list[str]) -> Plan:
    """The runtime's placement from the planner's: each node on the first of its devices.

    A node the planner widened over several devices (data-parallel inference) runs on the
    first of them; the reason says so, and the plan file keeps the planner's full answer.
    """
    node_slots: dict[str, str] = {}
    reasons: list[str] = []
    for node in compiled.nodes:
        missing = [device for device in node.devices if device not in slots]
        if missing:
            raise PlacementError(
                f"nodes.{node.node}: planned on {', '.join(missing)}, but no Dask worker serves it "
                f"(workers: {', '.join(slots)}). GPU workers are not started in this version: "
                "set `type: cpu` for its device group."
            )
        node_slots[node.node] = node.devices[0]
        note = f" (planned over {len(node.devices)} devices; runs on the first)" if len(node.devices) > 1 else ""
        reasons.append(f"{node.node} -> {node.devices[0]}: {node.reason}{note}")
    group_slots: dict[str, list[str]] = {}
    for node, slot in node_slots.items():
        spec = pipeline.spec.nodes[node]
        group = spec.device_group or (model_group(pipeline, spec.model) if spec.model else None)
        if group is not None and slot not in group_slots.setdefault(group, []):
            group_slots[group].append(slot)
    return Plan(compiled.step, group_slots, _model_slots(pipeline, node_slots), node_slots, reasons)


def _model_slots(pipeline: PipelineGraph, node_slots: dict[str, str]) -> dict[str, list[str]]:
    model_slots: dict[str, list[str]] = {}
    for node, slot in node_slots.items():
        model = pipeline.spec.nodes[node].model
        if model is not None and slot not in model_slots.setdefault(model, []):
            model_slots[model].append(slot)
    return model_slots


def _matched_slot(group: str, devices: list[str], slots: list[str], pipeline: PipelineGraph) -> str:
    if len(devices) > 1:
        raise PlacementError(
            f"devices.{group}: matched {len(devices)} devices; data-parallel device groups are not "
            "available in this version. Set `count: 1`."
        )
    if devices[0] not in slots:
        raise PlacementError(
            f"devices.{group}: matched device {devices[0]}, but no Dask worker serves it "
            f"(workers: {', '.join(slots)}). GPU workers are not started in this version: "
            "set `type: cpu` for this group."
        )
    return devices[0]


def _groups_in_use(pipeline: PipelineGraph) -> list[str]:
    spec = pipeline.spec
    used: list[str] = []
    for name in spec.devices:
        used.append(name)
    for model in spec.models:
        group = model_group(pipeline, model)
        if group not in used:
            used.append(group)
    return used


def _slot_for_group(pipeline: PipelineGraph, group: str, index: int, slots: list[str], reasons: list[str]) -> str:
    group_spec = pipeline.spec.devices.get(group)
    if group_spec is None:  # automatic group of a model that names none
        slot = slots[index % len(slots)]
        reasons.append(f"{group} -> {slot}: model names no device group; one CPU slot")
        return slot
    if group_spec.type == "gpu":
        raise PlacementError(
            f"devices.{group}: needs type gpu, but this cluster has only CPU slots ({', '.join(slots)}). "
            "Set `type: cpu` to run it on the CPU, or run where GPUs are visible."
        )
    count = group_spec.count or group_spec.min_count or 1
    if count > 1:
        raise PlacementError(
            f"devices.{group}: asks for {count} devices; data-parallel device groups are not available "
            "in this version. Set `count: 1`."
        )
    if group_spec.device_ids:
        wanted = group_spec.device_ids[0]
        if wanted >= len(slots):
            raise PlacementError(
                f"devices.{group}.device_ids: device {wanted} does not exist; the slots are "
                f"{', '.join(f'{i} ({s})' for i, s in enumerate(slots))}."
            )
        reasons.append(f"{group} -> {slots[wanted]}: pinned by device_ids")
        return slots[wanted]
    slot = slots[index % len(slots)]
    shared = " (shared: more groups than slots)" if index >= len(slots) else ""
    reasons.append(f"{group} -> {slot}: cpu slot {index % len(slots)}{shared}")
    return slot
