"""Unpinned CPU slots of one machine share its cores.

The workers of a local cluster are not pinned by default: each node call on a CPU slot gets
the machine's cores divided by the workers that may compute beside it (``flowrl.runtime.threads``),
so two model nodes that run at once on two slots of one machine each take about twice as long
as alone. The planner predicts the same: a node's compute time on such a slot is multiplied
by :func:`core_shares`, so a placement that spreads a pipeline over the slots of one machine
is not predicted faster than it runs (on 2 cores, ``ppo_tiny``'s critic on a slot of its own
was predicted at 31 ms per step against 48 ms beside the actor, and measured 149 against 136).

A node "may compute beside" another when neither depends on the other and both run a model;
a score function or an advantage estimate is light and counted as nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import networkx as nx

from flowrl.devices.inventory import Device
from flowrl.graph import PipelineGraph


def heavy(pipeline: PipelineGraph, node: str) -> bool:
    """A node that runs a model (generation, a forward, an update)."""
    return pipeline.spec.nodes[node].model is not None


def related_nodes(pipeline: PipelineGraph) -> dict[str, set[str]]:
    """Per node: itself, its ancestors and its descendants (nodes that never run beside it)."""
    graph = pipeline.graph
    return {node: nx.ancestors(graph, node) | nx.descendants(graph, node) | {node}
            for node in pipeline.spec.nodes}


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


def cores_shared(pipeline: PipelineGraph) -> bool:
    """Whether node calls on unpinned CPU slots divide the cores (the default): not with
    ``runtime.pin_cpus`` (each slot has its own) or a fixed ``runtime.torch_threads``."""
    runtime = pipeline.spec.runtime
    return not runtime.pin_cpus and not runtime.torch_threads


def core_shares(pipeline: PipelineGraph, node_devices: Mapping[str, Sequence[Device]]) -> dict[str, float]:
    """Per model node on CPU slots: 1 + the most CPU slots of one of its slots' machine that
    may compute beside it (its time is multiplied by this); 1.0 for every other node."""
    shares = {node: 1.0 for node in node_devices}
    if not cores_shared(pipeline):
        return shares
    related = related_nodes(pipeline)
    slots = {node: tuple(device.id for device in devices) for node, devices in node_devices.items()}
    by_id = {device.id: device for devices in node_devices.values() for device in devices}
    for node, devices in node_devices.items():
        if not heavy(pipeline, node):
            continue
        for device in devices:
            if device.kind != "cpu":
                continue
            beside = company(pipeline, slots, node, device.id, related)
            same_machine = {other for other in beside if by_id[other].kind == "cpu" and by_id[other].host == device.host}
            shares[node] = max(shares[node], 1.0 + len(same_machine))
    return shares
