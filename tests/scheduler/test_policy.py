"""The scheduler policies as pure functions of measurements: no cluster, no clock.

The pipeline is a GRPO loop whose actor group has one GPU and whose reward and advantage
nodes are pinned to a CPU slot, so only the actor can move. Node times come from a fixed
table (rollout 1 s, train 1 s, reward and advantage 0 s) and models weigh nothing, so a
move costs exactly ``restart_s`` and every predicted time can be worked out by hand:

    step = rollout + transfer + reward + adv + transfer + train
         = r * 1 s + 3e-3 + 0 + 0 + 3e-3 + r * 1 s      (r: the actor device's measured ratio;
                                                    3e-3: a hop between worker processes)

so with gpu-0 measured twice as slow (r = 2) the current plan predicts 4.006 s, the plan
on the healthy gpu-1 2.006 s: a gain of exactly 2 s per step, 20 s over a 10-step interval.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest

from flowrl.devices.inventory import Device, Host, Inventory
from flowrl.planner.costs import EstimatedCosts, NodeMemory
from flowrl.planner.work import NodeWork
from flowrl.records import DeviceSample, NodeTiming
from flowrl.scheduler import (
    DeviceAdded,
    DeviceLost,
    DeviceReplaced,
    DynamicPolicy,
    PolicySettings,
    StaticPolicy,
)
from flowrl.spec.loader import pipeline_from_dict

TIMES_S = {"rollout": 1.0, "reward": 0.0, "adv": 0.0, "train": 1.0}


def gpu(number: int) -> Device:
    return Device(f"gpu-{number}", "node-0", number, "gpu", "A100-40GB", "ampere", 40.0,
                  family="a100", tflops_bf16=312.0, bandwidth_gbs=1555.0, l2_cache_mib=40.0)


CPU = Device("cpu-0", "node-0", 0, "cpu", "cpu", "cpu", 64.0, family="cpu")


def inventory(*gpus: Device) -> Inventory:
    return Inventory((*gpus, CPU), (Host("node-0", 16, 64.0),), "test")


PIPELINE = pipeline_from_dict({
    "name": "toy",
    "models": {"actor": {"path": "builtin:tiny-llama", "device_group": "actor_group"}},
    "devices": {"actor_group": {"type": "gpu", "count": 1}, "host_group": {"type": "cpu"}},
    "nodes": {
        "rollout": {"role": "generate", "model": "actor", "inputs": ["prompts"]},
        "reward": {"role": "score", "fn": "digits", "inputs": ["rollout"],
                   "device_group": "host_group"},
        "adv": {"role": "advantage", "inputs": ["reward"], "device_group": "host_group"},
        "train": {"role": "update", "model": "actor", "inputs": ["rollout", "adv"]},
    },
    "data": {"source": "builtin:digits", "batch_size": 4},
})


class TableCosts:
    """Fixed node times, weightless models, empty outputs."""

    def __init__(self) -> None:
        self.estimate = EstimatedCosts(PIPELINE)

    def compute_s(self, node: str, devices: Sequence[Device], offloaded: bool) -> float:
        return TIMES_S[node]

    def fixed_s(self, node: str, devices: Sequence[Device], offloaded: bool) -> float:
        return 0.0

    def memory(self, node: str, width: int, gpu: bool = False) -> NodeMemory:
        return NodeMemory(0.0, 0.0, 0.0)

    def output_bytes(self, node: str) -> float:
        return 0.0

    def work(self, node: str) -> NodeWork:
        return self.estimate.work(node)


def policy(restart_s: float, *gpus: Device, **settings: float) -> DynamicPolicy:
    values = {"every_steps": 10, "min_gain": 0.1, "restart_s": restart_s, **settings}
    chosen = PolicySettings(**values)  # type: ignore[arg-type]
    return DynamicPolicy(PIPELINE, inventory(*(gpus or (gpu(0), gpu(1)))), chosen, TableCosts())


def measure(target: DynamicPolicy, ratios: dict[str, float], step: int = 1) -> None:
    """One measured step: every node on device d took ratio(d) x its table time."""
    timings = []
    for item in target.plan.nodes:
        for device in item.devices:
            seconds = TIMES_S[item.node] * ratios.get(device, 1.0)
            timings.append(NodeTiming(item.node, item.role, device, seconds, seconds, 0.0, 0, 0))
    target.observe(step, timings, [], 1.0)


def actor_devices(target: DynamicPolicy) -> list[str]:
    return next(item.devices for item in target.plan.nodes if item.node == "rollout")


def test_first_plan_puts_the_actor_on_gpu_0() -> None:
    target = policy(1.0)
    assert actor_devices(target) == ["gpu-0"]
    # 1 s + 3e-3 (gpu worker -> cpu slot, a process hop) + 0 + 0 + 3e-3 (back) + 1 s
    assert target.plan.iteration_s == pytest.approx(2.006)


def test_a_slow_device_moves_the_actor_when_the_gain_beats_cost_times_one_plus_min_gain() -> None:
    # gain 2 s/step x 10 steps = 20 s; cost 18 s x 1.1 = 19.8 s < 20 s: move
    target = policy(18.0)
    measure(target, {"gpu-0": 2.0})
    [decision] = target.decide(2, [])
    assert decision.accepted and not decision.forced
    assert decision.predicted_before_s == pytest.approx(4.006)
    assert decision.predicted_after_s == pytest.approx(2.006)
    assert decision.gain_s_per_step == pytest.approx(2.0)
    [move] = decision.moves
    assert (move.subject, move.from_devices, move.to_devices) == ("actor", ("gpu-0",), ("gpu-1",))
    assert move.nodes == ("rollout", "train")
    assert move.cost_s == pytest.approx(18.0)  # weightless: the restart only
    assert move.why == "gpu-0 at 50% speed"
    assert "gpu-0 slow" in decision.triggers[0]
    assert actor_devices(target) == ["gpu-1"]


def test_the_first_calls_on_the_devices_a_move_chose_are_warm_up_not_speed() -> None:
    """On a CPU slot the reference's first call after a move took 773 ms against 25 ms after:
    read as speed, the slot the move had chosen looked slow and the actor went back."""
    target = policy(1.0)
    measure(target, {"gpu-0": 2.0})
    [decision] = target.decide(2, [])
    assert decision.accepted and actor_devices(target) == ["gpu-1"]
    measure(target, {"gpu-0": 2.0, "gpu-1": 30.0}, step=2)  # first calls on gpu-1: warm-up
    assert target.calibration.ratio("gpu-1") == 1.0
    assert [d for d in target.decide(3, []) if d.accepted] == []
    measure(target, {"gpu-0": 2.0, "gpu-1": 1.2}, step=3)  # the next ones count
    assert target.calibration.ratio("gpu-1") == pytest.approx(1.2)
    assert actor_devices(target) == ["gpu-1"]


def test_a_slow_device_does_not_move_the_actor_when_the_margin_is_not_met() -> None:
    # cost 18.5 s x 1.1 = 20.35 s > 20 s gain: kept, and recorded as considered
    target = policy(18.5)
    measure(target, {"gpu-0": 2.0})
    [decision] = target.decide(2, [])
    assert not decision.accepted
    assert decision.plan is None
    # the move it weighed is named: the gain (2 s/step x 10) and the cost (18.5 s x 1.1)
    assert decision.reason == ("kept: moving actor gpu-0 -> gpu-1 would gain 20000.0 ms over 10 steps, which does "
                               "not beat move cost 18500.0 ms x 1.1")
    assert actor_devices(target) == ["gpu-0"]


def test_gain_above_cost_but_below_the_margin_is_kept() -> None:
    # cost 19 s < 20 s gain, but 19 x 1.1 = 20.9 s > 20 s: min_gain is what stops it
    target = policy(19.0)
    measure(target, {"gpu-0": 2.0})
    [decision] = target.decide(2, [])
    assert not decision.accepted
    without_margin = policy(19.0, min_gain=0.0)
    measure(without_margin, {"gpu-0": 2.0})
    [decision] = without_margin.decide(2, [])
    assert decision.accepted


def test_wobbling_measurements_do_not_move_work_back_and_forth() -> None:
    # gpu-0 and gpu-1 take turns being 10 % slow; a move would gain at most
    # 0.2 s/step x 10 = 2 s, less than the 5 s x 1.1 it costs: no move in 20 intervals
    target = policy(5.0)
    accepted = []
    for step in range(1, 201):
        slow = "gpu-0" if (step // 10) % 2 == 0 else "gpu-1"
        measure(target, {slow: 1.1}, step)
        accepted += [d for d in target.decide(step + 1, []) if d.accepted]
    assert accepted == []
    assert actor_devices(target) == ["gpu-0"]


def test_no_trigger_no_decision() -> None:
    target = policy(0.0)
    measure(target, {})
    assert target.decide(2, []) == []  # not slow, not a re-plan step, no event


def test_a_lost_device_forces_a_replan_onto_the_remaining_devices() -> None:
    target = policy(1000.0)  # a forced re-plan is accepted whatever it costs
    [decision] = target.decide(5, [DeviceLost("gpu-0")])
    assert decision.accepted and decision.forced
    assert decision.predicted_before_s == float("inf")
    assert actor_devices(target) == ["gpu-1"]
    assert decision.moves[0].why == "gpu-0 lost"
    assert all("gpu-0" not in item.devices for item in target.plan.nodes)


def test_losing_the_only_gpu_is_reported_and_not_accepted() -> None:
    target = policy(1.0, gpu(0))
    [decision] = target.decide(5, [DeviceLost("gpu-0")])
    assert decision.forced and not decision.accepted
    assert "no placement fits" in decision.reason


def test_an_added_device_is_matched_when_moving_there_pays() -> None:
    target = policy(1.0, gpu(0))
    measure(target, {"gpu-0": 2.0})
    [decision] = target.decide(2, [DeviceAdded(gpu(1))])
    assert decision.accepted
    assert decision.moves[0].to_devices == ("gpu-1",)
    assert actor_devices(target) == ["gpu-1"]


def test_a_slot_taken_on_another_machine_takes_that_machine_and_forgets_the_old_speed() -> None:
    """gpu-0 measured twice as slow; its slot taken by a worker on node-1 (8 cores): the
    inventory has gpu-0 on node-1 and that host, the measured ratio is forgotten, and the
    actor stays with no record (gpu-0 and gpu-1 predicted equal: nothing to gain)."""
    target = policy(1.0)
    measure(target, {"gpu-0": 2.0})
    assert target.calibration.ratios["gpu-0"] == pytest.approx(2.0)
    moved = Device("gpu-0", "node-1", 0, "gpu", "A100-40GB", "ampere", 40.0, family="a100",
                   tflops_bf16=312.0, bandwidth_gbs=1555.0, l2_cache_mib=40.0)
    assert target.decide(2, [DeviceReplaced(moved, Host("node-1", 8, 32.0))]) == []
    assert actor_devices(target) == ["gpu-0"]
    assert target.inventory.by_id("gpu-0") == moved
    assert {host.name: host.cores for host in target.inventory.hosts} == {"node-0": 16, "node-1": 8}
    assert "gpu-0" not in target.calibration.ratios
    # the same machine again changes nothing: a ratio learned since stays
    measure(target, {"gpu-0": 1.0}, step=3)
    assert target.decide(4, [DeviceReplaced(moved, Host("node-1", 8, 32.0))]) == []
    assert target.calibration.ratios["gpu-0"] == pytest.approx(1.0)


def test_a_replacement_with_other_cores_on_a_host_of_that_name_counts_and_a_lost_device_is_ignored() -> None:
    target = policy(1.0)
    measure(target, {"gpu-1": 1.0})
    same_name = Host("node-0", 4, 64.0)  # another machine answering to the same name
    target.decide(2, [DeviceReplaced(gpu(1), same_name)])
    assert "gpu-1" not in target.calibration.ratios
    assert {host.name: host.cores for host in target.inventory.hosts} == {"node-0": 4}
    target.decide(3, [DeviceLost("gpu-1")])
    hosts = target.inventory.hosts
    # gpu-1 is gone: a replacement queued for it before is nothing new
    assert target.decide(4, [DeviceReplaced(gpu(1), Host("node-9", 8, 32.0))]) == []
    assert target.inventory.by_id("gpu-1") is None and target.inventory.hosts == hosts


def full_memory(target: DynamicPolicy, device: str, step: int) -> None:
    """One step whose sample puts ``device`` at 39 of its 40 GB (above ``high_memory``)."""
    target.observe(step, [], [DeviceSample(device, "gpu", 1.0, 39.0, 40.0)], 1.0)


def test_a_lost_device_that_comes_back_starts_with_no_condition_marked() -> None:
    """gpu-0 marked at high memory, then lost, added again and given the actor back: its high
    memory is a new condition and triggers again (a mark kept from before the loss would hide
    it). The trigger shows in the next decision, here the forced one when gpu-0 is lost again."""
    target = policy(1.0)
    full_memory(target, "gpu-0", 1)
    assert target.decide(2, []) == []  # raised, but nothing better to move to
    target.decide(3, [DeviceLost("gpu-0")])
    target.decide(4, [DeviceAdded(gpu(0))])
    target.decide(5, [DeviceLost("gpu-1")])
    assert actor_devices(target) == ["gpu-0"]
    full_memory(target, "gpu-0", 6)
    [decision] = target.decide(7, [DeviceLost("gpu-0")])
    assert decision.triggers == ("gpu-0 memory at 98%", "gpu-0 lost")


def test_a_card_replaced_on_another_machine_leaves_its_old_neighbours_nvlink_peers() -> None:
    linked = [replace(gpu(n), nvlink_peers=tuple(f"gpu-{p}" for p in range(3) if p != n)) for n in range(3)]
    target = policy(1.0, *linked)
    elsewhere = replace(linked[0], host="node-1", nvlink_peers=())
    target.decide(2, [DeviceReplaced(elsewhere, Host("node-1", 8, 32.0))])
    peers = {d.id: d.nvlink_peers for d in target.inventory.devices if d.kind == "gpu"}
    assert peers == {"gpu-0": (), "gpu-1": ("gpu-2",), "gpu-2": ("gpu-1",)}
    # a peer lost and added back is linked again
    target.decide(3, [DeviceLost("gpu-2")])
    target.decide(4, [DeviceAdded(linked[2])])
    peers = {d.id: d.nvlink_peers for d in target.inventory.devices if d.kind == "gpu"}
    assert peers == {"gpu-0": (), "gpu-1": ("gpu-2",), "gpu-2": ("gpu-1",)}


def test_a_resumed_run_keeps_a_learned_speed_only_for_a_device_on_the_same_machine() -> None:
    target = policy(1.0)
    measure(target, {"gpu-0": 2.0})  # the actor's device: the one measured
    saved = target.state_dict()
    again = policy(1.0)
    again.load_state_dict(saved)
    assert again.calibration.ratios == pytest.approx({"gpu-0": 2.0})
    elsewhere = Device("gpu-0", "node-1", 0, "gpu", "A100-40GB", "ampere", 40.0, family="a100",
                       tflops_bf16=312.0, bandwidth_gbs=1555.0, l2_cache_mib=40.0)
    moved = policy(1.0, elsewhere, gpu(1))
    moved.load_state_dict(saved)
    assert "gpu-0" not in moved.calibration.ratios
    # a checkpoint from before machines were kept: every ratio as saved
    older = policy(1.0, elsewhere, gpu(1))
    older.load_state_dict({key: value for key, value in saved.items() if key != "machines"})
    assert older.calibration.ratios["gpu-0"] == pytest.approx(2.0)


def test_static_policy_never_replans() -> None:
    target = StaticPolicy(PIPELINE, inventory(gpu(0), gpu(1)), TableCosts())
    assert target.decide(5, [DeviceLost("gpu-0")]) == []
    assert next(i.devices for i in target.plan.nodes if i.node == "rollout") == ["gpu-0"]


def test_decisions_are_a_pure_function_of_the_inputs() -> None:
    def run() -> list[dict[str, object]]:
        target = policy(1.0)
        out = []
        for step, ratios in enumerate([{}, {"gpu-0": 1.6}, {"gpu-0": 2.2}, {"gpu-1": 1.3}], 1):
            measure(target, ratios, step)
            out += [d.to_dict() for d in target.decide(step + 1, [])]
        out += [d.to_dict() for d in target.decide(9, [DeviceLost("gpu-1")])]
        return out

    first = run()
    assert first and first == run()
