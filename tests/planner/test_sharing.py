"""Model nodes that may run at once on unpinned CPU slots of one machine divide its cores:
the planner predicts each of them as many times slower as the slots that share it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from flowrl.devices.inventory import Device
from flowrl.planner.costs import NodeMemory
from flowrl.planner.sharing import core_shares
from flowrl.planner.simulate import Placement, simulate
from flowrl.planner.work import NodeWork
from flowrl.scheduler.calibration import DeviceCalibration
from flowrl.records import NodeTiming
from flowrl.spec.loader import load_pipeline

from tests.planner.conftest import cpu, inventory

PPO = Path(__file__).resolve().parents[2] / "pipelines" / "ppo_tiny.yaml"
CRITIC_APART = {"rollout": "cpu-0", "reward": "cpu-0", "ref": "cpu-0", "values": "cpu-1", "adv": "cpu-0",
                "train_actor": "cpu-0", "train_critic": "cpu-1"}


class OneSecond:
    """Every node takes 1 s alone on any slot; nothing worth moving."""

    def compute_s(self, node: str, devices: Sequence[Device], offloaded: bool) -> float:
        return 1.0

    def fixed_s(self, node: str, devices: Sequence[Device], offloaded: bool) -> float:
        return 0.0

    def memory(self, node: str, width: int) -> NodeMemory:
        return NodeMemory(0.0, 0.0, 0.0)

    def output_bytes(self, node: str) -> float:
        return 0.0

    def work(self, node: str) -> NodeWork:
        return NodeWork("forward", "per_token", None, "policy", "fp32", None, 16, 9, 16)


def devices_of(layout: dict[str, str], slots: dict[str, Device]) -> dict[str, list[Device]]:
    return {node: [slots[slot]] for node, slot in layout.items()}


def test_ppo_nodes_beside_each_other_on_two_slots_of_one_machine_share_it() -> None:
    pipeline = load_pipeline(PPO)
    slots = {"cpu-0": cpu(0), "cpu-1": cpu(1)}
    shares = core_shares(pipeline, devices_of(CRITIC_APART, slots))
    # the reward model, the reference and the values all read the rollout side by side: each
    # has the other slot beside it; the two updates likewise; the rollout runs alone and the
    # advantage is light
    assert shares == {"rollout": 1.0, "reward": 2.0, "ref": 2.0, "values": 2.0, "adv": 1.0,
                      "train_actor": 2.0, "train_critic": 2.0}
    # on one slot nothing runs beside anything
    alone = core_shares(pipeline, devices_of({node: "cpu-0" for node in CRITIC_APART}, slots))
    assert set(alone.values()) == {1.0}
    # slots of two machines share nothing, and neither do pinned slots
    apart = {"cpu-0": cpu(0), "cpu-1": cpu(1, host="node-1")}
    assert set(core_shares(pipeline, devices_of(CRITIC_APART, apart)).values()) == {1.0}
    pinned = load_pipeline(PPO, ["runtime.pin_cpus=true"])
    assert set(core_shares(pinned, devices_of(CRITIC_APART, slots)).values()) == {1.0}


def test_a_critic_on_a_slot_of_its_own_is_predicted_no_faster_than_beside_the_actor() -> None:
    pipeline = load_pipeline(PPO)
    machine = inventory(cpu(0), cpu(1))

    def step(layout: dict[str, str]) -> float:
        return simulate(pipeline, {node: Placement((slot,)) for node, slot in layout.items()}, machine,
                        OneSecond()).iteration_s

    # one slot: 7 nodes of 1 s back to back
    assert step({node: "cpu-0" for node in CRITIC_APART}) == pytest.approx(7.0)
    # apart: rollout 1; reward and ref on cpu-0 (2 s each: each call keeps half the cores for
    # values, beside them) while values takes 2 s on cpu-1; adv 1; the updates 2 s each side
    # by side, the critic's after adv's result crossed over (3 ms): 1 + 4 + 1 + 2 + 0.003
    assert step(CRITIC_APART) == pytest.approx(8.003)


def test_a_factor_learned_while_sharing_the_cores_holds_alone() -> None:
    pipeline = load_pipeline(PPO)
    slots = {"cpu-0": cpu(0), "cpu-1": cpu(1)}
    devices = devices_of(CRITIC_APART, slots)
    calibration = DeviceCalibration(OneSecond(), calibration_steps=1)
    # values took 3 s beside the reference (2 shares): the model is 1.5x off for it, not 3x
    step = [NodeTiming("values", "value", "cpu-1", 3.0, 3.0, 0.0, 0, 0)]
    calibration.observe_step([], devices, {})  # warm-up
    calibration.observe_step(step, devices, {}, core_shares(pipeline, devices))
    assert calibration.factor("values") == pytest.approx(1.5)


def test_the_simulator_measures_nodes_slowed_as_its_schedule_is() -> None:
    """The cluster simulator's node timings carry the same core sharing as its step time,
    so a policy that calibrates on them learns the model's error, not the sharing."""
    from types import SimpleNamespace

    from flowrl.simulator.run import _run_step

    pipeline = load_pipeline(PPO)
    items = [SimpleNamespace(node=node, role=pipeline.spec.nodes[node].role, devices=(slot,), offloaded=False)
             for node, slot in CRITIC_APART.items()]
    seen: dict[str, object] = {}

    class Recording:
        plan = SimpleNamespace(nodes=items, iteration_s=0.0, devices=[])

        def observe(self, step: int, timings: list[NodeTiming], samples: object, step_s: float) -> None:
            seen["timings"] = {timing.node: timing.compute_s for timing in timings}
            seen["step_s"] = step_s

    _run_step(pipeline, Recording(), inventory(cpu(0), cpu(1)), OneSecond(), {}, {}, 1, 0.0, 0)  # type: ignore[arg-type]
    assert seen["step_s"] == pytest.approx(8.003)
    assert seen["timings"] == {"rollout": 1.0, "reward": 2.0, "ref": 2.0, "values": 2.0, "adv": 1.0,
                               "train_actor": 2.0, "train_critic": 2.0}


