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
from flowrl.planner.compiled import CompiledPlan, plan_from_evaluation
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
    reasons = {item.node: item.reason for item in template.nodes}
    for node in stayed:
        # Placement devices are a tuple, a plan's a list: compare them as tuples.
        if evaluation.placement[node].devices != tuple(_devices(template, node)):
            reasons[node] = STAY_REASON
    return plan_from_evaluation(
        pipeline, inventory, costs, evaluation, reasons, template.step, template.method, template.num_evaluated
    )


def _devices(plan: CompiledPlan, node: str) -> list[str]:
    return next((item.devices for item in plan.nodes if item.node == node), [])
