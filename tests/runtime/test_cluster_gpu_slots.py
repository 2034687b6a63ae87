"""Joined Dask workers started for a GPU become GPU slots; the others are CPU slots."""

from __future__ import annotations

from dataclasses import replace

import pytest

from flowrl.devices.inventory import Device, Host, Inventory
from flowrl.errors import ClusterError
from flowrl.runtime.cluster import Cluster, WorkerSlot, _gpu_slots, claimed_gpu, gpu_declared_unseen


def machine(host: str, gpus: int) -> Inventory:
    """What a worker on ``host`` reports: its GPUs (NVLink between all) and one CPU slot."""
    devices = [
        Device(id=f"gpu-{index}", host=host, index=index, kind="gpu", name="H100-80GB", arch="hopper",
               memory_gb=80.0, uuid=f"GPU-{host}-{index}0000",
               nvlink_peers=tuple(f"gpu-{peer}" for peer in range(gpus) if peer != index))
        for index in range(gpus)
    ]
    devices.append(Device(id="cpu-0", host=host, index=0, kind="cpu", name="cpu", arch="cpu", memory_gb=64.0))
    return Inventory(tuple(devices), (Host(name=host, cores=32, memory_gb=64.0),), "local", ())


def test_the_first_visible_card_is_the_workers() -> None:
    four = machine("a", 4)
    # dask cuda worker: one worker per card, the list rotated so that its card comes first
    gpu = claimed_gpu(four, "2,3,0,1", 0)
    assert gpu is not None and gpu.index == 2
    gpu = claimed_gpu(four, "GPU-a-30", 0)  # a UUID prefix
    assert gpu is not None and gpu.index == 3
    assert claimed_gpu(four, "", 0) is None  # CUDA_VISIBLE_DEVICES="" hides every GPU
    assert claimed_gpu(four, "7", 1) is None  # a card this machine does not have


def test_a_gpu_resource_claims_the_only_card() -> None:
    gpu = claimed_gpu(machine("a", 1), None, 1)
    assert gpu is not None and gpu.index == 0
    assert claimed_gpu(machine("a", 1), None, 0) is None  # a plain `dask worker`: a CPU slot
    assert claimed_gpu(machine("a", 0), None, 1) is None  # no GPU to claim
    with pytest.raises(ClusterError, match="CUDA_VISIBLE_DEVICES"):
        claimed_gpu(machine("a", 4), None, 1)


def slot(name: str, host: str) -> WorkerSlot:
    return WorkerSlot(name=name, worker=name, address=f"tcp://{host}:{len(name)}", host=host)


def started(visible: str | None, gpu: float = 0) -> dict[str, object]:
    return {"cuda_visible_devices": visible, "gpu_resource": gpu}


def test_joined_inventory_has_one_slot_per_worker() -> None:
    slots = [slot("gpu-a0", "a"), slot("gpu-a1", "a"), slot("cpu-a", "a"), slot("gpu-b", "b")]
    reports = {"gpu-a0": machine("a", 2), "gpu-a1": machine("a", 2), "cpu-a": machine("a", 2), "gpu-b": machine("b", 1)}
    raw = {"gpu-a0": started("0,1"), "gpu-a1": started("1,0"), "cpu-a": started(None), "gpu-b": started(None, 1)}
    slots = _gpu_slots(slots, reports, raw)
    assert [(s.kind, s.gpu_index) for s in slots] == [("gpu", 0), ("gpu", 1), ("cpu", None), ("gpu", 0)]

    inventory = Cluster(None, slots, None, reports).inventory()  # type: ignore[arg-type]
    by_id = {device.id: device for device in inventory.devices}
    assert {name: device.kind for name, device in by_id.items()} == {
        "gpu-a0": "gpu", "gpu-a1": "gpu", "gpu-b": "gpu", "cpu-a": "cpu"}
    assert (by_id["gpu-a0"].index, by_id["gpu-a1"].index, by_id["gpu-b"].index) == (0, 1, 0)
    # NVLink peers are the workers that serve the peer cards
    assert by_id["gpu-a0"].nvlink_peers == ("gpu-a1",) and by_id["gpu-a1"].nvlink_peers == ("gpu-a0",)
    assert by_id["gpu-b"].nvlink_peers == ()
    # the CPU worker sees two GPUs it was not started for: said in the notes, not offered
    assert any("cpu-a sees 2 GPU(s)" in note for note in inventory.notes)


def test_a_worker_started_for_a_gpu_it_does_not_see_is_said_to_be_a_cpu_slot() -> None:
    slots = [slot("w1", "a"), slot("w2", "b"), slot("w3", "c"), slot("w4", "d")]
    reports = {"w1": machine("a", 0), "w2": machine("b", 1), "w3": machine("c", 0), "w4": machine("d", 2)}
    raw = {"w1": started(None, 1), "w2": started(None, 1), "w3": started(None), "w4": started("7", 1)}
    slots = _gpu_slots(slots, reports, raw)
    assert [s.kind for s in slots] == ["cpu", "gpu", "cpu", "cpu"]
    notes = gpu_declared_unseen(slots, reports, raw)
    # w2 got its card; w3 was started as a CPU worker; w4 sees GPUs but not the card it names
    # (the inventory's own note says that one)
    assert list(notes) == ["w1"]
    assert notes["w1"].startswith("worker w1 was started with a GPU resource but sees no GPU: it is a CPU slot")


def test_two_workers_on_one_card_are_refused() -> None:
    slots = [slot("w1", "a"), slot("w2", "a")]
    reports = {"w1": machine("a", 2), "w2": machine("a", 2)}
    with pytest.raises(ClusterError, match="both serve GPU 1"):
        _gpu_slots(slots, reports, {"w1": started("1"), "w2": started("1,0")})
    # the same card index on two machines is two cards
    other = [slot("w1", "a"), replace(slot("w2", "b"))]
    kinds = _gpu_slots(other, {"w1": machine("a", 1), "w2": machine("b", 1)}, {"w1": started("0"), "w2": started("0")})
    assert [s.kind for s in kinds] == ["gpu", "gpu"]


def test_a_lost_joined_gpu_slot_is_taken_by_a_card_of_the_same_model_on_any_machine() -> None:
    """The kind a replacement must have: a joined GPU slot names its card's model (a
    newcomer on another machine, at another index, serves as well); a CPU slot any CPU
    worker; a local cluster's GPU slot its card's index."""
    reports = {"w1": machine("a", 2), "w2": machine("b", 1)}
    gpu_slot = replace(slot("w1", "a"), kind="gpu", gpu_index=1)
    joined = Cluster(None, [gpu_slot, slot("w2", "b")], None, reports)  # type: ignore[arg-type]
    assert joined._kind(gpu_slot) == "gpu:H100-80GB"
    assert joined._kind(slot("w2", "b")) == "cpu"
    local = Cluster(None, [gpu_slot], object(), {})  # type: ignore[arg-type]
    assert local._kind(gpu_slot) == "gpu-1"
