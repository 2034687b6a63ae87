"""Read this machine's GPUs through NVML (the ``pynvml`` module of nvidia-ml-py).

The import happens inside ``read_gpus`` so that a CPU machine without the package never
pays for it or fails on it. Anything NVML cannot tell (PCIe on some virtual machines,
NVLink on cards without it) is left as None / empty instead of failing the whole read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_NVLINK_MAX_LINKS = 18  # NVML_NVLINK_MAX_LINKS on Hopper; older cards answer "not supported"


class NvmlUnavailable(Exception):
    """NVML cannot be used here (no package, no driver, no GPU); the message says which."""


@dataclass(frozen=True)
class GpuReading:
    """What NVML reports about one GPU, before the type table is consulted."""

    index: int
    uuid: str
    name: str
    memory_total_gb: float
    memory_free_gb: float
    compute_capability: tuple[int, int] | None
    pci_bus_id: str
    pcie_gen: int | None
    pcie_width: int | None
    nvlink_peers: tuple[int, ...]
    """NVML indices of the GPUs this one reaches over NVLink (directly or via NVSwitch)."""


def read_gpus() -> list[GpuReading]:
    """Every GPU NVML sees, by NVML index. Raises ``NvmlUnavailable`` when it cannot look."""
    try:
        import pynvml
    except ImportError as error:
        raise NvmlUnavailable(f"nvidia-ml-py is not installed ({error})") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        raise NvmlUnavailable(f"NVML did not start ({error}); no NVIDIA driver?") from None
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            raise NvmlUnavailable("NVML sees no GPU")
        handles = [pynvml.nvmlDeviceGetHandleByIndex(index) for index in range(count)]
        bus_ids = [_normal_bus_id(_text(pynvml.nvmlDeviceGetPciInfo(h).busId)) for h in handles]
        return [
            _read_one(pynvml, index, handles[index], _nvlink_peers(pynvml, index, handles, bus_ids))
            for index in range(count)
        ]
    except pynvml.NVMLError as error:
        raise NvmlUnavailable(f"NVML failed while reading the GPUs ({error})") from None
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _text(value: Any) -> str:
    # nvidia-ml-py before 11.5 returns bytes, later versions str
    return value.decode() if isinstance(value, bytes) else str(value)


def _optional(pynvml: Any, function: str, *args: Any) -> Any:
    """The call's result, or None when the driver or board does not support it."""
    try:
        return getattr(pynvml, function)(*args)
    except (pynvml.NVMLError, AttributeError):
        return None


def _read_one(pynvml: Any, index: int, handle: Any, peers: tuple[int, ...]) -> GpuReading:
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    capability = _optional(pynvml, "nvmlDeviceGetCudaComputeCapability", handle)
    pci = pynvml.nvmlDeviceGetPciInfo(handle)
    return GpuReading(
        index=index,
        uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
        name=_text(pynvml.nvmlDeviceGetName(handle)),
        memory_total_gb=memory.total / 2**30,
        memory_free_gb=memory.free / 2**30,
        compute_capability=tuple(capability) if capability is not None else None,
        pci_bus_id=_normal_bus_id(_text(pci.busId)),
        # the maximum, not the current link: an idle card drops its link to gen 1 to save power
        pcie_gen=_optional(pynvml, "nvmlDeviceGetMaxPcieLinkGeneration", handle),
        pcie_width=_optional(pynvml, "nvmlDeviceGetMaxPcieLinkWidth", handle),
        nvlink_peers=peers,
    )


def _nvlink_peers(
    pynvml: Any, index: int, handles: list[Any], bus_ids: list[str]
) -> tuple[int, ...]:
    """Indices of the GPUs ``index`` reaches over NVLink.

    The peer-to-peer status is asked first because on NVSwitch boards (HGX H100/H200) a
    link's far end is the switch, not a GPU; the link walk is the fallback for drivers
    that do not answer it.
    """
    nvlink_caps = getattr(pynvml, "NVML_P2P_CAPS_INDEX_NVLINK", None)
    status_ok = getattr(pynvml, "NVML_P2P_STATUS_OK", 0)
    if nvlink_caps is not None:
        peers: list[int] = []
        answered = True
        for other, other_handle in enumerate(handles):
            if other == index:
                continue
            status = _optional(
                pynvml, "nvmlDeviceGetP2PStatus", handles[index], other_handle, nvlink_caps
            )
            if status is None:
                answered = False
                break
            if status == status_ok:
                peers.append(other)
        if answered:
            return tuple(peers)
    linked: list[int] = []
    for link in range(_NVLINK_MAX_LINKS):
        state = _optional(pynvml, "nvmlDeviceGetNvLinkState", handles[index], link)
        if state is None:
            break  # links are numbered from 0; the first unsupported one ends the list
        if state != pynvml.NVML_FEATURE_ENABLED:
            continue
        remote = _optional(pynvml, "nvmlDeviceGetNvLinkRemotePciInfo", handles[index], link)
        if remote is None:
            continue
        bus = _normal_bus_id(_text(remote.busId))
        if bus in bus_ids and bus_ids.index(bus) not in linked:
            linked.append(bus_ids.index(bus))
    return tuple(sorted(linked))


def _normal_bus_id(bus_id: str) -> str:
    """``00000000:1B:00.0`` and ``0000:1b:00.0`` both become ``0000:1b:00.0``."""
    bus_id = bus_id.strip().lower()
    domain, _, rest = bus_id.partition(":")
    return f"{domain[-4:]}:{rest}" if rest else bus_id


class GpuMeter:
    """Utilisation and memory of one GPU, read repeatedly (for the profiler's sampler)."""

    def __init__(self, index: int) -> None:
        try:
            import pynvml
        except ImportError as error:
            raise NvmlUnavailable(f"nvidia-ml-py is not installed ({error})") from None
        try:
            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except pynvml.NVMLError as error:
            raise NvmlUnavailable(f"NVML cannot open GPU {index} ({error})") from None
        self._pynvml = pynvml

    def read(self) -> tuple[float, float, float]:
        """(utilisation 0..1 over NVML's last sample period, memory used GB, memory total GB)."""
        pynvml = self._pynvml
        rates = pynvml.nvmlDeviceGetUtilizationRates(self._handle)
        memory = pynvml.nvmlDeviceGetMemoryInfo(self._handle)
        return rates.gpu / 100.0, memory.used / 1e9, memory.total / 1e9