def test_the_share_is_the_cores_over_the_threads_the_runtime_gives() -> None:
    pipeline = load_pipeline(PPO)
    devices = devices_of(CRITIC_APART, {"cpu-0": cpu(0), "cpu-1": cpu(1)})
    # 3 cores, one slot beside: each call gets 3 // 2 = 1 thread, a third of the machine
    assert core_shares(pipeline, devices, {"node-0": 3})["values"] == 3.0
    assert core_shares(pipeline, devices, {"node-0": 16})["values"] == 2.0
    # pin_cpus pins a local cluster's workers only: a joined cluster's still divide the cores
    joined = load_pipeline(PPO, ["runtime.pin_cpus=true", "runtime.scheduler_address=tcp://10.0.0.1:8786"])
    assert core_shares(joined, devices)["values"] == 2.0


def test_calls_of_a_fixed_thread_count_slow_each_other_only_past_the_cores() -> None:
    """runtime.torch_threads: 2 calls of 2 threads on 2 cores take turns (2x); of 1 thread
    each on 2 cores, or 2 threads each on 16 cores, they do not; pinned slots never do."""
    devices = devices_of(CRITIC_APART, {"cpu-0": cpu(0), "cpu-1": cpu(1)})
    two = load_pipeline(PPO, ["runtime.torch_threads=2"])
    assert core_shares(two, devices, {"node-0": 2})["values"] == 2.0
    assert core_shares(two, devices, {"node-0": 3})["values"] == pytest.approx(4 / 3)
    assert core_shares(two, devices, {"node-0": 16})["values"] == 1.0
    assert core_shares(two, devices)["values"] == 1.0  # cores unknown: taken as enough
    one = load_pipeline(PPO, ["runtime.torch_threads=1"])
    assert core_shares(one, devices, {"node-0": 2})["values"] == 1.0
    # 4 threads each on 2 cores: alone a call already has every core (1x), beside one 2x
    four = load_pipeline(PPO, ["runtime.torch_threads=4"])
    assert set(core_shares(four, devices_of({node: "cpu-0" for node in CRITIC_APART},
                                            {"cpu-0": cpu(0)}), {"node-0": 2}).values()) == {1.0}
    assert core_shares(four, devices, {"node-0": 2})["values"] == 2.0
    pinned = load_pipeline(PPO, ["runtime.torch_threads=2", "runtime.pin_cpus=true"])
    assert set(core_shares(pinned, devices, {"node-0": 2}).values()) == {1.0}


class QuarterFixed(OneSecond):
    """Every node takes 1 s alone, a quarter of it overheads that more threads do not shorten."""

    def fixed_s(self, node: str, devices: Sequence[Device], offloaded: bool) -> float:
        return 0.25


def test_sharing_the_cores_slows_only_what_the_threads_do() -> None:
    pipeline = load_pipeline(PPO)
    machine = inventory(cpu(0), cpu(1))
    placement = {node: Placement((slot,)) for node, slot in CRITIC_APART.items()}
    # a node beside another: 0.25 + 0.75 * 2 = 1.75 s; rollout 1, reward and ref 1.75 each on
    # cpu-0 while values takes 1.75 on cpu-1, adv 1, the updates 1.75 side by side, one hop
    assert simulate(pipeline, placement, machine, QuarterFixed()).iteration_s == pytest.approx(
        1 + 3.5 + 1 + 1.75 + 0.003)
    # calibration divides by the same: values took 3 s beside the reference
    calibration = DeviceCalibration(QuarterFixed(), calibration_steps=1)
    devices = devices_of(CRITIC_APART, {"cpu-0": cpu(0), "cpu-1": cpu(1)})
    calibration.observe_step([], devices, {})  # warm-up
    calibration.observe_step([NodeTiming("values", "value", "cpu-1", 3.0, 3.0, 0.0, 0, 0)], devices, {},
                             core_shares(pipeline, devices))
    assert calibration.factor("values") == pytest.approx(3.0 / 1.75)
    # the calibrated source keeps the quarter: 0.25 of 1 s, scaled as the whole
    assert calibration.fixed_s("values", devices["values"], False) == pytest.approx(0.25 * 3.0 / 1.75)
