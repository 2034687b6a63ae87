"""Why a device group cannot be matched, which devices came closest, and what would fix it.

Messages follow one shape so a user can act on them without reading code::

    actor_group needs 2 gpus with >= 80 GiB; closest: gpu-3 H100-80GB (80 GiB),
    gpu-0 A100-40GB (40 GiB): lower min_memory_gb to 40 or set count: 1
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from flowrl.devices.gpu_types import arch_matches, known_arch_words
from flowrl.devices.inventory import Device
from flowrl.spec.messages import did_you_mean
from flowrl.spec.schema import DeviceGroupSpec

_MAX_CLOSEST = 4  # enough to see the pattern without flooding the line
_JOINED_CPU = " (on a joined Dask cluster: start more CPU workers)"
"""cpu_slots sizes the local cluster only; a joined cluster's slots are the workers started."""


def gib(value: float) -> str:
    """``40 GiB``, ``79.6 GiB``: an inventory's memory, in the unit its files and
    ``min_memory_gb`` use."""
    return f"{round(value, 1):g} GiB"


def plural(count: int, kind: str) -> str:
    word = "cpu slot" if kind == "cpu" else "gpu"
    return f"{count} {word}{'s' if count != 1 else ''}"


def arch_word_problem(spec: DeviceGroupSpec) -> tuple[str, str] | None:
    """(field, message) for the first ``arch`` / ``preferred_arch`` a group cannot use: any on
    a CPU group, a word that names no architecture or family; None when all can be matched."""
    known = known_arch_words()
    for field_name in ("arch", "preferred_arch"):
        words = getattr(spec, field_name) or []
        if words and spec.type == "cpu":
            return field_name, "applies to gpu groups; remove it or set type: gpu"
        for word in words:
            if word.lower() not in known:
                return field_name, (f"unknown architecture '{word}'{did_you_mean(word.lower(), known)}; known: "
                                    f"{', '.join(known)}")
    return None


def fits_arch(device: Device, spec: DeviceGroupSpec) -> bool:
    return spec.arch is None or any(arch_matches(w, device.arch, device.family) for w in spec.arch)


def fits_memory(device: Device, spec: DeviceGroupSpec) -> bool:
    return spec.min_memory_gb is None or device.memory_gb >= spec.min_memory_gb


def requirement(spec: DeviceGroupSpec, count: int) -> str:
    """``2 gpus with >= 40 GiB of arch v100 or a100``."""
    text = plural(count, spec.type)
    if spec.min_memory_gb is not None:
        text += f" with >= {gib(spec.min_memory_gb)}"
    if spec.arch is not None:
        text += f" of arch {' or '.join(spec.arch)}"
    return text


def explain_alone(group: str, spec: DeviceGroupSpec, pool: Sequence[Device], count: int) -> str:
    """Why ``group`` cannot get ``count`` devices of ``pool`` even with no other group."""
    need = f"{group} needs {requirement(spec, count)}"
    if not pool:
        if spec.type == "gpu":
            return (
                f"{need}; this inventory has no gpus: set type: cpu, run where GPUs are (on a "
                "joined Dask cluster: start GPU workers), or plan for an inventory with gpus "
                "(flowrl plan PIPELINE --devices devices/FILE.yaml)"
            )
        return f"{need}; this inventory has no cpu slots: raise runtime.cpu_slots{_JOINED_CPU}"
    if count > len(pool):
        listed = ", ".join(device.id for device in pool[:_MAX_CLOSEST])
        more = ", ..." if len(pool) > _MAX_CLOSEST else ""
        fix = f"set count: {len(pool)}"
        if spec.type == "cpu":
            fix += f", or raise runtime.cpu_slots to {count}{_JOINED_CPU}"
        return f"{need}; the inventory has {plural(len(pool), spec.type)} ({listed}{more}): {fix}"
    arch_ok = [device for device in pool if fits_arch(device, spec)]
    memory_ok = [device for device in pool if fits_memory(device, spec)]
    both = [device for device in arch_ok if fits_memory(device, spec)]
    closest = sorted(
        pool,
        key=lambda d: (not fits_arch(d, spec), not fits_memory(d, spec), -d.memory_gb, d.number),
    )[: max(1, min(count, _MAX_CLOSEST))]
    shown = ", ".join(_describe(device, spec) for device in closest)
    fixes: list[str] = []
    if spec.min_memory_gb is not None and len(arch_ok) >= count:
        enough = sorted((d.memory_gb for d in arch_ok), reverse=True)[count - 1]
        fixes.append(f"lower min_memory_gb to {_floor_tenth(enough):g}")
    if spec.arch is not None and len(memory_ok) >= count:
        best = sorted(memory_ok, key=lambda d: (not fits_arch(d, spec), -d.memory_gb, d.number))
        missing = _unique(d.family for d in best[:count] if not fits_arch(d, spec))
        fixes.append(f"add {', '.join(missing)} to arch")
    if both:
        fixes.append(f"set count: {len(both)}")
    if not fixes:  # both filters bite: relax both
        best = sorted(pool, key=lambda d: (-d.memory_gb, d.number))[:count]
        fixes.append(
            f"lower min_memory_gb to {_floor_tenth(best[-1].memory_gb):g} and add "
            f"{', '.join(_unique(d.family for d in best if not fits_arch(d, spec)))} to arch"
        )
    return f"{need}; closest: {shown}: {' or '.join(fixes)}"


def explain_together(
    groups: Sequence[str],
    needs: dict[str, str],
    total: int,
    fitting: Sequence[Device],
    kind: str,
    exclusive: Sequence[str] = (),
) -> str:
    """Why ``groups`` fail together although each would fit alone; ``exclusive``: those of
    them that keep their devices to themselves (else sharing could help)."""
    each = "; ".join(f"{group}: {needs[group]}" for group in groups)
    share = f"let {_and(list(exclusive))} share devices (drop exclusive: true), " if exclusive else ""
    listed = ", ".join(device.label for device in fitting[:8])
    more = ", ..." if len(fitting) > 8 else ""
    return (
        f"{_and(groups)} together need {plural(total, kind)} ({each}), but only "
        f"{len(fitting)} fit them: {listed}{more}; lower a count, relax min_memory_gb or arch "
        f"so more devices fit, {share}or match against a larger inventory"
    )


def _describe(device: Device, spec: DeviceGroupSpec) -> str:
    if device.kind == "cpu":
        return f"{device.id} ({gib(device.memory_gb)})"
    details = [gib(device.memory_gb)]
    if spec.arch is not None:
        details.append(device.family if device.family != device.arch else device.arch)
    return f"{device.label} ({', '.join(details)})"


def _floor_tenth(value: float) -> float:
    # rounding down keeps the suggested value satisfiable by the device it came from
    return math.floor(value * 10 + 1e-9) / 10


def _unique(items: Iterable[str]) -> list[str]:
    seen: list[str] = []
    for item in items:
        if item not in seen:
            seen.append(item)
    return seen


def _and(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
