"""Unpinned CPU slots of one machine share its cores.

The workers of a local cluster are not pinned by default: each node call on a CPU slot gets
the machine's cores divided by the workers that may compute beside it (``flowrl.runtime.threads``),
so two model nodes that run at once on two slots of one machine each compute about half as
fast as alone. The planner predicts the same: the part of a node's time on such a slot that
the threads of the call do (its FLOPs and bytes) is multiplied by :func:`core_shares` (the
machine's cores over the threads the call gets), so a placement that spreads a pipeline over
the slots of one machine is not predicted faster than it runs (on 2 cores, ``ppo_tiny``'s
critic on a slot of its own was predicted at 31 ms per step against 48 ms beside the actor,
and measured 149 against 136). The rest, the call's and the model's overheads (Python and
dispatch, one thread whatever the call gets: ``CostSource.fixed_s``), is not slowed
(:func:`shared_time`): on 2 cores ``ppo_tiny``'s model nodes took 1.5-1.9 times as long with
the critic on a slot of its own as all on one slot, not 2.

A node "may compute beside" another when neither depends on the other and both run a model;
a score function or an advantage estimate is light and counted as nothing. With a fixed
``runtime.torch_threads`` every call takes that many threads whatever runs beside it: the
calls slow each other only when together they ask for more threads than the machine has
cores.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import networkx as nx

from flowrl.devices.inventory import Device, Inventory
from flowrl.graph import PipelineGraph
from flowrl.planner.costs import CostSource


def heavy(pipeline: PipelineGraph, node: str) -> bool:
    """A node that runs a model (generation, a forward, an update)."""
    return pipeline.spec.nodes[node].model is not None


def related_nodes(pipeline: PipelineGraph) -> dict[str, set[str]]:
    """Per node: itself, its ancestors and its descendants (nodes that never run beside it);
    computed once per graph (a search simulates many placements of one pipeline)."""
    return _related(tuple(pipeline.spec.nodes), frozenset(pipeline.graph.edges))


@functools.lru_cache(maxsize=32)
def _related(nodes: tuple[str, ...], edges: frozenset[tuple[str, str]]) -> dict[str, set[str]]:
    graph: nx.DiGraph[str] = nx.DiGraph()
    graph.add_nodes_from(nodes)
    graph.add_edges_from(edges)
    return {node: nx.ancestors(graph, node) | nx.descendants(graph, node) | {node} for node in nodes}


def company(pipeline: PipelineGraph, node_slots: Mapping[str, Sequence[str]], node: str, slot: str,
            related: Mapping[str, set[str]]) -> set[str]:
    """The other slots whose work may run while ``node`` runs on ``slot``: the node's own
    other parts, and the slots of the model nodes it neither depends on nor feeds."""
    others = {other for other in node_slots[node] if other != slot}
    for other, slots in node_slots.items():
        if other in related[node] or not heavy(pipeline, other):
            continue
        others.update(s for s in slots if s != slot)
    return others


def divided_threads(cores: int, beside: int) -> int:
    """Torch threads of a call with ``beside`` other slots of its machine's ``cores`` that
    may compute at the same time: the runtime's division (``flowrl.runtime.threads``)."""
    return max(1, cores // (1 + beside))


def cores_shared(pipeline: PipelineGraph) -> bool:
    """Whether node calls on CPU slots of one machine share its cores: not with
    ``runtime.pin_cpus`` on a local cluster (each slot has its own cores; a joined cluster's
    workers are not pinned by flowrl)."""
    runtime = pipeline.spec.runtime
    return not (runtime.pin_cpus and runtime.scheduler_address is None)


def slowdown(cores: int, beside: int, fixed_threads: int | None) -> float:
    """How many times longer a call takes with ``beside`` other slots of its machine's
    ``cores`` computing at once than with the machine to itself: the cores over the threads
    the runtime gives it; with ``fixed_threads`` per call (``runtime.torch_threads``), the
    threads all the calls ask for over the cores, when that is more than 1 (oversubscribed
    threads take turns), a call counting at most the cores (what it has alone)."""
    if fixed_threads:
        return max(1.0, (1 + beside) * min(fixed_threads, cores) / max(1, cores))
    return cores / divided_threads(cores, beside)


def shared_time(costs: CostSource, node: str, devices: Sequence[Device], offloaded: bool, share: float) -> float:
    """``node``'s seconds on ``devices`` when its threads' work takes ``share`` times as long
    (:func:`core_shares`): its overheads (``costs.fixed_s``) as they are, the rest ``share``
    times over."""
    total = costs.compute_s(node, devices, offloaded)
    if share == 1.0:
        return total
    fixed = min(total, costs.fixed_s(node, devices, offloaded))
    return fixed + (total - fixed) * share


def host_cores(inventory: Inventory) -> dict[str, int]:
    """Cores of each host of ``inventory``."""
    return {host.name: host.cores for host in inventory.hosts}


def core_shares(pipeline: PipelineGraph, node_devices: Mapping[str, Sequence[Device]],
                cores: Mapping[str, int] | None = None) -> dict[str, float]:
    """Per model node on CPU slots: how many times longer it takes than alone beside the
    most CPU slots of its machine that may compute at the same time (:func:`slowdown`, from
    the machine's ``cores`` per host; unknown: as many as the threads of those calls); 1.0
    for every other node."""
    shares = {node: 1.0 for node in node_devices}
    on_cpu = [node for node, devices in node_devices.items()
              if heavy(pipeline, node) and any(device.kind == "cpu" for device in devices)]
    if not on_cpu or not cores_shared(pipeline):
        return shares
    related = related_nodes(pipeline)
    slots = {node: tuple(device.id for device in devices) for node, devices in node_devices.items()}
    by_id = {device.id: device for devices in node_devices.values() for device in devices}
    fixed = pipeline.spec.runtime.torch_threads
    for node in on_cpu:
        for device in node_devices[node]:
            if device.kind != "cpu":
                continue
            beside = company(pipeline, slots, node, device.id, related)
            same_machine = sum(1 for other in beside if by_id[other].kind == "cpu" and by_id[other].host == device.host)
            # unknown cores: as many as the threads of the calls that may run at once
            machine_cores = (cores or {}).get(device.host, (1 + same_machine) * (fixed or 1))
            slower = slowdown(machine_cores, same_machine, fixed)
            shares[node] = max(shares[node], slower)
    return shares
