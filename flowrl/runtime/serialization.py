"""Tensor serialization for Dask that handles every dtype and device.

Dask's own torch serializer goes through ``tensor.numpy()``, which fails for bfloat16 and
CUDA tensors; worker to worker the failure is silent and the transfer hangs. This one sends
the raw bytes with dtype and shape beside them. Tensors always arrive on the CPU: the role
that receives them moves them to its own device.

Registration must happen in the client process and in every worker: ``register()`` does it
here, ``TorchSerializerPlugin`` does it on workers (including ones that join later).
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.protocol import dask_deserialize, dask_serialize

from flowrl.runtime.packing import Packed

_registered = False


def _serialize_tensor(tensor: torch.Tensor) -> tuple[dict[str, Any], list[memoryview]]:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    header = {
        "dtype": str(flat.dtype).removeprefix("torch."),
        "shape": list(tensor.shape),
        "requires_grad": bool(tensor.requires_grad),
    }
    raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
    return header, [memoryview(raw.numpy().data)]


def _deserialize_tensor(header: dict[str, Any], frames: list[Any]) -> torch.Tensor:
    dtype = getattr(torch, header["dtype"])
    buffer = bytearray(frames[0]) if frames else bytearray()
    raw = torch.frombuffer(buffer, dtype=torch.uint8) if buffer else torch.empty(0, dtype=torch.uint8)
    tensor = raw.view(dtype).reshape(header["shape"])
    if header["requires_grad"]:
        tensor.requires_grad_(True)
    return tensor


def _serialize_parameter(parameter: torch.nn.Parameter) -> tuple[dict[str, Any], list[memoryview]]:
    header, frames = _serialize_tensor(parameter.data)
    header["requires_grad"] = bool(parameter.requires_grad)
    return header, frames


def _deserialize_parameter(header: dict[str, Any], frames: list[Any]) -> torch.nn.Parameter:
    requires_grad = bool(header["requires_grad"])
    tensor = _deserialize_tensor({**header, "requires_grad": False}, frames)
    return torch.nn.Parameter(tensor, requires_grad=requires_grad)


def _serialize_packed(packed: Packed) -> tuple[dict[str, Any], list[Any]]:
    # The skeleton (dicts of slots and plain values) is pickled into the first frame; each
    # buffer goes as one raw frame, as any tensor does.
    headers: list[dict[str, Any]] = []
    frames: list[Any] = [pickle.dumps(packed.skeleton, protocol=pickle.HIGHEST_PROTOCOL)]
    for tensor in packed.buffers.values():
        header, tensor_frames = _serialize_tensor(tensor)
        headers.append(header)
        frames.extend(tensor_frames)
    return {"dtypes": list(packed.buffers), "tensors": headers}, frames


def _deserialize_packed(header: dict[str, Any], frames: list[Any]) -> Packed:
    buffers = {dtype: _deserialize_tensor(tensor_header, [frame])
               for dtype, tensor_header, frame in zip(header["dtypes"], header["tensors"], frames[1:])}
    return Packed(pickle.loads(frames[0]), buffers)


def register() -> None:
    """Install flowrl's tensor serializer in this process (idempotent)."""
    global _registered
    if _registered:
        return
    # Resolve Dask's lazy torch registration first, so that it cannot run later and
    # replace ours.
    dask_serialize.dispatch(torch.Tensor)
    dask_deserialize.dispatch(torch.Tensor)
    dask_serialize.register(torch.Tensor)(_serialize_tensor)
    dask_deserialize.register(torch.Tensor)(_deserialize_tensor)
    dask_serialize.register(torch.nn.Parameter)(_serialize_parameter)
    dask_deserialize.register(torch.nn.Parameter)(_deserialize_parameter)
    dask_serialize.register(Packed)(_serialize_packed)
    dask_deserialize.register(Packed)(_deserialize_packed)
    _registered = True


class TorchSerializerPlugin(WorkerPlugin):
    """Registers the serializer on each worker when it starts or joins."""

    name = "flowrl-torch-serializer"

    def setup(self, worker: Any) -> None:
        register()
