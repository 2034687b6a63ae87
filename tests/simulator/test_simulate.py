"""The simulator on the shipped pipeline, inventory and scenarios (no cluster, no clock)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from flowrl.cli.simulate import simulate_command
from flowrl.devices.files import load_inventory
from flowrl.errors import FlowrlError
from flowrl.simulator.run import compare_policies
from flowrl.simulator.scenario import SHIPPED_DIR, load_scenario
from flowrl.spec.loader import load_pipeline

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = ROOT / "pipelines" / "ppo.yaml"
DEVICES = ROOT / "devices" / "mixed-4gpu.yaml"


@pytest.fixture(scope="module")
def setup():  # type: ignore[no-untyped-def]
    return load_pipeline(PIPELINE), load_inventory(DEVICES)


def test_every_shipped_scenario_resolves_on_the_mixed_inventory(setup) -> None:  # type: ignore[no-untyped-def]
    _, inventory = setup
    names = sorted(path.stem for path in SHIPPED_DIR.glob("*.yaml"))
    assert names == ["device_added", "device_lost", "steady", "throttle", "unbalanced"]
    for name in names:
        assert load_scenario(name, inventory).name == name


def test_unbalanced_from_the_start_dynamic_finds_the_slow_card_and_leaves_it(setup) -> None:  # type: ignore[no-untyped-def]
    pipeline, inventory = setup
    scenario = load_scenario("unbalanced", inventory)
    results = compare_policies(pipeline, inventory, scenario, ["static", "dynamic"], 60)
    slow = scenario.events[0].device.id
    assert slow in {d for item in results["static"].last_plan.nodes for d in item.devices}
    assert slow not in {d for item in results["dynamic"].last_plan.nodes for d in item.devices}
    assert results["dynamic"].mean_step_s_from(20) < results["static"].mean_step_s_from(20)


def test_throttle_dynamic_is_faster_than_static_after_the_throttle(setup) -> None:  # type: ignore[no-untyped-def]
    pipeline, inventory = setup
    scenario = load_scenario("throttle", inventory)
    throttle_step = scenario.events[0].step
    results = compare_policies(pipeline, inventory, scenario, ["static", "dynamic"], 120)
    static, dynamic = results["static"], results["dynamic"]
    assert dynamic.mean_step_s_from(throttle_step) < static.mean_step_s_from(throttle_step)
    assert static.summary.num_moves == 0 and dynamic.summary.num_moves >= 1
    moved = [m for d in dynamic.decisions if d.accepted for m in d.moves]
    assert any("gpu-3" in m.from_devices and "speed" in m.why for m in moved)
    # before the throttle both run the same plan on the same noise: identical steps
    assert [r.step_s for r in static.steps[: throttle_step - 1]] == [
        r.step_s for r in dynamic.steps[: throttle_step - 1]
    ]


def test_device_lost_fails_static_steps_but_not_dynamic_ones(setup) -> None:  # type: ignore[no-untyped-def]
    pipeline, inventory = setup
    scenario = load_scenario("device_lost", inventory)
    lost_step = scenario.events[0].step
    results = compare_policies(pipeline, inventory, scenario, ["static", "dynamic"], 80)
    assert results["static"].summary.num_failures == 80 - lost_step + 1
    assert results["dynamic"].summary.num_failures == 0
    [forced] = [d for d in results["dynamic"].decisions if d.forced]
    assert forced.accepted and forced.step == lost_step


def test_steady_dynamic_loses_nothing(setup) -> None:  # type: ignore[no-untyped-def]
    pipeline, inventory = setup
    scenario = load_scenario("steady", inventory)
    results = compare_policies(pipeline, inventory, scenario, ["static", "dynamic"], 60)
    assert results["dynamic"].summary.num_moves == 0
    assert results["dynamic"].summary.mean_step_s == results["static"].summary.mean_step_s


def test_same_seed_same_output_other_seed_other_noise(setup) -> None:  # type: ignore[no-untyped-def]
    pipeline, inventory = setup
    scenario = load_scenario("throttle", inventory)

    def run(seed: int) -> str:
        results = compare_policies(pipeline, inventory, scenario, ["static", "dynamic"], 70, seed)
        return json.dumps({name: r.to_dict() for name, r in results.items()}, sort_keys=True)

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_simulate_command_prints_the_comparison_and_decisions() -> None:
    console = Console(record=True, width=200)
    simulate_command(PIPELINE, DEVICES, 80, "throttle", "both", None, False, console)
    text = console.export_text()
    assert "Policies compared" in text
    assert "dynamic / static throughput:" in text
    assert "moving actor: gpu-3, gpu-0 -> " in text
    assert "gpu-3 at " in text and "% speed" in text and "move cost" in text


def test_simulate_command_json_is_valid_json() -> None:
    console = Console(record=True, width=200)
    simulate_command(PIPELINE, DEVICES, 60, "device_lost", "both", 1, True, console)
    data = json.loads(console.export_text())
    assert data["seed"] == 1
    assert data["policies"]["static"]["summary"]["num_failures"] == 11


def test_without_an_inventory_file_this_machine_is_simulated() -> None:
    console = Console(record=True, width=200)
    simulate_command(ROOT / "pipelines" / "grpo_tiny.yaml", None, 10, None, "static", 0, True, console)
    data = json.loads(console.export_text())
    assert data["devices"] == "this machine" and data["policies"]["static"]["summary"]["num_failures"] == 0


def test_unknown_scenario_is_a_user_error_naming_the_known_ones() -> None:
    with pytest.raises(FlowrlError, match=r"did you mean 'throttle'\?.*steady"):
        simulate_command(PIPELINE, DEVICES, 10, "throtle", "both", None, False, Console())


def test_unknown_policy_is_a_user_error() -> None:
    with pytest.raises(FlowrlError, match="--policy"):
        simulate_command(PIPELINE, DEVICES, 10, None, "greedy", None, False, Console())


def test_simulate_command_takes_overrides_as_plan_and_run_do() -> None:
    console = Console(record=True, width=200)
    plain = simulate_command(PIPELINE, DEVICES, 5, None, "static", 0, True, console)["static"]
    console = Console(record=True, width=200)
    bigger = simulate_command(PIPELINE, DEVICES, 5, None, "static", 0, True, console, ["data.batch_size=256"])["static"]
    data = json.loads(console.export_text())
    assert data["pipeline"] == "ppo-style"
    # four times the prompts of the file (64): every step costs more
    assert bigger.summary.mean_step_s > plain.summary.mean_step_s


def test_a_forced_re_plan_that_finds_no_placement_is_not_counted_as_carried_out() -> None:
    # the reward group pinned to the V100 that is lost: no re-plan can place it elsewhere
    console = Console(record=True, width=200)
    simulate_command(PIPELINE, DEVICES, 60, "device_lost", "dynamic", 0, False, console,
                     ["devices.reward_group.device_ids=[2]"])
    text = console.export_text()
    assert "decisions (dynamic): 0 re-plans carried out, 2 found no placement on the devices left, 0 considered" in text


def test_a_scenario_for_another_cluster_on_this_machine_names_the_inventory_to_give() -> None:
    from flowrl.errors import FlowrlError

    with pytest.raises(FlowrlError, match=r"no device 'gpu-3' in local(.|\n)*the built-in scenarios: --devices "
                                          r".*/devices/mixed-4gpu.yaml\)"):
        simulate_command(PIPELINE, None, 5, "throttle", "both", None, False, Console(record=True, width=200))



def test_another_problem_of_a_scenario_is_not_put_down_to_the_devices(tmp_path: Path) -> None:
    from flowrl.errors import SpecError

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nnoise: -1\n")
    with pytest.raises(SpecError) as caught:
        simulate_command(PIPELINE, None, 5, str(bad), "both", None, False, Console(record=True, width=200))
    assert "noise" in str(caught.value) and "the scenario names devices" not in str(caught.value)
