"""Per-node calibration, per-device speed and idle devices: numbers worked out by hand.

The base model predicts rollout 1 s and train 1 s on any device. On the "real" machine the
rollout takes 0.3 s and the train 0.9 s: the model is off per node, not per device.
"""

from __future__ import annotations

import pytest

from flowrl.records import NodeTiming
from flowrl.scheduler import DynamicPolicy, PolicySettings
from flowrl.scheduler.calibration import DeviceCalibration
from tests.scheduler.test_policy import PIPELINE, TIMES_S, TableCosts, gpu, inventory, policy

REAL_S = {"rollout": 0.3, "reward": 0.0, "adv": 0.0, "train": 0.9}


def timings(node_devices: dict[str, str], slowdown: dict[str, float]) -> list[NodeTiming]:
    out = []
    for node, device in node_devices.items():
        seconds = REAL_S[node] * slowdown.get(device, 1.0)
        out.append(NodeTiming(node, "x", device, seconds, seconds, 0.0, 0, 0))
    return out


ACTOR_ON_0 = {"rollout": "gpu-0", "train": "gpu-0"}
DEVICES = {"rollout": [gpu(0)], "train": [gpu(0)]}


def calibrated(steps: int = 2) -> DeviceCalibration:
    calibration = DeviceCalibration(TableCosts(), alpha=0.5, calibration_steps=steps)
    # warm-up step: whatever it measures (here 10x) is ignored
    calibration.observe_step(timings(ACTOR_ON_0, {"gpu-0": 10.0}), DEVICES, {})
    calibration.observe_step(timings(ACTOR_ON_0, {}), DEVICES, {})
    calibration.observe_step(timings(ACTOR_ON_0, {"gpu-0": 1.2}), DEVICES, {})
    return calibration


def test_calibration_steps_learn_a_factor_per_node_and_leave_device_speeds_alone() -> None:
    calibration = calibrated()
    # median (of two: the mean) of 0.3 and 0.36 over a predicted 1 s; of 0.9 and 1.08
    assert calibration.node_factors == {"rollout": pytest.approx(0.33), "train": pytest.approx(0.99)}
    assert calibration.ratios == {}
    assert not calibration.calibrating
    assert calibration.compute_s("rollout", [gpu(1)], False) == pytest.approx(0.33)


def test_after_calibration_a_device_starts_at_nominal_speed_and_moves_by_alpha() -> None:
    calibration = calibrated()
    # twice as slow: measured 0.6 + 1.8 = 2.4 s against 0.33 + 0.99 = 1.32 s calibrated
    calibration.observe_step(timings(ACTOR_ON_0, {"gpu-0": 2.0}), DEVICES, {})
    now = 2.4 / 1.32
    assert calibration.ratio("gpu-0") == pytest.approx(1.0 + 0.5 * (now - 1.0))
    # the node's time on the slow device: base 1 s x factor 0.33 x ratio
    assert calibration.compute_s("rollout", [gpu(0)], False) == pytest.approx(0.33 * calibration.ratio("gpu-0"))
    assert calibration.compute_s("rollout", [gpu(1)], False) == pytest.approx(0.33)


def test_an_idle_device_drifts_towards_what_its_external_load_predicts() -> None:
    calibration = calibrated()
    calibration.ratios["gpu-0"] = 2.0
    calibration.observe_idle("gpu-0", 1.0)  # the other process is gone
    assert calibration.ratio("gpu-0") == pytest.approx(1.5)
    calibration.observe_idle("gpu-1", 1.8)  # never measured: starts from nominal
    assert calibration.ratio("gpu-1") == pytest.approx(1.4)


def test_without_calibration_the_first_measurement_is_taken_as_it_is() -> None:
    calibration = DeviceCalibration(TableCosts(), alpha=0.5)
    calibration.observe_step(timings(ACTOR_ON_0, {}), DEVICES, {})
    assert calibration.ratio("gpu-0") == pytest.approx((0.3 + 0.9) / 2.0)
    assert calibration.node_factors == {}


def run_policy(slowdown_from_step_4: dict[str, float], steps: int = 12) -> DynamicPolicy:
    settings = PolicySettings(every_steps=5, min_gain=0.1, restart_s=0.1, alpha=0.5, calibration_steps=2)
    target = DynamicPolicy(PIPELINE, inventory(gpu(0), gpu(1)), settings, TableCosts())
    for step in range(1, steps + 1):
        target.decide(step, [])
        placed = {item.node: item.devices[0] for item in target.plan.nodes if item.node in REAL_S and TIMES_S[item.node]}
        target.observe(step, timings(placed, slowdown_from_step_4 if step >= 4 else {}), [], 1.0)
    return target


def test_per_node_model_errors_alone_move_nothing() -> None:
    target = run_policy({})
    assert next(item.devices for item in target.plan.nodes if item.node == "rollout") == ["gpu-0"]


def test_a_device_that_slows_after_calibration_loses_the_actor() -> None:
    target = run_policy({"gpu-0": 2.0})
    assert next(item.devices for item in target.plan.nodes if item.node == "rollout") == ["gpu-1"]


