"""Other ways to give devices to device groups, close to the current one.

The planner places nodes inside the devices matched to their group, so moving a model
off a slow device means changing the match. Trying every match is exponential, and a
re-plan should change little, so the candidates are the current match and the ones one
step away from it around a *suspect* device (slow, newly added, under-used):

- substitution: a group gives up the suspect for a free device that meets its needs
  (or, for a new device, takes it instead of one of its own);
- swap: the suspect's group and another group exchange one device each, when each device
  meets the other group's needs (``min_memory_gb``, ``arch``, the device's kind).

Groups pinned with ``device_ids`` never change. A lost device is replaced the same way,
by a free device or by time-sharing one of another group's, next to a fresh match of the
remaining devices (with every group allowed to share when they no longer all fit).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from flowrl.devices.explain import fits_arch, fits_memory
from flowrl.devices.inventory import Device, Inventory
from flowrl.devices.matching import Match, match_groups
from flowrl.spec.schema import DeviceGroupSpec

Assignment = dict[str, list[str]]


def neighbour_matches(
    match: Match,
    groups: Mapping[str, DeviceGroupSpec],
    inventory: Inventory,
    suspects: Sequence[str],
) -> list[Match]:
    """The current match first, then every substitution and swap around ``suspects``."""
    devices = {device.id: device for device in inventory.devices}
    found: list[Assignment] = [_copy(match.assignment)]
    for suspect in suspects:
        device = devices.get(suspect)
        if device is None:
            continue
        holders = [g for g, ids in match.assignment.items() if suspect in ids and _movable(groups, g)]
        for group in holders:
            for free in _free(match.assignment, inventory, device.kind):
                if _fits(free, groups[group]):
                    found.append(_substitute(match.assignment, group, suspect, free.id))
            for other, ids in match.assignment.items():
                if other == group or not _movable(groups, other) or suspect in ids:
                    continue
                for device_id in ids:
                    partner = devices.get(device_id)
                    if partner is None or partner.kind != device.kind or device_id in match.assignment[group]:
                        continue
                    if _fits(device, groups[other]) and _fits(partner, groups[group]):
                        swapped = _substitute(match.assignment, group, suspect, device_id)
                        found.append(_substitute(swapped, other, device_id, suspect))
        if not holders and suspect not in _taken(match.assignment):
            for group, ids in match.assignment.items():
                if not _movable(groups, group) or not _fits(device, groups[group]):
                    continue
                for device_id in ids:
                    found.append(_substitute(match.assignment, group, device_id, suspect))
    return [replace(match, assignment=item) for item in _unique(found)]


def repair_matches(
    match: Match,
    groups: Mapping[str, DeviceGroupSpec],
    inventory: Inventory,
    lost: str,
) -> list[Match]:
    """Matches on ``inventory`` (which no longer has ``lost``); empty when none works."""
    found: list[Match] = []
    fresh = match_groups(groups, inventory)
    if not fresh.ok:
        kinds = {spec.type for spec in groups.values()}
        shared = [frozenset(g for g, s in groups.items() if s.type == kind) for kind in kinds]
        fresh = match_groups(groups, inventory, shared=shared)
    if fresh.ok:
        found.append(fresh)
    devices = {device.id: device for device in inventory.devices}
    repairs: list[Assignment] = []
    partial: list[Assignment] = [_copy(match.assignment)]
    for group, ids in match.assignment.items():
        if lost not in ids:
            continue
        if not _movable(groups, group):
            return found  # a pinned group lost its device: only a fresh match can say
        spec = groups[group]
        options = [d for d in inventory.devices if d.kind == spec.type and _fits(d, spec)]
        partial = [
            _substitute(item, group, lost, option.id)
            for item in partial
            for option in options
            if option.id not in item[group]
        ]
    repairs.extend(item for item in partial if all(d in devices for ids in item.values() for d in ids))
    free_first = sorted(repairs, key=lambda item: _num_shared(item))
    for item in _unique(free_first):
        found.append(replace(match, assignment=item, unsatisfied={}))
    return found


def _movable(groups: Mapping[str, DeviceGroupSpec], group: str) -> bool:
    spec = groups.get(group)
    return spec is not None and spec.device_ids is None


def _fits(device: Device, spec: DeviceGroupSpec) -> bool:
    return device.kind == spec.type and fits_memory(device, spec) and fits_arch(device, spec)


def _taken(assignment: Assignment) -> set[str]:
    return {device_id for ids in assignment.values() for device_id in ids}


def _free(assignment: Assignment, inventory: Inventory, kind: str) -> list[Device]:
    taken = _taken(assignment)
    return [d for d in inventory.devices if d.kind == kind and d.id not in taken]


def _copy(assignment: Assignment) -> Assignment:
    return {group: list(ids) for group, ids in assignment.items()}


def _substitute(assignment: Assignment, group: str, old: str, new: str) -> Assignment:
    result = _copy(assignment)
    result[group] = [new if device_id == old else device_id for device_id in result[group]]
    return result


def _num_shared(assignment: Assignment) -> int:
    counts: dict[str, int] = {}
    for ids in assignment.values():
        for device_id in ids:
            counts[device_id] = counts.get(device_id, 0) + 1
    return sum(count - 1 for count in counts.values())


def _unique(items: Iterable[Assignment]) -> list[Assignment]:
    seen: set[tuple[tuple[str, tuple[str, ...]], ...]] = set()
    result: list[Assignment] = []
    for item in items:
        key = tuple(sorted((group, tuple(ids)) for group, ids in item.items()))
        if key not in seen:
            seen.add(key)
            result.append(item)
    return result
