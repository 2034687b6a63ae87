"""Keep only the moves that pay: prune a candidate plan move by move.

The planner optimises the whole placement, so a re-plan forced by one slow device may
also shuffle nodes whose new place gains a fraction of a millisecond. Each such move
costs a restart. A move is put back (its nodes return to their current devices) when
undoing it slows the predicted step by less than its cost, spread over the interval:

    (step_s without the move - step_s with it) * horizon  <  move_s * (1 + min_gain)

Moves are tried in the order the planner made them; a node cannot go back to a device
that is gone. The pruned placement is turned back into a ``CompiledPlan``.
"""

from __future__ import annotations

from flowrl.devices.inventory import Inventory
from flowrl.graph import PipelineGraph
from flowrl.planner.compiled import CompiledPlan, DevicePlan, NodePlan, TimelineEntry
from flowrl.planner.costs import CostSource
from flowrl.planner.search import Evaluation, evaluate
from flowrl.planner.simulate import Placement
from flowrl.scheduler.events import Move

STAY_REASON = "stays: moving it would not pay for itself"


def placement_of(plan: CompiledPlan) -> dict[str, Placement]:
    return {item.node: Placement(tuple(item.devices), item.offloaded) for item in plan.nodes}


def prune_moves(
    pipeline: PipelineGraph,
    current: CompiledPlan,
    candidate: CompiledPlan,
    moves: list[Move],
    inventory: Inventory,
    costs: CostSource,
    horizon_steps: int,
    min_gain: float,
    memory_reserve: float,
) -> CompiledPlan:
    """``candidate`` without the moves that do not pay; ``candidate`` itself if none."""
    present = {device.id for device in inventory.devices}
    old = placement_of(current)
    placement = placement_of(candidate)
    step_s = candidate.iteration_s
    kept: Evaluation | None = None
    for move in moves:
        back = {node: old[node] for node in move.nodes if node in old}
        if len(back) != len(move.nodes) or any(
            device_id not in present for item in back.values() for device_id in item.devices
        ):
            continue
        trial = evaluate(pipeline, {**placement, **back}, inventory, costs, memory_reserve)
        slower_s = trial.schedule.iteration_s - step_s
        if trial.feasible and slower_s * horizon_steps < move.cost_s * (1 + min_gain):
            placement, step_s, kept = trial.placement, trial.schedule.iteration_s, trial
    if kept is None:
        return candidate
    stayed = {node for node, item in placement.items() if item == old.get(node)}
    return compiled_from(pipeline, inventory, costs, kept, candidate, stayed)


def compiled_from(
    pipeline: PipelineGraph,
    inventory: Inventory,
    costs: CostSource,
    evaluation: Evaluation,
    template: CompiledPlan,
    stayed: set[str],
) -> CompiledPlan:
    """A ``CompiledPlan`` for ``evaluation``'s placement; reasons from ``template``."""
    schedule = evaluation.schedule
    reasons = {item.node: item.reason for item in template.nodes}
    nodes: list[NodePlan] = []
    for node in pipeline.topological_order():
        chosen = evaluation.placement[node]
        task = schedule.task(node)
        memory = costs.memory(node, len(chosen.devices))
        reason = STAY_REASON if node in stayed and chosen.devices != _devices(template, node) \
            else reasons.get(node, "")
        nodes.append(NodePlan(
            node=node, role=pipeline.spec.nodes[node].role, model=pipeline.spec.nodes[node].model,
            devices=list(chosen.devices), offloaded=chosen.offloaded, start_s=task.start_s,
            end_s=task.end_s, memory_gb=memory.weights_gb + memory.state_gb + memory.transient_gb,
            reason=reason,
        ))
    devices: list[DevicePlan] = []
    for device in inventory.devices:
        if device.id not in evaluation.memory_gb:
            continue
        here = [item for item in nodes if device.id in item.devices]
        models = sorted({i.model for i in here if i.model is not None and not i.offloaded})
        devices.append(DevicePlan(device.id, device.label, device.kind, device.memory_gb,
                                  round(evaluation.memory_gb[device.id], 6), models,
                                  [item.node for item in here]))
    rank = {device.id: index for index, device in enumerate(inventory.devices)}
    timeline = sorted(
        (TimelineEntry(d, task.name, task.kind, task.start_s, task.end_s)
         for task in schedule.tasks for d in task.devices),
        key=lambda entry: (rank[entry.device], entry.start_s),
    )
    return CompiledPlan(
        pipeline=pipeline.name,
        step=template.step,
        iteration_s=schedule.iteration_s,
        nodes=nodes,
        devices=devices,
        critical_path=list(schedule.critical_path),
        timeline=timeline,
        colocations={item.device: item.models for item in devices if len(item.models) > 1},
        offloaded=[item.node for item in nodes if item.offloaded],
        method=template.method,
        num_evaluated=template.num_evaluated,
        reasons=[f"{item.node} -> {', '.join(item.devices)}: {item.reason}" for item in nodes],
    )


def _devices(plan: CompiledPlan, node: str) -> list[str]:
    return next((item.devices for item in plan.nodes if item.node == node), [])