def test_one_disturbed_calibration_step_does_not_set_the_baseline() -> None:
    calibration = DeviceCalibration(TableCosts(), alpha=0.5, calibration_steps=3)
    for slowdown in (10.0, 1.0, 3.0, 1.0):  # warm-up, then one step 3x slower
        calibration.observe_step(timings(ACTOR_ON_0, {"gpu-0": slowdown}), DEVICES, {})
    assert calibration.node_factors == {"rollout": pytest.approx(0.3), "train": pytest.approx(0.9)}


def test_what_was_learned_survives_a_trip_through_a_checkpoint_file() -> None:
    import json

    calibration = calibrated()
    calibration.observe_step(timings(ACTOR_ON_0, {"gpu-0": 2.0}), DEVICES, {})
    saved = json.loads(json.dumps(calibration.state_dict()))  # as trainer_state.json holds it
    restored = DeviceCalibration(TableCosts(), alpha=0.5, calibration_steps=2)
    assert restored.calibrating
    restored.load_state_dict(saved)
    assert not restored.calibrating
    assert restored.ratios == pytest.approx(calibration.ratios) and restored.ratio("gpu-0") > 1.0
    assert restored.node_factors == pytest.approx(calibration.node_factors)
    # the next measurement moves both alike
    for item in (calibration, restored):
        item.observe_step(timings(ACTOR_ON_0, {"gpu-0": 3.0}), DEVICES, {})
    assert restored.ratio("gpu-0") == pytest.approx(calibration.ratio("gpu-0"))


def test_gpu_calls_that_held_more_than_predicted_raise_that_node_memory() -> None:
    from flowrl.planner.simulate import Placement, device_memory_gb, node_call_memory_gb

    # TableCosts predicts no memory for any node, so the prediction of a GPU call is the cuBLAS
    # workspaces on its device, rollout (generates) and train (trains) on the A100 gpu-0 keep
    # three, compute thread, backward thread and capture stream, of 8.125 + 1 MiB each; and
    # the compiler's timing buffer, the A100's 40 MiB of L2
    place = {"rollout": Placement(("gpu-0",)), "train": Placement(("gpu-0",)),
             "reward": Placement(("cpu-0",)), "adv": Placement(("cpu-0",))}
    devices = inventory(gpu(0))
    predicted = node_call_memory_gb(PIPELINE, place, devices, TableCosts())
    baseline = (3 * 9.125 + 40) * 2**20 / 1e9
    assert predicted[("rollout", "gpu-0")] == predicted[("train", "gpu-0")] == pytest.approx(baseline)
    assert predicted[("reward", "cpu-0")] == 0.0

    def call(node: str, device: str, peak_gb: float) -> NodeTiming:
        return NodeTiming(node, "x", device, 1.0, 1.0, 0.0, 0, 0, peak_memory_gb=peak_gb)

    calibration = DeviceCalibration(TableCosts())
    calibration.observe_memory([call("rollout", "gpu-0", 2.0), call("train", "gpu-0", 0.02),
                                call("reward", "cpu-0", 0.0)], predicted)
    calibration.observe_memory([call("rollout", "gpu-0", 1.5)], predicted)  # the largest stays
    # train held less than predicted (0.02 < 0.0706 GB): nothing learned for it
    assert calibration.memory_excess_gb == {"rollout": pytest.approx(2.0 - baseline)}
    assert calibration.memory("rollout", 1, gpu=True).transient_gb == pytest.approx(2.0 - baseline)
    assert calibration.memory("rollout", 1, gpu=False).transient_gb == 0.0
    assert calibration.memory("train", 1, gpu=True).transient_gb == 0.0
    # a re-plan's memory prediction (the policy searches with the calibration) now holds the
    # measured 2.0 GB on gpu-0, plus the 0.5 GB CUDA context the allocator never sees
    assert device_memory_gb(PIPELINE, place, devices, calibration)["gpu-0"] == pytest.approx(2.5)
    # and it is kept with the rest of what was learned (a checkpoint's trainer_state.json)
    import json

    restored = DeviceCalibration(TableCosts())
    restored.load_state_dict(json.loads(json.dumps(calibration.state_dict())))
    assert restored.memory_excess_gb == pytest.approx(calibration.memory_excess_gb)


def test_the_policy_learns_gpu_memory_from_the_calls_it_observes() -> None:
    target = policy(0.0, gpu(0))
    [rollout] = [item for item in target.plan.nodes if item.node == "rollout"]
    timings = [NodeTiming("rollout", "x", rollout.devices[0], 1.0, 1.0, 0.0, 0, 0, peak_memory_gb=30.0)]
    target.observe(1, timings, [], 2.0)
    assert target.calibration.memory_excess_gb["rollout"] == pytest.approx(30.0 - (3 * 9.125 + 40) * 2**20 / 1e9)


