"""Inventory files (``devices/*.yaml``) turned into an ``Inventory``.

The file is validated in the spec layer (``flowrl.spec.inventory_file``); here each GPU
entry is expanded ``count`` times and filled in from the GPU type table. Devices are
numbered in file order across hosts (``gpu-0`` .. ``gpu-15`` on two 8-GPU hosts), so
the same file always gives the same ids.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from flowrl.devices.gpu_types import GPU_TYPES, GpuType
from flowrl.devices.inventory import Device, Host, Inventory
from flowrl.spec.inventory_file import GpuEntry, InventoryFileSpec, load_inventory_file

_DEFAULT_ARCH = "ampere"  # for an unlisted card with no arch given: the commonest generation


def load_inventory(path: str | Path) -> Inventory:
    """The inventory an inventory file describes; ``InventoryFileError`` lists its problems."""
    spec = load_inventory_file(path, known_gpu_types=list(GPU_TYPES))
    return inventory_from_spec(spec, source=str(path))


def inventory_from_spec(spec: InventoryFileSpec, source: str = "file") -> Inventory:
    """Expand a validated inventory file into devices and hosts."""
    hosts: list[Host] = []
    gpus: list[Device] = []
    cpus: list[Device] = []
    for host_name, host in spec.hosts.items():
        hosts.append(Host(host_name, host.cpus.cores, host.cpus.memory_gb))
        local: list[Device] = []
        for entry in host.gpus:
            for _ in range(entry.count):
                local.append(_gpu(entry, host_name, len(local), len(gpus) + len(local)))
        if host.nvlink:
            ids = [device.id for device in local]
            local = [
                replace(device, nvlink_peers=tuple(i for i in ids if i != device.id))
                for device in local
            ]
        gpus.extend(local)
        for slot in range(host.cpus.slots):
            cpus.append(
                Device(
                    id=f"cpu-{len(cpus)}",
                    host=host_name,
                    index=slot,
                    kind="cpu",
                    name="cpu",
                    arch="cpu",
                    family="cpu",
                    memory_gb=host.cpus.memory_gb,
                )
            )
    return Inventory(tuple([*gpus, *cpus]), tuple(hosts), source)


def _gpu(entry: GpuEntry, host_name: str, index: int, number: int) -> Device:
    row = GPU_TYPES.get(entry.type)
    memory_gb = entry.memory_gb if entry.memory_gb is not None else (row.memory_gb if row else 0.0)
    arch = entry.arch or (row.arch if row else _DEFAULT_ARCH)
    tflops = entry.tflops_bf16 if entry.tflops_bf16 is not None else _from_row(row, "tflops_bf16")
    bandwidth = (
        entry.bandwidth_gbs if entry.bandwidth_gbs is not None else _from_row(row, "bandwidth_gbs")
    )
    return Device(
        id=f"gpu-{number}",
        host=host_name,
        index=index,
        kind="gpu",
        name=entry.type,
        arch=arch,
        family=row.family if row else entry.type.lower(),
        memory_gb=memory_gb,
        tflops_bf16=tflops,
        bandwidth_gbs=bandwidth,
        l2_cache_mib=_from_row(row, "l2_cache_mib"),
    )


def _from_row(row: GpuType | None, name: str) -> float | None:
    return float(getattr(row, name)) if row is not None else None
