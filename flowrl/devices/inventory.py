"""What hardware there is: devices (GPUs and CPU slots) and the hosts they sit in.

An ``Inventory`` is plain, immutable data. It comes from this machine (``detect_local``:
NVML for GPUs, psutil for the CPU), from a ``devices/*.yaml`` file (``flowrl.devices.files``)
or from several Dask workers' reports joined with ``merge_inventories``. Matching and
planning only ever read an ``Inventory``, so a cluster you do not have plans like one you do.

Device ids number each kind across the whole inventory (``gpu-0`` .. ``gpu-15`` on two
8-GPU hosts); ``index`` is the device's number on its own host (its NVML/CUDA index).
On one machine the two agree, and ``device_ids`` in a pipeline pins by that number.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from flowrl.devices.gpu_types import estimate_gpu
from flowrl.devices.nvml import GpuReading, NvmlUnavailable, read_gpus

DeviceKind = Literal["cpu", "gpu"]

GB_PER_GIB = 2**30 / 1e9
"""An inventory's memory is in GiB (as cards are sold and inventory files write it); the
planner's predictions and the profiler's measurements are in GB (10^9 bytes)."""


@dataclass(frozen=True)
class Device:
    """One device a device group can be given: a GPU, or a CPU slot (one worker process)."""

    id: str
    """Inventory-wide id: ``gpu-<n>`` or ``cpu-<n>``."""
    host: str
    """Host name of the machine it is in."""
    index: int
    """Number on its host (the NVML index of a GPU, the slot number of a CPU slot)."""
    kind: DeviceKind
    """``gpu`` or ``cpu``."""
    name: str
    """GPU type (``A100-40GB``, a key of ``GPU_TYPES`` when known) or ``cpu``."""
    arch: str
    """GPU architecture (``ampere``) or ``cpu``."""
    memory_gb: float
    """Memory in GiB: as sold for a known GPU; host memory for a CPU slot (its slots share it)."""
    memory_free_gb: float | None = None
    """Memory free when detected, in GiB; None for devices described in a file."""
    family: str = ""
    """GPU product family (``a100``); ``cpu`` for CPU slots."""
    uuid: str | None = None
    """NVML UUID of a detected GPU."""
    pcie_gen: int | None = None
    """PCIe generation of the GPU's link (its maximum; idle links drop to gen 1)."""
    pcie_width: int | None = None
    """PCIe lanes of the GPU's link (its maximum)."""
    nvlink_peers: tuple[str, ...] = ()
    """Ids of the devices this GPU reaches over NVLink."""
    tflops_bf16: float | None = None
    """Dense bf16 throughput in TFLOP/s, from the GPU type table; None for CPU slots."""
    bandwidth_gbs: float | None = None
    """Memory bandwidth in GB/s, from the GPU type table; None for CPU slots."""
    l2_cache_mib: float | None = None
    """L2 cache in MiB, from the GPU type table; None for CPU slots and unlisted cards
    described in a file."""
    worker: str | None = None
    """Address of the Dask worker that serves this device, once one does."""

    @property
    def number(self) -> int:
        """The inventory-wide number in the id (3 for ``gpu-3``); else its index.

        Devices of a joined Dask cluster are named after their workers (``node-a``).
        """
        tail = self.id.rsplit("-", 1)[-1]
        return int(tail) if tail.isdigit() else self.index

    @property
    def label(self) -> str:
        """``gpu-3 H100-80GB`` or ``cpu-0``: the id and, for a GPU, its type."""
        return f"{self.id} {self.name}" if self.kind == "gpu" else self.id

    @property
    def capacity_gb(self) -> float:
        """``memory_gb`` in GB (10^9 bytes), the unit predicted and measured peaks are in:
        85.9 for an 80 GiB card."""
        return self.memory_gb * GB_PER_GIB


@dataclass(frozen=True)
class Host:
    """One machine: its CPU cores and memory."""

    name: str
    """Host name."""
    cores: int
    """CPU cores (logical)."""
    memory_gb: float
    """Host memory in GiB."""
    memory_free_gb: float | None = None
    """Host memory available when detected, in GiB; None when described in a file."""


