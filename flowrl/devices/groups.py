"""The device groups a pipeline asks for, as matching sees them."""

from __future__ import annotations

from flowrl.graph import PipelineGraph
from flowrl.spec.schema import DeviceGroupSpec, PipelineSpec

AUTO_GROUP_PREFIX = "auto:"
"""A model that names no device group gets its own one-CPU-slot group ``auto:<model>``."""


def pipeline_groups(spec: PipelineSpec) -> dict[str, DeviceGroupSpec]:
    """The pipeline's device groups plus the one-CPU-slot group of each model that names none."""
    groups = dict(spec.devices)
    for model_name, model in spec.models.items():
        if model.device_group is None:
            groups[f"{AUTO_GROUP_PREFIX}{model_name}"] = DeviceGroupSpec()
    return groups


def offload_notes(spec: PipelineSpec) -> dict[str, str]:
    """``offloaded: reference`` for groups whose models keep weights in host memory."""
    notes: dict[str, list[str]] = {}
    for model_name, model in spec.models.items():
        if model.offload_to_cpu:
            group = model.device_group or f"{AUTO_GROUP_PREFIX}{model_name}"
            notes.setdefault(group, []).append(model_name)
    return {group: f"offloaded: {', '.join(models)}" for group, models in notes.items()}


def model_group(pipeline: PipelineGraph, model: str) -> str:
    group = pipeline.spec.models[model].device_group
    return group if group is not None else f"{AUTO_GROUP_PREFIX}{model}"
