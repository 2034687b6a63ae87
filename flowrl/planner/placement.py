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


def plan_from_compiled(pipeline: PipelineGraph, compiled: CompiledPlan, slots: list[str]) -> Plan:
    """The runtime's placement from the planner's: every node on its one device.

    The runtime runs each node on one worker; a node planned over several devices belongs
    to a multi-device group, which is refused with the fix rather than silently narrowed.
    """
    node_slots: dict[str, str] = {}
    reasons: list[str] = []
    for node in compiled.nodes:
        if len(node.devices) > 1:
            group = _node_group(pipeline, node.node) or node.node
            raise PlacementError(
                f"devices.{group}: node '{node.node}' is planned over {len(node.devices)} devices; "
                "data-parallel device groups are not available in this version. Set `count: 1`."
            )
        missing = [device for device in node.devices if device not in slots]
        if missing:
            raise PlacementError(
                f"nodes.{node.node}: planned on {', '.join(missing)}, but no Dask worker serves it "
                f"(workers: {', '.join(slots)}). GPU workers are not started in this version: "
                "set `type: cpu` for its device group."
            )
        node_slots[node.node] = node.devices[0]
        reasons.append(f"{node.node} -> {node.devices[0]}: {node.reason}")
    return plan_for(pipeline, node_slots, compiled.step, reasons)


def plan_for(pipeline: PipelineGraph, node_slots: dict[str, str], step: int = 0, reasons: list[str] | None = None) -> Plan:
    """The plan that runs each node on its slot in ``node_slots``; groups and model copies
    follow from it."""
    group_slots: dict[str, list[str]] = {}
    for node, slot in node_slots.items():
        group = _node_group(pipeline, node)
        if group is not None and slot not in group_slots.setdefault(group, []):
            group_slots[group].append(slot)
    return Plan(step, group_slots, _model_slots(pipeline, node_slots), dict(node_slots), list(reasons or []))


def _model_slots(pipeline: PipelineGraph, node_slots: dict[str, str]) -> dict[str, list[str]]:
    model_slots: dict[str, list[str]] = {}
    for node, slot in node_slots.items():
        model = pipeline.spec.nodes[node].model
        if model is not None and slot not in model_slots.setdefault(model, []):
            model_slots[model].append(slot)
    return model_slots


def _node_group(pipeline: PipelineGraph, node: str) -> str | None:
    """The device group a node runs in: its own, else its model's; None for model-less nodes."""
    spec = pipeline.spec.nodes[node]
    return spec.device_group or (model_group(pipeline, spec.model) if spec.model else None)