@dataclass(frozen=True)
class Inventory:
    """Every device and host, in a fixed order (GPUs by number, then CPU slots)."""

    devices: tuple[Device, ...]
    hosts: tuple[Host, ...]
    source: str = "local"
    """Where it came from: ``local`` (NVML + psutil), a file path, or ``merged``."""
    notes: tuple[str, ...] = field(default=())
    """What detection could not do (``NVML not available: ...``), for the start-up log."""

    def gpus(self) -> list[Device]:
        return [device for device in self.devices if device.kind == "gpu"]

    def cpus(self) -> list[Device]:
        return [device for device in self.devices if device.kind == "cpu"]

    def by_id(self, device_id: str) -> Device | None:
        return next((device for device in self.devices if device.id == device_id), None)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data; ``inventory_from_dict`` reads it back."""
        return {
            "source": self.source,
            "notes": list(self.notes),
            "hosts": [asdict(host) for host in self.hosts],
            "devices": [
                {**asdict(device), "nvlink_peers": list(device.nvlink_peers)}
                for device in self.devices
            ],
        }


def inventory_from_dict(data: Mapping[str, Any]) -> Inventory:
    """The inverse of ``Inventory.to_dict`` (used when workers report over Dask)."""
    devices = tuple(
        Device(**{**item, "nvlink_peers": tuple(item.get("nvlink_peers", ()))})
        for item in data["devices"]
    )
    hosts = tuple(Host(**item) for item in data["hosts"])
    return Inventory(devices, hosts, data.get("source", "local"), tuple(data.get("notes", ())))


def merge_inventories(parts: Iterable[Inventory]) -> Inventory:
    """One inventory from several (one per host or worker), renumbering ids in order.

    A host reported twice (two workers on one machine) is listed once; NVLink peer ids
    are translated to the new numbering.
    """
    hosts: dict[str, Host] = {}
    notes: list[str] = []
    counters = {"gpu": 0, "cpu": 0}
    gpus: list[Device] = []
    cpus: list[Device] = []
    for part in parts:
        for host in part.hosts:
            hosts.setdefault(host.name, host)
        notes.extend(note for note in part.notes if note not in notes)
        renamed: dict[str, str] = {}
        for device in part.devices:
            renamed[device.id] = f"{device.kind}-{counters[device.kind]}"
            counters[device.kind] += 1
        for device in part.devices:
            peers = tuple(renamed.get(peer, peer) for peer in device.nvlink_peers)
            moved = replace(device, id=renamed[device.id], nvlink_peers=peers)
            (gpus if device.kind == "gpu" else cpus).append(moved)
    devices = [*gpus, *cpus]
    return Inventory(tuple(devices), tuple(hosts.values()), "merged", tuple(notes))


def detect_local(
    num_cpu_slots: int,
    reader: Callable[[], list[GpuReading]] = read_gpus,
    environ: Mapping[str, str] | None = None,
) -> Inventory:
    """This machine's GPUs (through NVML) and ``num_cpu_slots`` CPU slots.

    Without nvidia-ml-py, without a driver or without GPUs the inventory has CPU slots
    only and says why in ``notes``; that is a normal CPU machine, not an error.
    ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs) limits the GPUs, because NVML ignores it
    and a Dask GPU worker should report only the card it was given.
    """
    import psutil  # light, but only needed here

    env = os.environ if environ is None else environ
    host_name = socket.gethostname()
    notes: list[str] = []
    try:
        readings = reader()
    except NvmlUnavailable as error:
        readings = []
        notes.append(f"no GPUs detected: {error}")
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        readings = [reading for reading in readings if _visible(reading, visible)]
    gpus = [_gpu_device(reading, host_name) for reading in readings]
    shown = {reading.index for reading in readings}
    gpus = [
        replace(device, nvlink_peers=tuple(f"gpu-{i}" for i in reading.nvlink_peers if i in shown))
        for device, reading in zip(gpus, readings)
    ]
    memory = psutil.virtual_memory()
    host = Host(
        name=host_name,
        cores=psutil.cpu_count(logical=True) or 1,
        memory_gb=round(memory.total / 2**30, 1),
        memory_free_gb=round(memory.available / 2**30, 1),
    )
    cpus = [
        Device(
            id=f"cpu-{slot}",
            host=host_name,
            index=slot,
            kind="cpu",
            name="cpu",
            arch="cpu",
            family="cpu",
            memory_gb=host.memory_gb,
            memory_free_gb=host.memory_free_gb,
        )
        for slot in range(num_cpu_slots)
    ]
    return Inventory(tuple([*gpus, *cpus]), (host,), "local", tuple(notes))


def _visible(reading: GpuReading, visible: str) -> bool:
    return any(names_gpu(item, reading.index, reading.uuid) for item in visible_items(visible))


def visible_items(visible: str) -> list[str]:
    """The entries of a ``CUDA_VISIBLE_DEVICES`` value, in order."""
    return [item.strip() for item in visible.split(",") if item.strip()]


def names_gpu(item: str, index: int, uuid: str | None) -> bool:
    """Whether a ``CUDA_VISIBLE_DEVICES`` entry (an NVML index or a UUID prefix) names the GPU
    with this ``index`` and ``uuid``."""
    return item == str(index) or (item.startswith("GPU-") and (uuid or "").startswith(item))


def _gpu_device(reading: GpuReading, host_name: str) -> Device:
    gpu_type = estimate_gpu(reading.name, reading.memory_total_gb, reading.compute_capability)
    # A card in the table is listed with its memory as sold (80, not the 79.6 GiB NVML
    # reports after the driver's reservation), so `min_memory_gb: 80` matches an 80 GiB card.
    # A board that reports far from its listed size (a MIG slice) keeps what it reports.
    measured = reading.memory_total_gb
    near = gpu_type.known and abs(measured - gpu_type.memory_gb) <= 0.1 * gpu_type.memory_gb
    memory_gb = gpu_type.memory_gb if near else round(measured, 1)
    return Device(
        id=f"gpu-{reading.index}",
        host=host_name,
        index=reading.index,
        kind="gpu",
        name=gpu_type.name,
        arch=gpu_type.arch,
        family=gpu_type.family,
        memory_gb=memory_gb,
        memory_free_gb=round(reading.memory_free_gb, 1),
        uuid=reading.uuid,
        pcie_gen=reading.pcie_gen,
        pcie_width=reading.pcie_width,
        tflops_bf16=gpu_type.tflops_bf16,
        bandwidth_gbs=gpu_type.bandwidth_gbs,
        l2_cache_mib=gpu_type.l2_cache_mib,
    )
