"""The schedule simulator on a small DAG with fixed costs: start and end by hand."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from flowrl.devices.inventory import Device
from flowrl.planner.costs import MeasuredCosts, NodeMemory
from flowrl.planner.simulate import Placement, simulate
from flowrl.planner.work import NodeWork
from flowrl.spec.loader import pipeline_from_dict

from tests.planner.conftest import cpu, grpo, inventory

SECONDS = {"rollout": 10.0, "reward": 1.0, "ref": 4.0, "adv": 2.0, "train": 5.0}


class FixedCosts:
    """Fixed node times; only the rollout has output worth moving (1 GB)."""

    def compute_s(self, node: str, devices: Sequence[Device], offloaded: bool) -> float:
        return SECONDS[node]

    def fixed_s(self, node: str, devices: Sequence[Device], offloaded: bool) -> float:
        return 0.0

    def memory(self, node: str, width: int) -> NodeMemory:
        return NodeMemory(0.0, 0.0, 0.0)

    def output_bytes(self, node: str) -> float:
        return 1e9 if node == "rollout" else 0.0

    def work(self, node: str) -> NodeWork:
        return NodeWork("forward", "per_token", None, "policy", "fp32", None, 16, 9, 16)


def test_schedule_of_a_grpo_step_on_two_cpu_slots() -> None:
    pipeline = pipeline_from_dict(grpo({"path": "builtin:tiny-llama"}, {"path": "builtin:tiny-llama"}, {}))
    place = {node: Placement(("cpu-0",)) for node in SECONDS}
    place["ref"] = Placement(("cpu-1",))
    schedule = simulate(pipeline, place, inventory(cpu(0), cpu(1)), FixedCosts())
    ends = {task.name: (task.start_s, task.end_s) for task in schedule.tasks}
    # rollout on cpu-0 from 0 to 10
    assert ends["rollout"] == (0.0, 10.0)
    # reward: same device, data ready at 10 -> 10..11
    assert ends["reward"] == (10.0, 11.0)
    # ref on cpu-1: 1 GB over the host link (5 GB/s) = 0.2 s plus 3 ms latency -> 10.203..14.203
    assert ends["ref"] == pytest.approx((10.203, 14.203))
    # adv after reward on cpu-0: 11..13
    assert ends["adv"] == (11.0, 13.0)
    # train waits for ref's (empty) result: 14.203 + 0.003 latency = 14.206 .. 19.206
    assert ends["train"] == pytest.approx((14.206, 19.206))
    assert schedule.iteration_s == pytest.approx(19.206)
    assert schedule.critical_path == ("rollout", "ref", "train")


def test_device_exclusivity_serialises_nodes_on_one_device() -> None:
    pipeline = pipeline_from_dict(grpo({"path": "builtin:tiny-llama"}, {"path": "builtin:tiny-llama"}, {}))
    place = {node: Placement(("cpu-0",)) for node in SECONDS}
    schedule = simulate(pipeline, place, inventory(cpu(0)), FixedCosts())
    # everything on one device runs back to back: 10 + 1 + 4 + 2 + 5 = 22
    assert schedule.iteration_s == pytest.approx(22.0)
    # ref is ready at 10 but the device is busy with reward until 11
    assert schedule.task("ref").start_s == 11.0
    assert schedule.critical_path == ("rollout", "reward", "ref", "adv", "train")


def test_measured_costs_replace_estimates_with_a_moving_average() -> None:
    measured = MeasuredCosts(FixedCosts(), alpha=0.3)
    slot = [cpu(0)]
    assert measured.compute_s("ref", slot, False) == 4.0  # not measured: the fallback
    measured.observe("ref", slot, 1.0)
    measured.observe("ref", slot, 2.0)
    # 1.0 + 0.3 * (2.0 - 1.0) = 1.3
    assert measured.compute_s("ref", slot, False) == pytest.approx(1.3)


class FixedMemory(FixedCosts):
    """1 GB of weights per model node (the actor's 3 GB of training state on train), no
    activations; reward and advantage hold no model."""

    MODELS = {"rollout": "actor", "ref": "reference", "train": "actor"}

    def memory(self, node: str, width: int, gpu: bool = False) -> NodeMemory:
        if node not in self.MODELS:
            return NodeMemory(0.0, 0.0, 0.0)
        return NodeMemory(1.0, 3.0 if node == "train" else 0.0, 0.0)

    def work(self, node: str) -> NodeWork:
        return NodeWork("forward", "per_token", self.MODELS.get(node), "policy", "bf16", None, 16, 9, 16)


def test_a_gpu_adds_its_context_a_cublas_workspace_per_thread_and_stream_and_the_compilers_buffer() -> None:
    from flowrl.planner.simulate import device_memory_gb

    pipeline = pipeline_from_dict(grpo({"path": "builtin:tiny-llama"}, {"path": "builtin:tiny-llama"}, {}))
    place = {node: Placement(("gpu-0",)) for node in SECONDS}
    hopper = Device("gpu-0", "node-0", 0, "gpu", "H100-80GB", "hopper", 80.0, l2_cache_mib=50)
    ampere = Device("gpu-0", "node-0", 0, "gpu", "A100-40GB", "ampere", 40.0, l2_cache_mib=40)
    mib = 2**20 / 1e9
    # weights: actor 1 + reference 1, the actor's state 3 = 5 GB; CUDA context 0.5 GB;
    # workspaces (cuBLAS + 1 MiB cuBLASLt) for the compute thread, the update's backward
    # thread and generation's capture stream: Hopper 3 * 33 MiB, Ampere 3 * (8.125 + 1) MiB;
    # while a model's node runs, the compiler's timing buffer, the size of the L2 cache
    assert device_memory_gb(pipeline, place, inventory(hopper), FixedMemory())["gpu-0"] == \
        pytest.approx(5.5 + 3 * 33 * mib + 50 * mib)
    assert device_memory_gb(pipeline, place, inventory(ampere), FixedMemory())["gpu-0"] == \
        pytest.approx(5.5 + 3 * 9.125 * mib + 40 * mib)
    # a card of unknown L2 counts 128 MiB for it
    unknown = Device("gpu-0", "node-0", 0, "gpu", "X-1", "hopper", 80.0)
    assert device_memory_gb(pipeline, place, inventory(unknown), FixedMemory())["gpu-0"] == \
        pytest.approx(5.5 + 3 * 33 * mib + 128 * mib)
    # the reference alone on a second GPU: one thread, one stream
    place["ref"] = Placement(("gpu-1",))
    two = inventory(hopper, Device("gpu-1", "node-0", 1, "gpu", "H100-80GB", "hopper", 80.0, l2_cache_mib=50))
    memory = device_memory_gb(pipeline, place, two, FixedMemory())
    assert memory["gpu-1"] == pytest.approx(1.0 + 0.5 + 33 * mib + 50 * mib)
    assert memory["gpu-0"] == pytest.approx(4.0 + 0.5 + 3 * 33 * mib + 50 * mib)
    # CPU slots: no context, no workspaces
    place = {node: Placement(("cpu-0",)) for node in SECONDS}
    assert device_memory_gb(pipeline, place, inventory(cpu(0)), FixedMemory())["cpu-0"] == pytest.approx(5.0)