def test_contention_slowdown_from_utilisation_and_external_load() -> None:
    from flowrl.scheduler.calibration import contention_slowdown

    assert contention_slowdown(0.0, 0.0) == 1.0
    assert contention_slowdown(0.0, 0.3) == pytest.approx(1.3)  # idle: the others' load as it is
    # a busy loop beside a worker that computes all the time: each gets half the core
    assert contention_slowdown(0.5, 0.5) == pytest.approx(2.0)
    # the worker got the core for 0.3 of the step (it wanted it 0.3 x 1.5 = 0.45): e = D (1 - u D)
    # with D = 0.5 is 0.425
    assert contention_slowdown(0.3, 0.425) == pytest.approx(1.5)
    assert contention_slowdown(1.0, 0.0) == 1.0
    assert contention_slowdown(0.6, 0.6) == 2.0  # noisy, u + e > 1: a whole core wanted, at most


def test_calibration_takes_the_load_of_other_processes_out_of_the_node_factors() -> None:
    calibration = DeviceCalibration(TableCosts(), alpha=0.5, calibration_steps=2)
    loaded = {"gpu-0": 2.0}  # another process halves the device from the start
    calibration.observe_step(timings(ACTOR_ON_0, {"gpu-0": 10.0}), DEVICES, {})  # warm-up
    for _ in range(2):
        calibration.observe_step(timings(ACTOR_ON_0, loaded), DEVICES, {}, contention=loaded)
    assert calibration.node_factors == {"rollout": pytest.approx(0.3), "train": pytest.approx(0.9)}
    # after calibration the load is the device's: measured 0.6 + 1.8 s against 0.3 + 0.9
    calibration.observe_step(timings(ACTOR_ON_0, loaded), DEVICES, {}, contention=loaded)
    assert calibration.ratio("gpu-0") == pytest.approx(1.0 + 0.5 * (2.0 - 1.0))


def test_a_slot_busy_with_another_process_from_the_start_loses_the_actor() -> None:
    """A busy loop on cpu-0's core before the run: learned as the nodes' own slowness, the
    move off it was predicted to gain 22 %/step where it gained 1.9x."""
    from flowrl.records import DeviceSample
    from flowrl.spec.loader import pipeline_from_dict

    pinned = pipeline_from_dict({**PIPELINE.to_dict(), "runtime": {"pin_cpus": True}})
    settings = PolicySettings(every_steps=5, min_gain=0.1, restart_s=0.1, alpha=0.5, calibration_steps=2)
    target = DynamicPolicy(pinned, inventory(gpu(0), gpu(1)), settings, TableCosts())
    busy = [DeviceSample("gpu-0", "cpu", 0.5, 1.0, external_load=0.5),
            DeviceSample("gpu-1", "cpu", 0.0, 1.0, external_load=0.0)]
    moves = []
    for step in range(1, 13):
        moves += [decision for decision in target.decide(step, []) if decision.accepted]
        placed = {item.node: item.devices[0] for item in target.plan.nodes if item.node in REAL_S and TIMES_S[item.node]}
        target.observe(step, timings(placed, {"gpu-0": 2.0}), busy, 1.0)
    assert next(item.devices for item in target.plan.nodes if item.node == "rollout") == ["gpu-1"]
    # at the first re-plan after calibration (steps 2-3), gpu-0's ratio is 1 + 0.5 (2 - 1) = 1.5
    # after one step: 1.8 s of rollout and train there against 1.2 s on gpu-1, a third less
    [move] = moves
    assert move.step == 5 and move.gain_share == pytest.approx(1 / 3, abs=0.01)


def test_the_calibrated_prediction_keeps_other_processes_load_on_the_devices() -> None:
    """Taken out of the per-node factors, the load must be put on the devices: else the plan
    file's calibrated prediction misses a loaded slot's times by the load."""
    from flowrl.records import DeviceSample, StepRecord
    from flowrl.scheduler.calibration import calibrated_prediction
    from flowrl.spec.loader import pipeline_from_dict

    pinned = pipeline_from_dict({**PIPELINE.to_dict(), "runtime": {"pin_cpus": True}})
    devices = inventory(gpu(0), gpu(1))
    plan = DynamicPolicy(pinned, devices, PolicySettings(), TableCosts()).plan
    placed = {item.node: item.devices[0] for item in plan.nodes if item.node in REAL_S and TIMES_S[item.node]}
    busy = [DeviceSample("gpu-0", "cpu", 0.5, 1.0, external_load=0.5)]  # twice as long
    records = [StepRecord(step, 9, {"timing_s/step": 2.4}, timings(placed, {"gpu-0": 2.0}), busy)
               for step in range(1, 10)]
    calibrated = calibrated_prediction(pinned, plan, devices, TableCosts(), records)
    assert calibrated is not None
    assert calibrated["node_factors"] == {"rollout": pytest.approx(0.3), "train": pytest.approx(0.9)}
    nodes = calibrated["nodes"]
    assert isinstance(nodes, dict)
    assert nodes["rollout"]["predicted_s"] == pytest.approx(0.6) and nodes["rollout"]["measured_s"] == 0.6
    assert nodes["train"]["predicted_s"] == pytest.approx(1.8) and nodes["train"]["measured_s"] == 1.8
