"""What changes between two plans, and what carrying it out costs.

A move is one model changing devices (its generate, inference and update nodes move
together when they share it), or a model-less node changing devices. Its cost is

    move_s = bytes / link bandwidth + restart_s

where ``bytes`` are the weights, plus gradients and optimizer state when the model
trains, sent from a device that still holds them (from host memory, i.e. a checkpoint,
when none does), and ``restart_s`` is starting the role's actor on the new device.
Offloaded models keep their weights in host memory, so moving them sends nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence

from flowrl.devices.inventory import Device, Inventory
from flowrl.planner.compiled import CompiledPlan, NodePlan
from flowrl.planner.costs import GB, CostSource, transfer_s
from flowrl.scheduler.events import Move


def plan_moves(
    old: CompiledPlan,
    new: CompiledPlan,
    inventory: Inventory,
    costs: CostSource,
    restart_s: float,
    speeds: Mapping[str, float],
    lost: Collection[str] = (),
    added: Collection[str] = (),
) -> list[Move]:
    """Every move that turns ``old`` into ``new``, in node order.

    ``inventory`` is the cluster the new plan runs on; ``speeds`` maps slow devices to
    their measured speed share (0.5 = half speed), ``lost`` and ``added`` name devices
    that left or joined; they only shape each move's ``why``.
    """
    old_nodes = {item.node: item for item in old.nodes}
    subjects: dict[str, list[str]] = {}
    for item in new.nodes:
        before = old_nodes.get(item.node)
        if before is None or before.devices != item.devices or before.offloaded != item.offloaded:
            subjects.setdefault(item.model or item.node, []).append(item.node)
    present = {device.id: device for device in inventory.devices}
    moves: list[Move] = []
    for subject, nodes in subjects.items():
        from_devices = _union(old_nodes[node].devices for node in nodes if node in old_nodes)
        to_devices = _union(_node(new, node).devices for node in nodes)
        num_bytes = _bytes(new, nodes, costs)
        holding = {
            device_id
            for item in old.nodes
            if (item.model or item.node) == subject and not item.offloaded
            for device_id in item.devices
        }
        targets = [present[d] for d in to_devices if d not in holding and d in present]
        sources = [present[d] for d in sorted(holding) if d in present]
        if not sources:
            sources = _host_memory(inventory, targets)
        send_s = transfer_s(num_bytes, sources, targets) if num_bytes and targets else 0.0
        moves.append(Move(subject, tuple(nodes), from_devices, to_devices, num_bytes,
                          send_s + restart_s, ""))
    return [_with_why(move, moves, speeds, lost, added) for move in moves]


def _node(plan: CompiledPlan, node: str) -> NodePlan:
    return next(item for item in plan.nodes if item.node == node)


def _union(groups: Iterable[Sequence[str]]) -> tuple[str, ...]:
    seen: list[str] = []
    for group in groups:
        for device_id in group:
            if device_id not in seen:
                seen.append(device_id)
    return tuple(seen)


def _bytes(plan: CompiledPlan, nodes: list[str], costs: CostSource) -> float:
    """Weights of the model (unless offloaded everywhere) plus its training state."""
    weights = state = 0.0
    for node in nodes:
        item = _node(plan, node)
        memory = costs.memory(node, len(item.devices))
        if not item.offloaded:
            weights = max(weights, memory.weights_gb)
        state = max(state, memory.state_gb)
    return (weights + state) * GB


def _host_memory(inventory: Inventory, targets: list[Device]) -> list[Device]:
    """A CPU slot on the targets' host: where a checkpoint is read from."""
    hosts = {device.host for device in targets}
    same = [d for d in inventory.cpus() if d.host in hosts]
    return same[:1] or inventory.cpus()[:1]


def _with_why(
    move: Move,
    moves: list[Move],
    speeds: Mapping[str, float],
    lost: Collection[str],
    added: Collection[str],
) -> Move:
    reasons: list[str] = []
    for device_id in move.from_devices:
        if device_id in lost:
            reasons.append(f"{device_id} lost")
        elif device_id in speeds and device_id not in move.to_devices:
            reasons.append(f"{device_id} at {speeds[device_id]:.0%} speed")
    for device_id in move.to_devices:
        if device_id in added and device_id not in move.from_devices:
            reasons.append(f"{device_id} added")
    if not reasons:
        for other in moves:
            freed = [d for d in move.to_devices if d in other.from_devices
                     and d not in other.to_devices and other is not move]
            if freed:
                reasons.append(f"takes {', '.join(freed)} that {other.subject} leaves")
                break
    if not reasons:
        reasons.append("faster placement predicted")
    return Move(move.subject, move.nodes, move.from_devices, move.to_devices, move.num_bytes,
                move.cost_s, "; ".join(reasons))
