"""Local detection (NVML faked, or absent), merging worker reports, and plain-data round trips."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from flowrl.devices.inventory import (
    Inventory,
    detect_local,
    inventory_from_dict,
    merge_inventories,
)
from flowrl.devices.nvml import GpuReading, NvmlUnavailable, read_gpus

GiB = 2**30


class _NvmlError(Exception):
    pass


def fake_pynvml(names: list[str], totals_gib: list[float], nvlink: bool) -> types.ModuleType:
    """A stand-in for nvidia-ml-py's ``pynvml`` with just the calls flowrl makes."""
    module = types.ModuleType("pynvml")
    api: dict[str, Any] = {
        "NVMLError": _NvmlError,
        "NVML_P2P_CAPS_INDEX_NVLINK": 2,
        "NVML_P2P_STATUS_OK": 0,
        "NVML_FEATURE_ENABLED": 1,
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetCount": lambda: len(names),
        "nvmlDeviceGetHandleByIndex": lambda index: index,
        "nvmlDeviceGetName": lambda h: names[h].encode(),  # old versions return bytes
        "nvmlDeviceGetUUID": lambda h: f"GPU-0000000{h}-aaaa",
        "nvmlDeviceGetMemoryInfo": lambda h: types.SimpleNamespace(
            total=int(totals_gib[h] * GiB), free=int((totals_gib[h] - 1) * GiB)
        ),
        "nvmlDeviceGetCudaComputeCapability": lambda h: (9, 0),
        "nvmlDeviceGetPciInfo": lambda h: types.SimpleNamespace(
            busId=f"00000000:{h + 16:02X}:00.0"
        ),
        "nvmlDeviceGetMaxPcieLinkGeneration": lambda h: 5,
        "nvmlDeviceGetMaxPcieLinkWidth": lambda h: 16,
        "nvmlDeviceGetP2PStatus": lambda a, b, caps: 0 if nvlink else 4,
    }
    for key, value in api.items():
        setattr(module, key, value)
    return module


def test_without_nvidia_ml_py_detection_gives_cpu_slots_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    inventory = detect_local(num_cpu_slots=2)
    assert [device.id for device in inventory.devices] == ["cpu-0", "cpu-1"]
    assert inventory.gpus() == []
    assert inventory.hosts[0].cores >= 1
    assert "nvidia-ml-py is not installed" in inventory.notes[0]


def test_nvml_that_cannot_start_is_not_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    module = fake_pynvml([], [], nvlink=False)

    def fail() -> None:
        raise _NvmlError("Driver Not Loaded")

    module.nvmlInit = fail  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", module)
    with pytest.raises(NvmlUnavailable, match="Driver Not Loaded"):
        read_gpus()
    assert detect_local(num_cpu_slots=1).gpus() == []


def test_nvml_reading_fills_devices_from_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    # NVML reports 140.4 GiB for an H200 (driver reservation); the table lists it as 141
    module = fake_pynvml(["NVIDIA H200", "NVIDIA H200"], [140.4, 140.4], nvlink=True)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    inventory = detect_local(num_cpu_slots=1, environ={})
    gpu = inventory.gpus()[0]
    assert (gpu.id, gpu.name, gpu.arch, gpu.family) == ("gpu-0", "H200-141GB", "hopper", "h200")
    assert gpu.memory_gb == 141
    assert gpu.memory_free_gb == 139.4
    assert (gpu.pcie_gen, gpu.pcie_width) == (5, 16)
    assert gpu.nvlink_peers == ("gpu-1",)
    assert gpu.uuid == "GPU-00000000-aaaa"
    assert (gpu.tflops_bf16, gpu.l2_cache_mib) == (989, 50)
    assert [device.id for device in inventory.cpus()] == ["cpu-0"]


def test_cuda_visible_devices_limits_what_a_worker_reports() -> None:
    readings = [
        GpuReading(
            i, f"GPU-{i}abc", "NVIDIA A100-SXM4-40GB", 39.6, 39.0, (8, 0), f"0000:{i}:00.0", 4, 16,
            tuple(j for j in range(3) if j != i),
        )
        for i in range(3)
    ]
    environ = {"CUDA_VISIBLE_DEVICES": "2,GPU-0"}
    inventory = detect_local(1, reader=lambda: readings, environ=environ)
    assert [gpu.id for gpu in inventory.gpus()] == ["gpu-0", "gpu-2"]
    # ids keep the physical index; peers that are not visible are dropped
    assert inventory.gpus()[1].nvlink_peers == ("gpu-0",)


def test_merging_worker_reports_renumbers_across_hosts() -> None:
    def one_host(name: str, gpus: int) -> Inventory:
        readings = [
            GpuReading(i, f"GPU-{name}{i}", "NVIDIA H100 80GB HBM3", 79.6, 79.0, (9, 0), "", 5, 16,
                       tuple(j for j in range(gpus) if j != i))
            for i in range(gpus)
        ]
        local = detect_local(1, reader=lambda: readings, environ={})
        host = {"name": name, "cores": 8, "memory_gb": 64.0}
        return inventory_from_dict({**local.to_dict(), "hosts": [host]})

    merged = merge_inventories([one_host("a", 2), one_host("b", 2)])
    assert [d.id for d in merged.gpus()] == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
    assert [d.index for d in merged.gpus()] == [0, 1, 0, 1]
    assert merged.gpus()[2].nvlink_peers == ("gpu-3",)  # peers follow the new numbering
    assert [d.id for d in merged.cpus()] == ["cpu-0", "cpu-1"]
    assert [h.name for h in merged.hosts] == ["a", "b"]


def test_to_dict_round_trips() -> None:
    readings = [GpuReading(0, "GPU-x", "Tesla T4", 14.7, 14.0, (7, 5), "", 3, 16, ())]
    inventory = detect_local(2, reader=lambda: readings, environ={})
    assert inventory_from_dict(inventory.to_dict()) == inventory
