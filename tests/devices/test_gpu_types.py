"""The GPU type table: NVML names find their row; unlisted cards get an estimate."""

from __future__ import annotations

import pytest

from flowrl.devices.gpu_types import (
    ARCHITECTURES,
    GPU_TYPES,
    arch_from_capability,
    estimate_gpu,
    lookup_gpu,
)


@pytest.mark.parametrize(
    ("nvml_name", "memory_gb", "expected"),
    [
        ("NVIDIA H200", 140.4, "H200-141GB"),
        ("NVIDIA A100-SXM4-40GB", 39.6, "A100-40GB"),
        ("NVIDIA A100-SXM4-80GB", 79.3, "A100-80GB"),
        ("NVIDIA A100 80GB PCIe", 79.3, "A100-80GB"),
        ("NVIDIA A100-PCIE-40GB", None, "A100-40GB"),
        ("NVIDIA H100 80GB HBM3", 79.6, "H100-80GB"),
        ("NVIDIA H100 PCIe", 79.6, "H100-80GB-PCIe"),
        ("NVIDIA H100 NVL", 93.6, "H100-94GB-NVL"),
        ("Tesla V100-SXM2-16GB", 15.8, "V100-16GB"),
        ("Tesla V100S-PCIE-32GB", 31.7, "V100-32GB"),
        ("Tesla T4", 14.7, "T4"),
        ("NVIDIA A10", 22.5, "A10"),  # whole words: A10 is not A100 or A10G
        ("NVIDIA A10G", 22.5, "A10G"),
        ("NVIDIA L4", 22.0, "L4"),
        ("NVIDIA L40S", 44.5, "L40S"),
        ("NVIDIA GeForce RTX 4090", 23.6, "RTX-4090"),
        ("NVIDIA B200", 179.0, "B200"),
        ("A100-40GB", None, "A100-40GB"),  # a table key finds itself
    ],
)
def test_nvml_names_find_their_row(nvml_name: str, memory_gb: float | None, expected: str) -> None:
    found = lookup_gpu(nvml_name, memory_gb)
    assert found is not None and found.name == expected


def test_a100_without_memory_in_its_name_is_told_apart_by_measured_memory() -> None:
    # "NVIDIA A100-SXM4" alone: the measured 79.2 GiB is nearer 80 than 40
    found = lookup_gpu("NVIDIA A100-SXM4", 79.2)
    assert found is not None and found.name == "A100-80GB"


def test_unlisted_card_is_estimated_from_its_compute_capability() -> None:
    estimate = estimate_gpu("NVIDIA RTX 6000 Ada Generation", 47.5, (8, 9))
    assert not estimate.known
    assert estimate.arch == "ada"
    assert estimate.memory_gb == 47.5
    assert estimate.tflops_bf16 > 0 and estimate.bandwidth_gbs > 0
    # its L2 the generation's largest listed (the L40S's 96 MiB), so memory errs large
    assert estimate.l2_cache_mib == 96


@pytest.mark.parametrize(
    ("capability", "arch"),
    [((6, 0), "pascal"), ((7, 0), "volta"), ((7, 5), "turing"), ((8, 0), "ampere"),
     ((8, 6), "ampere"), ((8, 9), "ada"), ((9, 0), "hopper"), ((10, 0), "blackwell"),
     ((12, 0), "blackwell")],
)
def test_arch_from_capability(capability: tuple[int, int], arch: str) -> None:
    assert arch_from_capability(*capability) == arch


def test_every_row_is_consistent() -> None:
    for name, row in GPU_TYPES.items():
        assert row.name == name
        assert row.arch in ARCHITECTURES
        assert arch_from_capability(*row.compute_capability) == row.arch
        assert row.memory_gb > 0 and row.tflops_bf16 > 0 and row.bandwidth_gbs > 0
        # an unlisted card of the same generation is given at least this row's L2
        assert 0 < row.l2_cache_mib <= estimate_gpu("?", 1.0, row.compute_capability).l2_cache_mib
