"""flowrl's tensor serializer, in process and between two real Dask workers."""

from __future__ import annotations

import pytest
import torch
from distributed.protocol import deserialize, serialize

from flowrl.runtime.serialization import register


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.uint8])
def test_round_trip_in_process(dtype: torch.dtype) -> None:
    register()
    tensor = (torch.arange(24).reshape(2, 3, 4) % 5).to(dtype)
    header, frames = serialize(tensor, serializers=("dask",))
    assert header["serializer"] == "dask"
    back = deserialize(header, frames)
    assert back.dtype == dtype and back.shape == tensor.shape
    assert torch.equal(back, tensor)


def test_non_contiguous_scalar_and_empty() -> None:
    register()
    base = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    for tensor in (base.t(), torch.tensor(3.5, dtype=torch.bfloat16), torch.empty(0, 5, dtype=torch.bfloat16)):
        header, frames = serialize(tensor, serializers=("dask",))
        back = deserialize(header, frames)
        assert back.shape == tensor.shape and torch.equal(back, tensor)


def test_parameter_keeps_requires_grad() -> None:
    register()
    parameter = torch.nn.Parameter(torch.ones(2, 2, dtype=torch.bfloat16))
    header, frames = serialize(parameter, serializers=("dask",))
    back = deserialize(header, frames)
    assert isinstance(back, torch.nn.Parameter) and back.requires_grad


def test_packed_state_travels_as_one_buffer_per_dtype_and_comes_back_whole() -> None:
    from distributed.protocol import dumps, loads, to_serialize

    from flowrl.runtime.packing import pack, unpack

    register()
    weight = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    state = {
        "weights": {"w": weight, "b": torch.tensor([7.0, 8.0])},
        "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.full((2, 3), 0.5)}},
                      "param_groups": [{"lr": 1e-3, "params": [0]}]},
        "num_updates": 3,
        "generator": torch.tensor([1, 2, 250], dtype=torch.uint8),
    }
    packed = pack(state)
    # float32: 6 + 2 + 1 + 6 values, in the order met; uint8: the generator's 3 bytes
    assert {name: buffer.numel() for name, buffer in packed.buffers.items()} == {"float32": 15, "uint8": 3}
    assert packed.buffers["float32"][8].item() == 3.0  # the step, after w and b
    weight.add_(100)  # the packed copy shares no memory with the state it came from
    frames = dumps({"x": to_serialize(packed)})
    back = unpack(loads(frames)["x"])
    assert torch.equal(back["weights"]["w"], torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert back["weights"]["b"].tolist() == [7.0, 8.0]
    assert back["optimizer"]["state"][0]["step"].shape == () and back["optimizer"]["state"][0]["step"].item() == 3.0
    assert back["optimizer"]["state"][0]["exp_avg"].shape == (2, 3)
    assert back["optimizer"]["param_groups"] == [{"lr": 1e-3, "params": [0]}]
    assert back["num_updates"] == 3 and back["generator"].tolist() == [1, 2, 250]


class _Holder:
    def __init__(self) -> None:
        from flowrl.runtime.serialization import register as install

        install()
        self.value: torch.Tensor | None = None

    def make(self) -> str:
        # bf16 values that are exact in bf16: 0.5 steps
        self.value = (torch.arange(1000, dtype=torch.float32) / 2).to(torch.bfloat16).reshape(10, 100)
        return "ok"

    async def fetch(self) -> torch.Tensor:
        return self.value

    def pull(self, peer) -> tuple[str, float]:
        tensor = peer.fetch().result(timeout=30)
        return str(tensor.dtype), float(tensor.float().sum())


@pytest.mark.integration
def test_bf16_moves_between_two_real_workers() -> None:
    from flowrl.runtime.cluster import Cluster

    cluster = Cluster.start_local(num_slots=2)
    try:
        first, second = cluster.slots
        client = cluster.client
        a = client.submit(_Holder, actor=True, workers=[first.worker], allow_other_workers=False).result()
        b = client.submit(_Holder, actor=True, workers=[second.worker], allow_other_workers=False).result()
        assert a.make().result(timeout=30) == "ok"
        dtype, total = b.pull(a).result(timeout=60)
        # sum of k/2 for k in 0..999 = 999*1000/4 = 249750
        assert dtype == "torch.bfloat16"
        assert total == 249750.0
    finally:
        cluster.close()
