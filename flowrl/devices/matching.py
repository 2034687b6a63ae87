"""Which physical devices serve which device group: an exact, deterministic match.

Order of work, and why:

1. words in ``arch``/``preferred_arch`` are checked first, so a typo is reported as a typo
   and not as "no device fits";
2. pinned groups (``device_ids``) take their devices as written: matching is off for them,
   but a pin that breaks the group's own ``min_memory_gb``/``arch`` is still reported;
3. every other GPU group is checked alone against the free GPUs (the message then names
   the constraint that fails and the closest devices), then all of them are assigned at
   once by a min-cost flow (``flowrl.devices.assignment``). Groups that cannot all fit are
   reported together; groups the pipeline lets share may then be given the same devices;
4. CPU groups get CPU slots the same way while there are enough; with fewer slots than
   CPU groups need (a 2-slot CPU machine running 4 groups), they share slots round-robin.

Matching is a pure function of (groups, inventory): when the inventory changes, match
again and a new device that fits is used.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from flowrl.devices.assignment import Demand, Unfeasible, assign
from flowrl.devices.explain import (
    arch_word_problem,
    explain_alone,
    explain_together,
    fits_arch,
    fits_memory,
    gib,
    plural,
    requirement,
)
from flowrl.devices.gpu_types import arch_matches
from flowrl.devices.groups import AUTO_GROUP_PREFIX
from flowrl.devices.inventory import Device, Inventory
from flowrl.errors import UnmatchedGroups
from flowrl.spec.schema import DeviceGroupSpec


@dataclass(frozen=True)
class Match:
    """The result of matching: plain data, JSON-ready through ``to_dict``."""

    assignment: dict[str, list[str]]
    """Group -> device ids, best first; empty for an unsatisfied group."""
    reasons: dict[str, str]
    """Group -> why these devices (or why none)."""
    headroom_gb: dict[str, float | None]
    """Group -> memory beyond ``min_memory_gb`` on its smallest device, in GiB."""
    unsatisfied: dict[str, str]
    """Group -> what failed, the closest devices and the change that fixes it."""
    requested: dict[str, int] = field(default_factory=dict)
    """Group -> number of devices it asked for."""
    kinds: dict[str, str] = field(default_factory=dict)
    """Group -> ``gpu`` or ``cpu``."""
    shared_with: dict[str, list[str]] = field(default_factory=dict)
    """Group -> other groups that use one of its devices."""
    min_memory_gb: dict[str, float | None] = field(default_factory=dict)
    """Group -> the memory it asked for per device, in GiB (None: any)."""

    @property
    def ok(self) -> bool:
        return not self.unsatisfied

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def raise_if_unsatisfied(self) -> None:
        """``UnmatchedGroups`` naming every unsatisfied group, one line each."""
        if self.unsatisfied:
            lines = [f"  devices.{group}: {text}" for group, text in self.unsatisfied.items()]
            count = len(lines)
            header = f"{count} device group{'s' if count != 1 else ''} cannot be matched:"
            # a model's own group (auto:NAME) is declared by the model, not under devices
            problems = [(f"models.{group.removeprefix(AUTO_GROUP_PREFIX)}" if group.startswith(AUTO_GROUP_PREFIX)
                         else f"devices.{group}", text) for group, text in self.unsatisfied.items()]
            raise UnmatchedGroups("\n".join([header, *lines]), problems)


def match_groups(
    groups: Mapping[str, DeviceGroupSpec],
    inventory: Inventory,
    shared: Collection[frozenset[str]] = frozenset(),
) -> Match:
    """Match every group to devices of ``inventory``; never raises for a user mistake.

    ``shared`` lists sets of groups the pipeline allows on the same devices; no other
    two groups share a GPU. Without it, where the GPUs are too few for every GPU group to
    have its own, groups that are not ``exclusive`` share them (as CPU groups share slots),
    the fewest and most even sharings first: one GPU serves a PPO pipeline's four models, and the planner
    then checks that their memory fits. Unsatisfied groups are in ``Match.unsatisfied``.
    """
    match = _Matcher(groups, inventory, shared).run()
    if match.ok or shared:
        return match
    sharing = [name for name, spec in groups.items() if spec.type == "gpu" and not spec.exclusive
               and spec.device_ids is None]
    pairs = [frozenset(pair) for pair in itertools.combinations(sharing, 2)]
    if not pairs:
        return match
    matcher = _Matcher(groups, inventory, pairs)
    matcher.why_shared = "too few GPUs for one each; exclusive: true keeps a group's devices to itself"
    matcher.even = True
    shared_match = matcher.run()
    return shared_match if shared_match.ok else match


class _Matcher:
    def __init__(
        self,
        groups: Mapping[str, DeviceGroupSpec],
        inventory: Inventory,
        shared: Collection[frozenset[str]],
    ) -> None:
        self.groups = dict(groups)
        self.inventory = inventory
        self.shared = [frozenset(item) for item in shared]
        self.assignment: dict[str, list[str]] = {}
        self.reasons: dict[str, str] = {}
        self.unsatisfied: dict[str, str] = {}
        self.devices = {device.id: device for device in inventory.devices}
        self.why_shared = "the pipeline allows it"
        """Why groups in one bundle share devices, for their reasons."""
        self.even = False
        """Of as many sharings, try the most even bundles first."""

    def run(self) -> Match:
        for name, spec in self.groups.items():
            self._check_words(name, spec)
        pinned = self._pin()
        for kind in ("gpu", "cpu"):
            names = [
                name
                for name, spec in self.groups.items()
                if spec.type == kind and spec.device_ids is None and name not in self.unsatisfied
            ]
            every = [device for device in self.inventory.devices if device.kind == kind]
            free = [device for device in every if device.id not in pinned]
            demand = sum(self.groups[name].effective_count for name in names)
            if kind == "cpu" and demand > len(free):
                free = every  # CPU slots are shared anyway once there are too few
            self._match_kind(kind, names, free)
        return self._result()

    # ---- checks and pins -------------------------------------------------------------

    def _check_words(self, name: str, spec: DeviceGroupSpec) -> None:
        problem = arch_word_problem(spec)
        if problem is not None:
            field_name, message = problem
            self.unsatisfied[name] = f"{field_name}: {message}"

    def _pin(self) -> set[str]:
        """Give pinned groups their devices; return the device ids they hold."""
        holder: dict[str, str] = {}
        for name, spec in self.groups.items():
            if spec.device_ids is None or name in self.unsatisfied:
                continue
            ids = [f"{spec.type}-{number}" for number in spec.device_ids]
            missing = [device_id for device_id in ids if device_id not in self.devices]
            kind_ids = [d.id for d in self.inventory.devices if d.kind == spec.type]
            if missing:
                span = f"{kind_ids[0]} .. {kind_ids[-1]}" if kind_ids else "none"
                self.unsatisfied[name] = (
                    f"device_ids: no {', '.join(missing)} in this inventory ({spec.type}s: "
                    f"{span}); pin existing devices or drop device_ids to let flowrl choose"
                )
                continue
            broken = [
                self.devices[i]
                for i in ids
                if not (fits_memory(self.devices[i], spec) and fits_arch(self.devices[i], spec))
            ]
            if broken:
                self.unsatisfied[name] = (
                    f"pinned to {', '.join(d.label for d in broken)} "
                    f"({', '.join(gib(d.memory_gb) for d in broken)}), which breaks its own "
                    f"requirement ({requirement(spec, len(ids))}): drop device_ids, or relax "
                    "min_memory_gb/arch"
                )
                continue
            taken = [
                i
                for i in ids
                if spec.type == "gpu" and i in holder and not self._may_share(name, holder[i])
            ]
            if taken:
                other = holder[taken[0]]
                self.unsatisfied[name] = (
                    f"device_ids: {', '.join(taken)} already pinned by {other}; pin other "
                    "devices, or let the two groups share"
                )
                continue
            for device_id in ids:
                holder.setdefault(device_id, name)
            self.assignment[name] = ids
            self.reasons[name] = "pinned by device_ids (matching is off for this group)"
        return set(holder)

    def _may_share(self, first: str, second: str) -> bool:
        return any(first in item and second in item for item in self.shared)

    # ---- matching ---------------------------------------------------------------------

    def _match_kind(self, kind: str, names: list[str], free: list[Device]) -> None:
        candidates: list[str] = []
        for name in names:
            spec = self.groups[name]
            fitting = [d for d in free if fits_memory(d, spec) and fits_arch(d, spec)]
            if len(fitting) < spec.effective_count:
                self.unsatisfied[name] = explain_alone(name, spec, free, spec.effective_count)
            else:
                candidates.append(name)
        if kind == "cpu" and sum(self.groups[n].effective_count for n in candidates) > len(free):
            self._round_robin(candidates, free)
            return
        while candidates:
            outcome = self._solve(candidates, free)
            if not isinstance(outcome, Unfeasible):
                return
            needs = {
                n: requirement(self.groups[n], self.groups[n].effective_count)
                for n in outcome.demands
            }
            total = sum(self.groups[n].effective_count for n in outcome.demands)
            fitting = [self.devices[i] for i in outcome.devices]
            exclusive = [n for n in outcome.demands if self.groups[n].exclusive]
            message = explain_together(outcome.demands, needs, total, fitting, kind, exclusive)
            for name in outcome.demands:
                self.unsatisfied[name] = message
            candidates = [n for n in candidates if n not in outcome.demands]

    def _solve(self, names: list[str], free: list[Device]) -> Unfeasible | None:
        """Assign ``names`` without sharing, else with the fewest allowed sharings."""
        options = [item & set(names) for item in self.shared if len(item & set(names)) >= 2]
        first_failure: Unfeasible | None = None
        # every subset of the allowed sharings is tried, fewest first; past 8 of them
        # (256 solves) only "none" and "all" are, to keep matching well under a second
        sizes = range(len(options) + 1) if len(options) <= 8 else (0, len(options))
        for size in sizes:
            tries = [_bundles(names, chosen) for chosen in itertools.combinations(options, size)]
            # Of as many sharings, those that put the fewest devices under two groups first
            # (on 6 GPUs for groups of 4, 2 and 1: the 2 and the 1 share one GPU, not the 4 and
            # the 2 two of them while a sixth stays idle); then, matching for too few GPUs, the
            # most even (2 + 2 groups before 3 + 1).
            tries.sort(key=lambda bundles: (self._overlap(bundles),
                                            max(len(bundle) for bundle in bundles) if self.even else 0))
            for bundles in tries:
                demands = [self._demand(bundle, free) for bundle in bundles]
                outcome = assign(demands, free)
                if isinstance(outcome, Unfeasible):
                    first_failure = first_failure or outcome
                    continue
                for bundle, demand in zip(bundles, demands):
                    self._accept(bundle, outcome[demand.name])
                return None
        assert first_failure is not None
        return first_failure

    def _overlap(self, bundles: list[list[str]]) -> int:
        """Devices a group shares with another when each bundle gets as many devices as its
        largest group needs."""
        counts = [[self.groups[name].effective_count for name in bundle] for bundle in bundles]
        return sum(sum(bundle) - max(bundle) for bundle in counts if bundle)

    def _demand(self, bundle: list[str], free: list[Device]) -> Demand:
        specs = [self.groups[name] for name in bundle]
        eligible = frozenset(
            d.id for d in free if all(fits_memory(d, s) and fits_arch(d, s) for s in specs)
        )
        preference = {d.id: sum(_preference_rank(d, s) for s in specs) for d in free}
        needs = sorted({s.min_memory_gb or 0.0 for s in self.groups.values()})
        weight = 1 + max(needs.index(s.min_memory_gb or 0.0) for s in specs)
        count = max(s.effective_count for s in specs)
        return Demand("+".join(bundle), count, eligible, preference, weight)

    def _accept(self, bundle: list[str], device_ids: list[str]) -> None:
        for name in bundle:
            spec = self.groups[name]
            chosen = [self.devices[i] for i in device_ids]
            ranked = sorted(
                chosen, key=lambda d: (_preference_rank(d, spec), -d.memory_gb, d.number)
            )
            self.assignment[name] = [d.id for d in ranked[: spec.effective_count]]
            self.reasons[name] = self._reason(name, bundle)

    def _round_robin(self, names: list[str], slots: list[Device]) -> None:
        total = sum(self.groups[n].effective_count for n in names)
        cursor = 0
        for name in names:
            spec = self.groups[name]
            chosen: list[str] = []
            while len(chosen) < spec.effective_count:
                slot = slots[cursor % len(slots)]
                cursor += 1
                if slot.id not in chosen and fits_memory(slot, spec):
                    chosen.append(slot.id)
            self.assignment[name] = chosen
            self.reasons[name] = (
                f"{', '.join(chosen)}: shared round-robin ({len(names)} cpu groups need "
                f"{plural(total, 'cpu')}, the inventory has {len(slots)})"
            )

    # ---- result -----------------------------------------------------------------------

    def _reason(self, name: str, bundle: list[str]) -> str:
        spec = self.groups[name]
        devices = [self.devices[i] for i in self.assignment[name]]
        parts = [f"needs {requirement(spec, spec.effective_count)}"]
        if spec.preferred_arch:
            ranks = [_preference_rank(d, spec) for d in devices]
            got = ", ".join(f"{d.id} {d.family}" for d in devices)
            fell = " (fell back: too few preferred devices free)" if max(ranks) > 0 else ""
            parts.append(f"preferred {' > '.join(spec.preferred_arch)}: got {got}{fell}")
        if len(bundle) > 1:
            others = [other for other in bundle if other != name]
            parts.append(f"shares devices with {', '.join(others)} ({self.why_shared})")
        return "; ".join(parts)

    def _result(self) -> Match:
        order = list(self.groups)
        assignment = {n: self.assignment.get(n, []) for n in order}
        headroom: dict[str, float | None] = {}
        for name in order:
            devices = [self.devices[i] for i in assignment[name]]
            need = self.groups[name].min_memory_gb or 0.0
            headroom[name] = round(min(d.memory_gb for d in devices) - need, 1) if devices else None
        shared_with = {
            name: [
                other
                for other in order
                if other != name
                and self.groups[other].type == self.groups[name].type
                and set(assignment[other]) & set(assignment[name])
            ]
            for name in order
        }
        reasons = {n: self.unsatisfied.get(n) or self.reasons.get(n, "") for n in order}
        return Match(
            assignment=assignment,
            reasons=reasons,
            headroom_gb=headroom,
            unsatisfied={n: self.unsatisfied[n] for n in order if n in self.unsatisfied},
            requested={n: self.groups[n].effective_count for n in order},
            kinds={n: self.groups[n].type for n in order},
            shared_with=shared_with,
            min_memory_gb={n: self.groups[n].min_memory_gb for n in order},
        )


def _preference_rank(device: Device, spec: DeviceGroupSpec) -> int:
    """Position of the device's arch in ``preferred_arch``; past the end when absent."""
    if not spec.preferred_arch:
        return 0
    for rank, word in enumerate(spec.preferred_arch):
        if arch_matches(word, device.arch, device.family):
            return rank
    return len(spec.preferred_arch)


def _bundles(names: list[str], chosen: tuple[frozenset[str], ...]) -> list[list[str]]:
    """Groups in declaration order, with each chosen sharing set (merged when they touch)."""
    merged: list[set[str]] = []
    for item in chosen:
        touching = [group for group in merged if group & item]
        union = set(item).union(*touching)
        merged = [group for group in merged if not group & item] + [union]
    bundles: list[list[str]] = []
    placed: set[str] = set()
    for name in names:
        if name in placed:
            continue
        group = next((g for g in merged if name in g), {name})
        bundle = [n for n in names if n in group]
        bundles.append(bundle)
        placed.update(bundle)
    return bundles
