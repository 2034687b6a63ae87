"""Start-up log lines: what hardware was found, and which devices each group got.

Plain strings, so the same lines go to a terminal, a log file or ``events.jsonl``::

    Detected 4 GPUs: gpu-0 A100-40GB (40 GiB), ...; 2 CPU slots (64 cores, 512 GiB)
    actor_group -> [gpu-3 H100-80GB, gpu-0 A100-40GB] (matched 2/2, memory OK, +40 GiB headroom)
    reference_group -> cpu-0 (cpu)
"""

from __future__ import annotations

from collections.abc import Mapping

from flowrl.devices.explain import gib
from flowrl.devices.inventory import Inventory
from flowrl.devices.matching import Match


def inventory_lines(inventory: Inventory) -> list[str]:
    """``Detected N GPUs: ...`` and one line per detection note."""
    gpus = inventory.gpus()
    cpus = inventory.cpus()
    cores = sum(host.cores for host in inventory.hosts)
    memory = sum(host.memory_gb for host in inventory.hosts)
    hosts = f" on {len(inventory.hosts)} hosts" if len(inventory.hosts) > 1 else ""
    cpu_part = f"{len(cpus)} CPU slot{'s' if len(cpus) != 1 else ''} ({cores} cores, {gib(memory)})"
    if gpus:
        listed = ", ".join(f"{device.label} ({gib(device.memory_gb)})" for device in gpus)
        noun = "GPU" if len(gpus) == 1 else "GPUs"
        first = f"Detected {len(gpus)} {noun}{hosts}: {listed}; {cpu_part}"
    else:
        first = f"Detected no GPU{hosts}; {cpu_part}"
    return [first, *inventory.notes]


def match_lines(
    match: Match, inventory: Inventory, notes: Mapping[str, str] | None = None
) -> list[str]:
    """One line per group; ``notes`` adds a word per group (``offloaded``)."""
    lines: list[str] = []
    for group, device_ids in match.assignment.items():
        extra = f", {notes[group]}" if notes and group in notes else ""
        if group in match.unsatisfied:
            lines.append(f"{group} -> unmatched: {match.unsatisfied[group]}")
            continue
        shared = match.shared_with.get(group) or []
        shared_text = f", shared with {', '.join(shared)}" if shared else ""
        if match.kinds.get(group) == "cpu":
            where = device_ids[0] if len(device_ids) == 1 else f"[{', '.join(device_ids)}]"
            lines.append(f"{group} -> {where} (cpu{shared_text}{extra})")
            continue
        labels = []
        for device_id in device_ids:
            device = inventory.by_id(device_id)
            labels.append(device.label if device is not None else device_id)
        requested = match.requested.get(group, len(device_ids))
        headroom = match.headroom_gb.get(group)
        memory = (
            f"memory OK, +{gib(headroom)} headroom"
            if headroom is not None and match.min_memory_gb.get(group) is not None
            else "no memory requirement"
        )
        lines.append(
            f"{group} -> [{', '.join(labels)}] "
            f"(matched {len(device_ids)}/{requested}, {memory}{shared_text}{extra})"
        )
    return lines

