"""The schema of ``devices/*.yaml`` inventory files, and their loader.

An inventory file describes machines you may not have, so that pipelines can be matched
and planned against them::

    name: mixed-4gpu
    hosts:
      node-0:
        cpus: {cores: 64, memory_gb: 512, slots: 2}
        nvlink: false
        gpus:
          - {type: A100-40GB, count: 2}
          - {type: V100-32GB}
          - {type: H100-80GB}
          - {type: MI-X, memory_gb: 64, arch: hopper}   # not in the table: say its memory

Like the pipeline loader, every problem is reported at once as ``file:line: path: message``
(exit code 2). The GPU type table lives in the devices layer, above this one, so its names
are passed in (``known_gpu_types``) instead of imported.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError


from flowrl.errors import SpecError, SpecIssue
from flowrl.spec.lines import LineMap, line_of, read_yaml_file
from flowrl.spec.messages import did_you_mean, issues_from_validation, show
from flowrl.spec.strict import StrictModel

ARCHITECTURES: tuple[str, ...] = (
    "pascal",
    "volta",
    "turing",
    "ampere",
    "ada",
    "hopper",
    "blackwell",
)
"""Known GPU architectures, oldest first (the GPU type table uses these)."""


class GpuEntry(StrictModel):
    """One or more identical GPUs of a host."""

    type: str
    """A GPU type from the table (``A100-40GB``), or any label when ``memory_gb`` is given.
    Required."""
    count: int = Field(default=1, ge=1)
    """How many of them. Default 1."""
    memory_gb: float | None = Field(default=None, gt=0)
    """Memory per GPU in GiB; overrides the table, required for a type not in it.
    Default None (from the table)."""
    arch: str | None = None
    """Architecture (volta, turing, ampere, ada, hopper, blackwell); overrides the table.
    Default None (from the table; ``ampere`` for an unlisted type)."""
    tflops_bf16: float | None = Field(default=None, gt=0)
    """Dense bf16 TFLOP/s; overrides the table. Default None (from the table)."""
    bandwidth_gbs: float | None = Field(default=None, gt=0)
    """Memory bandwidth in GB/s; overrides the table. Default None (from the table)."""


class CpuEntry(StrictModel):
    """The host's CPUs and memory, and how many CPU device slots it offers."""

    cores: int = Field(ge=1)
    """Logical CPU cores. Required."""
    memory_gb: float = Field(gt=0)
    """Host memory in GiB. Required."""
    slots: int = Field(default=1, ge=1)
    """CPU device slots (one worker process each) that CPU device groups can use. Default 1."""


class HostEntry(StrictModel):
    """One machine."""

    cpus: CpuEntry
    """CPU cores, memory and CPU slots. Required."""
    gpus: list[GpuEntry] = []
    """GPUs in NVML index order; entries with a count expand in place. Default []."""
    nvlink: bool = False
    """All GPUs of this host reach each other over NVLink (NVSwitch). Default false."""


class InventoryFileSpec(StrictModel):
    """A whole inventory file."""

    name: str = Field(min_length=1)
    """Name of the inventory, shown in logs. Required."""
    description: str = ""
    """One line saying what machine(s) this is. Default empty."""
    hosts: dict[str, HostEntry] = Field(min_length=1)
    """Machines by host name, in order; device numbers follow this order. Required."""


class InventoryFileError(SpecError):
    """An inventory file with one or more problems; all of them are listed."""

    subject = "the device inventory"


def load_inventory_file(
    path: str | Path, known_gpu_types: Collection[str] = ()
) -> InventoryFileSpec:
    """Read and validate an inventory file; raise ``InventoryFileError`` listing every issue.

    ``known_gpu_types`` are the GPU type names an entry may use without ``memory_gb``;
    when empty, type names are not checked.
    """
    source = str(path)
    data, line_map, duplicates = read_yaml_file(path, "inventory", InventoryFileError)
    return inventory_spec_from_dict(data, source, line_map, duplicates, known_gpu_types)


def inventory_spec_from_dict(
    data: Any,
    source: str | None = None,
    line_map: LineMap | None = None,
    early: list[SpecIssue] | None = None,
    known_gpu_types: Collection[str] = (),
) -> InventoryFileSpec:
    """Validate plain data into an ``InventoryFileSpec`` (``file:line`` when a map is given)."""
    lines = line_map or {}
    issues = list(early or [])
    if not isinstance(data, dict):
        found = "the file is empty" if data is None else f"found {show(data)}"
        message = f"expected a mapping with name and hosts; {found}"
        raise InventoryFileError([*issues, SpecIssue("", message, source, 1 if source else None)])
    found_issues: list[tuple[str, str]] = []
    spec: InventoryFileSpec | None = None
    try:
        spec = InventoryFileSpec.model_validate(data)
    except ValidationError as error:
        plain = issues_from_validation(error)
        for detail, (path, message) in zip(error.errors(), plain):
            if detail["type"] == "extra_forbidden":
                message = _unknown_field(detail["loc"])
            found_issues.append((path, message))
    found_issues.extend(_gpu_issues(data, known_gpu_types))
    issues.extend(
        SpecIssue(path, message, source, line_of(path, lines) if source else None)
        for path, message in found_issues
    )
    if issues:
        issues.sort(key=lambda issue: issue.line or 0)
        raise InventoryFileError(issues)
    assert spec is not None
    return spec


_OWNERS: dict[int, type[BaseModel]] = {1: InventoryFileSpec, 3: HostEntry}


def _unknown_field(loc: tuple[Any, ...]) -> str:
    """``unknown field 'gpu' (did you mean 'gpus'?)`` with the fields allowed at that place."""
    name = str(loc[-1])
    owner: type[BaseModel] | None = _OWNERS.get(len(loc))
    if len(loc) == 4 and loc[2] == "cpus":
        owner = CpuEntry
    if len(loc) == 5 and loc[2] == "gpus":
        owner = GpuEntry
    allowed = list(owner.model_fields) if owner is not None else []
    hint = did_you_mean(name, allowed)
    return f"unknown field '{name}'{hint or '; allowed: ' + ', '.join(allowed)}"


def _gpu_issues(data: dict[str, Any], known: Collection[str]) -> list[tuple[str, str]]:
    """Type names not in the table (without memory_gb) and unknown architectures."""
    issues: list[tuple[str, str]] = []
    hosts = data.get("hosts")
    if not isinstance(hosts, dict):
        return issues
    for host_name, host in hosts.items():
        gpus = host.get("gpus") if isinstance(host, dict) else None
        if not isinstance(gpus, list):
            continue
        for position, entry in enumerate(gpus):
            if not isinstance(entry, dict):
                continue
            path = f"hosts.{host_name}.gpus.{position}"
            arch = entry.get("arch")
            if isinstance(arch, str) and arch not in ARCHITECTURES:
                hint = did_you_mean(arch, ARCHITECTURES)
                issues.append(
                    (f"{path}.arch", f"unknown architecture '{arch}'{hint}; known: "
                     f"{', '.join(ARCHITECTURES)}")
                )
            gpu_type = entry.get("type")
            if not known or not isinstance(gpu_type, str) or gpu_type in known:
                continue
            if entry.get("memory_gb") is None:
                hint = did_you_mean(gpu_type, known)
                issues.append(
                    (
                        f"{path}.type",
                        f"unknown GPU type '{gpu_type}'{hint}; use a known type "
                        f"({', '.join(known)}) or give memory_gb (and arch) for another card",
                    )
                )
    return issues
