"""Weight pushes that wait for each other.

After an update, the trainer's worker sends the new weights to the model's copies on other
workers (``runtime.weight_sync``) and waits until each has taken them; a worker takes them
between its node calls, one at a time. Two trained models whose updates run on each other's
copies' workers (the actor trains on A and generates on B, the critic trains on B and
computes values on A) would each wait for the other worker, busy with its own update: every
step would hang until the node timeout, and the recovery would place them the same way. A
placement with such a cycle of pushes is refused instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import networkx as nx

from flowrl.graph import PipelineGraph


def push_cycle(pipeline: PipelineGraph, node_devices: Mapping[str, Sequence[str]]) -> str | None:
    """Why the placement ``node_devices`` (node -> the devices or slots it runs on, a split
    node's first device first) would deadlock its weight pushes, or None when no updates push
    to each other's workers."""
    spec = pipeline.spec
    users: dict[tuple[str, str], list[str]] = {}
    """(model, device) -> the nodes that use the model's copy there."""
    for node, devices in node_devices.items():
        model = spec.nodes[node].model
        if model is not None:
            for device in devices:
                users.setdefault((model, device), []).append(node)
    holders: dict[str, set[str]] = {}
    """Model -> the devices that hold a copy of it."""
    for model, device in users:
        holders.setdefault(model, set()).add(device)
    pushes: nx.MultiDiGraph = nx.MultiDiGraph()
    for node, devices in node_devices.items():
        model = spec.nodes[node].model
        if model is None or not spec.nodes[node].trains:
            continue
        # the first device (rank 0 of a data-parallel update) pushes; the other ranks are
        # free once their part of the update is done
        for peer in sorted(holders.get(model, set()) - set(devices)):
            pushes.add_edge(devices[0], peer, model=model, node=node)
    try:
        cycle = nx.find_cycle(pushes)
    except nx.NetworkXNoCycle:
        return None
    legs = []
    for source, target, key in cycle:
        data = pushes.edges[source, target, key]
        readers = ", ".join(users.get((data["model"], target), []))
        legs.append(f"'{data['model']}' trains on {source} ({data['node']}) and sends its weights to its copy on "
                    f"{target} ({readers})")
    return (f"{'; '.join(legs)}: each update would wait for a worker busy with the other update to take its "
            "weights, and the step would hang; keep each trained model's nodes in one device group (or let the "
            "groups share a device)")


__all__ = ["push_cycle"]
