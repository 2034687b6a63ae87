"""The one table of known GPU types, and how an NVML name string finds its row.

Numbers are the vendor's data-sheet figures for the usual (SXM where one exists) board:
memory as sold (the number in the product name, which is what users write in
``min_memory_gb``), dense bf16 tensor TFLOP/s (no sparsity), memory bandwidth in GB/s and the
L2 cache in MiB.
Volta and Turing have no bf16 tensor cores; their ``tflops_bf16`` is the fp16 tensor
rate, what a model of ``dtype: fp16`` gets there. A model left in bf16 on such a card runs
without tensor cores, several times slower than a plan from this rate says: give it
``dtype: fp16`` there.

The planner reads these numbers to predict times for machines described in ``devices/*.yaml``
files, so a missing card is better described by a conservative estimate (``estimate_gpu``)
than by nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# declared in the spec layer, which checks inventory files and cannot import this one
from flowrl.spec.inventory_file import ARCHITECTURES

__all__ = ["ARCHITECTURES", "GPU_FAMILIES", "GPU_TYPES", "GpuType", "estimate_gpu", "lookup_gpu"]


@dataclass(frozen=True)
class GpuType:
    """One kind of GPU board."""

    name: str
    """Table key as written in inventory files (``A100-40GB``)."""
    family: str
    """Lower-case product family (``a100``); pipelines may name it in ``arch``."""
    arch: str
    """Architecture (``ampere``); one of ``ARCHITECTURES``."""
    memory_gb: float
    """Memory as sold, in GiB (the number in the product name)."""
    tflops_bf16: float
    """Dense bf16 tensor throughput in TFLOP/s (fp16 for volta/turing)."""
    bandwidth_gbs: float
    """Memory bandwidth in GB/s."""
    compute_capability: tuple[int, int]
    """CUDA compute capability (major, minor)."""
    l2_cache_mib: float
    """L2 cache in MiB. torch's compiler allocates a buffer of this size whenever it times
    kernel variants (to flush the cache between timings), so it is memory a compiled node
    needs on its first step (``flowrl.planner.cost.compile_benchmark_bytes``)."""
    variant: str | None = None
    """A word the NVML name must contain to pick this row over its family's default
    (``PCIE`` for the PCIe H100). None for the default board."""
    known: bool = True
    """False for an estimate made from the compute capability of an unlisted card."""


def _row(
    name: str,
    family: str,
    arch: str,
    memory_gb: float,
    tflops_bf16: float,
    bandwidth_gbs: float,
    capability: tuple[int, int],
    l2_cache_mib: float,
    variant: str | None = None,
) -> GpuType:
    return GpuType(name, family, arch, memory_gb, tflops_bf16, bandwidth_gbs, capability, l2_cache_mib, variant)


GPU_TYPES: dict[str, GpuType] = {
    row.name: row
    for row in (
        _row("V100-16GB", "v100", "volta", 16, 125, 900, (7, 0), 6),
        _row("V100-32GB", "v100", "volta", 32, 125, 900, (7, 0), 6),
        _row("T4", "t4", "turing", 16, 65, 320, (7, 5), 4),
        _row("A10", "a10", "ampere", 24, 125, 600, (8, 6), 6),
        _row("A10G", "a10g", "ampere", 24, 70, 600, (8, 6), 6),
        _row("RTX-3090", "rtx-3090", "ampere", 24, 71, 936, (8, 6), 6),
        _row("A100-40GB", "a100", "ampere", 40, 312, 1555, (8, 0), 40),
        _row("A100-80GB", "a100", "ampere", 80, 312, 2039, (8, 0), 40),
        _row("L4", "l4", "ada", 24, 121, 300, (8, 9), 48),
        _row("L40S", "l40s", "ada", 48, 362, 864, (8, 9), 96),
        _row("RTX-4090", "rtx-4090", "ada", 24, 165, 1008, (8, 9), 72),
        _row("H100-80GB", "h100", "hopper", 80, 989, 3350, (9, 0), 50),
        _row("H100-80GB-PCIe", "h100", "hopper", 80, 756, 2000, (9, 0), 50, variant="PCIE"),
        _row("H100-94GB-NVL", "h100", "hopper", 94, 835, 3900, (9, 0), 50, variant="NVL"),
        _row("H200-141GB", "h200", "hopper", 141, 989, 4800, (9, 0), 50),
        _row("B200", "b200", "blackwell", 180, 2250, 8000, (10, 0), 126),
    )
}
"""Every known GPU type by table key."""

GPU_FAMILIES: frozenset[str] = frozenset(row.family for row in GPU_TYPES.values())
"""Every family name (``a100``, ``h100``, ...)."""

# A conservative stand-in per architecture for cards not in the table: the smallest
# data-center board of that generation, so predictions err on the slow side.
_ARCH_FALLBACK: dict[str, tuple[float, float]] = {
    "pascal": (21, 732),  # P100 fp16 rate; no tensor cores
    "volta": (125, 900),
    "turing": (65, 320),
    "ampere": (70, 600),
    "ada": (121, 300),
    "hopper": (756, 2000),
    "blackwell": (2250, 8000),
}


# For the same unlisted cards, the largest L2 of the generation: the planner adds it to a
# compiled node's memory, so erring large keeps its memory prediction on the safe side.
_ARCH_L2_MIB: dict[str, float] = {
    "pascal": 4,
    "volta": 6,
    "turing": 6,
    "ampere": 40,
    "ada": 96,
    "hopper": 50,
    "blackwell": 126,
}


def arch_from_capability(major: int, minor: int) -> str:
    """Architecture of a CUDA compute capability; newer than known counts as the newest."""
    if major <= 6:
        return "pascal"
    if major == 7:
        return "turing" if minor >= 5 else "volta"
    if major == 8:
        return "ada" if minor >= 9 else "ampere"
    if major == 9:
        return "hopper"
    return "blackwell"


def _tokens(text: str) -> list[str]:
    """Upper-case words of a product name, without vendor prefixes."""
    words = [word for word in re.split(r"[^A-Za-z0-9]+", text.upper()) if word]
    return [word for word in words if word not in ("NVIDIA", "TESLA", "GEFORCE", "QUADRO")]


def _family_words(family: str) -> list[str]:
    return [word.upper() for word in family.split("-")]


def lookup_gpu(nvml_name: str, memory_gb: float | None = None) -> GpuType | None:
    """The table row of an NVML name (``NVIDIA A100-SXM4-40GB``), or None when unlisted.

    A row matches when its family's words appear as whole words of the name (so ``A10``
    does not match ``A100``) and its variant word, if any, appears too. Among matches the
    most specific wins (a variant row over the family default), then the row whose memory
    equals a ``<N>GB`` word in the name, then the one closest to the measured ``memory_gb``.
    """
    if nvml_name in GPU_TYPES:
        return GPU_TYPES[nvml_name]
    words = _tokens(nvml_name)
    candidates: list[GpuType] = []
    for row in GPU_TYPES.values():
        family = _family_words(row.family)
        if not any(words[i : i + len(family)] == family for i in range(len(words))):
            # V100S is sold as a V100 with more bandwidth; treat it as its family
            if not (row.family == "v100" and "V100S" in words):
                continue
        if row.variant is not None and row.variant not in words:
            continue
        candidates.append(row)
    if not candidates:
        return None
    stated = [float(word[:-2]) for word in words if re.fullmatch(r"\d+GB", word)]

    def rank(row: GpuType) -> tuple[int, int, float]:
        specific = 0 if row.variant is not None else 1
        named = 0 if row.memory_gb in stated else 1
        distance = abs(row.memory_gb - memory_gb) if memory_gb is not None else 0.0
        return specific, named, distance

    return min(candidates, key=rank)


def estimate_gpu(
    nvml_name: str, memory_gb: float, compute_capability: tuple[int, int] | None
) -> GpuType:
    """The table row for ``nvml_name``, or an estimate from its compute capability.

    The estimate keeps the measured memory and takes throughput from the most modest
    board of the same architecture; ``known`` is False on it.
    """
    found = lookup_gpu(nvml_name, memory_gb)
    if found is not None:
        return found
    major, minor = compute_capability if compute_capability is not None else (7, 0)
    arch = arch_from_capability(major, minor)
    tflops, bandwidth = _ARCH_FALLBACK[arch]
    label = " ".join(_tokens(nvml_name)) or nvml_name
    return GpuType(
        name=label,
        family=label.lower().replace(" ", "-"),
        arch=arch,
        memory_gb=round(memory_gb, 1),
        tflops_bf16=tflops,
        bandwidth_gbs=bandwidth,
        compute_capability=(major, minor),
        l2_cache_mib=_ARCH_L2_MIB[arch],
        known=False,
    )


def arch_matches(token: str, arch: str, family: str) -> bool:
    """True when a pipeline's ``arch`` word (``hopper`` or ``h100``) names this device."""
    word = token.lower()
    return word == arch or word == family


def known_arch_words() -> list[str]:
    """Every word ``arch``/``preferred_arch`` accept: architectures, then families."""
    return [*ARCHITECTURES, *sorted(GPU_FAMILIES)]
