"""``flowrl devices``: the hardware here (or in an inventory file), and how groups match it.

    flowrl devices                                     # this machine: NVML + CPU
    flowrl devices --devices devices/h200-8x.yaml      # a machine described in a file
    flowrl devices --scheduler tcp://HOST:8786         # the workers of a running Dask cluster
    flowrl devices --pipeline pipelines/ppo.yaml [--devices devices/mixed-4gpu.yaml]
    ... --json                                         # the same as JSON

With a pipeline, a group that cannot be matched is shown with its reason and the command
exits with code 2 after printing the rest, each group at its line of the pipeline file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flowrl.devices.explain import gib
from flowrl.devices.files import load_inventory
from flowrl.devices.groups import pipeline_groups
from flowrl.devices.inventory import Inventory, detect_local
from flowrl.devices.matching import Match, match_groups
from flowrl.devices.report import inventory_lines
from flowrl.errors import ClusterError, FlowrlError
from flowrl.planner.search import SearchOptions, sharings
from flowrl.spec.loader import issue_locator, load_pipeline, placed_within
from flowrl.spec.schema import PipelineSpec, RuntimeSpec, check_scheduler_address


def devices_command(
    pipeline: Path | None, devices_file: Path | None, as_json: bool, console: Console, scheduler: str | None = None,
) -> None:
    """Print the inventory, and with ``pipeline`` the match of its device groups."""
    graph = load_pipeline(pipeline) if pipeline is not None else None
    spec = graph.spec if graph is not None else None
    base_dir = pipeline.resolve().parent if pipeline is not None else Path.cwd()
    inventory = inventory_for(spec.runtime if spec is not None else RuntimeSpec(), devices_file, scheduler, base_dir)
    match = match_groups(pipeline_groups(spec), inventory) if spec is not None else None
    if as_json:
        data: dict[str, Any] = {"inventory": inventory.to_dict()}
        if match is not None:
            data["match"] = match.to_dict()
        console.print(json.dumps(data, indent=2), markup=False, highlight=False, soft_wrap=True)
    else:
        _print_inventory(inventory, console)
        if match is not None and graph is not None:
            # the planner's own rule for which groups may run on another's devices
            shareable = next(sharings(graph, match, SearchOptions()), None) is not None
            _print_match(graph.spec, match, shareable, console)
    if match is not None:
        with placed_within(issue_locator(pipeline) if pipeline is not None else None):  # at the groups' lines
            match.raise_if_unsatisfied()


JOIN_TIMEOUT_S = 10.0
"""How long ``plan`` and ``devices`` wait for a scheduler and its first worker (a run waits 30 s)."""


def inventory_for(runtime: RuntimeSpec, devices_file: Path | None, scheduler: str | None, base_dir: Path) -> Inventory:
    """The devices to show or plan for: an inventory file; else the workers of a running Dask
    scheduler (``scheduler``, else the pipeline's ``runtime.scheduler_address``), as a run that
    joins it sees them; else this machine, with the local cluster's ``runtime.cpu_slots``."""
    if devices_file is not None and scheduler is not None:
        raise FlowrlError("give --devices (an inventory file) or --scheduler (a running cluster), not both")
    if devices_file is not None:
        return load_inventory(devices_file)
    if scheduler is not None:
        try:
            scheduler = check_scheduler_address(scheduler)
        except ValueError as error:
            raise FlowrlError(f"--scheduler: {error}") from None
    address = scheduler or runtime.scheduler_address
    if not address:
        return detect_local(num_cpu_slots=runtime.cpu_slots)
    from flowrl.runtime.cluster import join_for

    given = "--scheduler" if scheduler else "runtime.scheduler_address"
    try:
        cluster = join_for(runtime, address, base_dir, timeout_s=JOIN_TIMEOUT_S)
    except ClusterError as error:
        instead = "leave out --scheduler" if scheduler else (
            "take runtime.scheduler_address out of the pipeline (flowrl plan: runtime.scheduler_address=null)")
        raise ClusterError(f"{given}: {error} To use this machine instead, {instead}; for an inventory "
                           "file, give --devices FILE.") from None
    try:
        return cluster.inventory()
    finally:
        cluster.close()  # this process's client only: the scheduler and its workers stay


def _print_inventory(inventory: Inventory, console: Console) -> None:
    table = Table(title=f"Devices ({inventory.source})", title_justify="left")
    numbers = ("memory", "free", "bf16 TFLOP/s", "GB/s")
    for column in ("id", "host", "type", "arch", *numbers, "PCIe", "NVLink"):
        table.add_column(column, justify="right" if column in numbers else "left")
    for device in inventory.devices:
        pcie = f"gen{device.pcie_gen} x{device.pcie_width}" if device.pcie_gen else "-"
        table.add_row(
            device.id,
            device.host,
            device.name,
            device.arch,
            gib(device.memory_gb),
            gib(device.memory_free_gb) if device.memory_free_gb is not None else "-",
            f"{device.tflops_bf16:g}" if device.tflops_bf16 is not None else "-",
            f"{device.bandwidth_gbs:g}" if device.bandwidth_gbs is not None else "-",
            pcie,
            _peers(device.nvlink_peers),
        )
    console.print(table)
    for host in inventory.hosts:
        free = f", {gib(host.memory_free_gb)} free" if host.memory_free_gb is not None else ""
        line = f"host {host.name}: {host.cores} cores, {gib(host.memory_gb)} memory{free}"
        console.print(line, highlight=False)
    for line in inventory_lines(inventory):
        console.print(line, highlight=False, markup=False)


def _peers(peers: tuple[str, ...]) -> str:
    if not peers:
        return "-"
    return ", ".join(peers) if len(peers) <= 3 else f"{len(peers)} peers"


def _print_match(spec: PipelineSpec, match: Match, shareable: bool, console: Console) -> None:
    table = Table(title=f"Device groups of '{spec.name}'", title_justify="left")
    for column in ("group", "devices", "headroom", "why"):
        table.add_column(column, overflow="fold")
    for group, device_ids in match.assignment.items():
        headroom = match.headroom_gb.get(group)
        table.add_row(
            group,
            ", ".join(device_ids) if device_ids else "[red]unmatched[/]",
            _headroom(headroom, match.min_memory_gb.get(group)),
            escape(match.reasons.get(group, "")),
        )
    console.print(table)
    if shareable:
        # The match gives each group devices of its own; the plan may still run a group's nodes
        # on another group's devices (time-shared) where it predicts a shorter step.
        console.print(
            "Each group's own devices. The plan (flowrl plan) may run a group on another group's "
            "devices where that is predicted faster and memory fits; exclusive: true on a group "
            "keeps it on its own.", highlight=False, markup=False,
        )


def _headroom(headroom_gb: float | None, min_memory_gb: float | None) -> str:
    if headroom_gb is None:
        return "-"
    return f"+{gib(headroom_gb)}" if min_memory_gb is not None else "no minimum"
