"""The exact assignment behind group matching: a min-cost flow over device classes.

Devices with the same type, memory and architecture are interchangeable, so they are
folded into one class node whose capacity is how many of them are free. The network is

    source --count--> demand (a group, or groups that share) --eligible--> class --size--> sink

and a maximum flow of least cost is an assignment that gives every demand its count
(when one exists) and, among those, is best by the cost below. With classes instead of
single devices, a 1,000-GPU inventory of five types is a graph of a few dozen nodes.

The cost of sending one device of class c to demand d is lexicographic, encoded as one
integer so a single solve is exact:

1. preference: the position of c's architecture in d's ``preferred_arch`` (0 = first choice);
2. memory: ``-weight(d) * memory(c)``, where groups that ask for more memory have a higher
   weight, so the biggest cards go to the groups that need memory most, and spare cards
   left over are the small ones;
3. a tie-break on device numbers (earlier groups take lower numbers), so equal choices
   always come out the same way.

When no assignment exists, a minimum cut names the demands that compete for too few
devices (Hall's condition fails for them); ``Unfeasible`` carries them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import networkx as nx

from flowrl.devices.inventory import Device

_SOURCE = ("source",)
_SINK = ("sink",)


@dataclass(frozen=True)
class Demand:
    """What one group (or a set of groups that share devices) asks for."""

    name: str
    count: int
    eligible: frozenset[str]
    """Ids of the devices that satisfy every hard constraint."""
    preference: dict[str, int]
    """Device id -> rank in ``preferred_arch`` (0 = first choice); missing means no preference."""
    weight: int
    """Memory priority: higher gets bigger cards."""


@dataclass(frozen=True)
class Unfeasible:
    """Demands that together need more devices than fit them."""

    demands: tuple[str, ...]
    """Names of the competing demands, in the order given."""
    devices: tuple[str, ...]
    """Ids of every device that fits at least one of them."""


def _class_key(device: Device) -> tuple[str, float, str, str]:
    return (device.name, device.memory_gb, device.arch, device.family)


def assign(
    demands: Sequence[Demand], devices: Sequence[Device]
) -> dict[str, list[str]] | Unfeasible:
    """Device ids per demand, exactly ``count`` each and disjoint; or who competes."""
    pool = sorted(devices, key=lambda device: device.number)
    classes: dict[tuple[str, float, str, str], list[Device]] = {}
    for device in pool:
        classes.setdefault(_class_key(device), []).append(device)
    members = list(classes.values())

    graph = nx.DiGraph()
    total = sum(demand.count for demand in demands)
    graph.add_node(_SOURCE, demand=-total)
    graph.add_node(_SINK, demand=total)
    # scale factors that keep the three cost levels from mixing (see module docstring)
    max_number = max((device.number for device in pool), default=0) + 1
    tie_unit = len(demands) * max_number + 1
    memory_unit = max((_tenths(group[0].memory_gb) for group in members), default=1)
    max_weight = max((demand.weight for demand in demands), default=1)
    tie_scale = 1
    memory_scale = total * tie_unit + 1
    preference_scale = (total * memory_unit * max_weight + 1) * memory_scale
    for position, demand in enumerate(demands):
        node = ("demand", position)
        graph.add_edge(_SOURCE, node, capacity=demand.count, weight=0)
        for class_index, group in enumerate(members):
            first = group[0]
            if first.id not in demand.eligible:
                continue
            rank = demand.preference.get(first.id, 0)
            memory_cost = memory_unit * max_weight - demand.weight * _tenths(first.memory_gb)
            tie = (len(demands) - position) * first.number
            cost = rank * preference_scale + memory_cost * memory_scale + tie * tie_scale
            graph.add_edge(node, ("class", class_index), weight=cost)
    for class_index, group in enumerate(members):
        graph.add_edge(("class", class_index), _SINK, capacity=len(group), weight=0)

    flow_value, _ = nx.maximum_flow(graph, _SOURCE, _SINK)
    if flow_value < total:
        return _competing(graph, demands)
    flow = nx.min_cost_flow(graph)
    result: dict[str, list[str]] = {demand.name: [] for demand in demands}
    for class_index, group in enumerate(members):
        free = list(group)  # lowest numbers first; demands in given order take them
        for position, demand in enumerate(demands):
            taken = flow[("demand", position)].get(("class", class_index), 0)
            result[demand.name].extend(device.id for device in free[:taken])
            free = free[taken:]
    return result


def _tenths(memory_gb: float) -> int:
    return int(round(memory_gb * 10))


def _competing(graph: nx.DiGraph, demands: Sequence[Demand]) -> Unfeasible:
    """The source side of a minimum cut: demands whose eligible devices are too few."""
    _, (source_side, _) = nx.minimum_cut(graph, _SOURCE, _SINK)
    names = tuple(
        demand.name
        for position, demand in enumerate(demands)
        if ("demand", position) in source_side
    )
    chosen = [demand for demand in demands if demand.name in names]
    # A minimum cut can include demands that merely got pushed around; drop every one
    # whose removal keeps the rest short of devices, so the message names only the culprits.
    for demand in reversed(list(chosen)):
        rest = [other for other in chosen if other is not demand]
        if rest and _shortage(rest):
            chosen = rest
    fitting = sorted(
        set().union(*(demand.eligible for demand in chosen)),
        key=lambda device_id: int(device_id.rsplit("-", 1)[1]),
    )
    return Unfeasible(tuple(demand.name for demand in chosen), tuple(fitting))


def _shortage(demands: Sequence[Demand]) -> bool:
    """Hall's condition fails: they need more devices than fit any of them."""
    fitting = set().union(*(demand.eligible for demand in demands))
    return sum(demand.count for demand in demands) > len(fitting)
