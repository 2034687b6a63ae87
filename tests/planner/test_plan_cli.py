"""``plan_command``: the rendered table and timeline, JSON, and the picture outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from flowrl.cli.plan import plan_command
from flowrl.errors import FlowrlError

ROOT = Path(__file__).resolve().parents[2]
PPO = ROOT / "pipelines" / "ppo.yaml"
MIXED = ROOT / "devices" / "mixed-4gpu.yaml"


def _console() -> Console:
    return Console(record=True, width=200, color_system=None)


def test_tables_timeline_and_svg(tmp_path: Path) -> None:
    console = _console()
    svg = tmp_path / "timeline.svg"
    plan = plan_command(PPO, MIXED, as_json=False, output=svg, console=console)
    text = console.export_text()
    assert "Plan of 'ppo-style'" in text and "Memory per device" in text
    assert "predicted step time:" in text and "critical path: rollout -> " in text
    assert "gpu-3 |" in text  # a Gantt row per device
    picture = svg.read_text()
    assert picture.startswith("<?xml") and "<svg" in picture
    # every task's name is drawn (matplotlib writes text as glyph paths with the text in a comment)
    assert all(f"<!-- {device.label} -->" in picture for device in plan.devices)


def test_png_timeline_is_a_picture(tmp_path: Path) -> None:
    from matplotlib import image

    png = tmp_path / "timeline.png"
    plan_command(PPO, MIXED, as_json=False, output=png, console=_console())
    pixels = image.imread(png)
    assert pixels.shape[0] > 100 and pixels.shape[1] > 500


def test_json_is_the_plan(tmp_path: Path) -> None:
    console = _console()
    plan = plan_command(PPO, MIXED, as_json=True, output=None, console=console)
    data = json.loads(console.export_text())
    assert data == json.loads(json.dumps(plan.to_dict()))
    assert data["nodes"][0]["node"] == "rollout"


def test_unknown_picture_format(tmp_path: Path) -> None:
    with pytest.raises(FlowrlError, match=r"\.svg"):
        plan_command(PPO, MIXED, as_json=False, output=tmp_path / "t.pdf", console=_console())


def test_a_timeline_that_cannot_be_written_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FlowrlError, match=r"there is no folder .*nodir; create it"):
        plan_command(PPO, MIXED, as_json=False, output=tmp_path / "nodir" / "t.svg", console=_console())
    (tmp_path / "t.svg").mkdir()  # a folder where the picture should go
    with pytest.raises(FlowrlError, match=r"cannot write the timeline \(Is a directory\)"):
        plan_command(PPO, MIXED, as_json=False, output=tmp_path / "t.svg", console=_console())


def test_a_plan_for_this_machine_prices_its_cpus_as_a_run_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --devices the CPU slots are measured (``measure_cpu_rates``), as ``flowrl run``
    measures them before its first plan, so the two predict the same step."""
    from flowrl.cli import plan as plan_cli
    from flowrl.devices.inventory import detect_local
    from flowrl.planner.compiled import compile_plan
    from flowrl.planner.cost import CpuRates
    from flowrl.spec.loader import load_pipeline

    rates = CpuRates(flops_per_s=3e10, bandwidth_gbs=20.0)
    monkeypatch.setattr(plan_cli, "measure_cpu_rates", lambda: rates)
    tiny = ROOT / "pipelines" / "grpo_tiny.yaml"
    shown = plan_command(tiny, None, as_json=True, output=None, console=_console())
    graph = load_pipeline(tiny)
    expected = compile_plan(graph, detect_local(num_cpu_slots=graph.spec.runtime.cpu_slots),
                            base_dir=tiny.parent, cpu_rates=rates)
    assert shown.iteration_s == pytest.approx(expected.iteration_s)
    assert shown.iteration_s != pytest.approx(compile_plan(graph, detect_local(num_cpu_slots=2),
                                                           base_dir=tiny.parent).iteration_s)


def test_the_memory_table_names_an_offloaded_model_paged_in_on_its_device() -> None:
    console = _console()
    plan_command(ROOT / "pipelines" / "grpo_0.4b_gpu.yaml", ROOT / "devices" / "h100-1x.yaml", as_json=False,
                 output=None, console=console, overrides=["models.reference.offload_to_cpu=true"])
    rows = [line for line in console.export_text().splitlines() if "gpu-0" in line and " GB " in line and "85.9 GB" in line]
    assert rows and "reference (paged in)" in rows[0], rows


def test_the_next_layout_is_printed_with_its_distance_and_called_close_within_ten_percent() -> None:
    from dataclasses import replace

    from flowrl.cli.plan import alternative_line, print_plan
    from flowrl.planner.compiled import layout_words
    from flowrl.planner.search import Alternative

    plan = plan_command(PPO, MIXED, as_json=False, output=None, console=_console())
    assert layout_words({"ref_group": "actor_group", "critic_group": "actor_group"}) == (
        "critic_group on actor_group's devices, ref_group on actor_group's devices")
    near = replace(plan, iteration_s=0.2, alternative=Alternative({}, 0.21))
    assert alternative_line(near) == ("next layout: every device group on its own devices, 210.00 ms (+5.0%); "
                                      "within 10%: the rates measured at start may choose either")
    faster = replace(near, alternative=Alternative({}, 0.19))
    assert alternative_line(faster) == ("next layout: every device group on its own devices, 190.00 ms (-5.0%); "
                                        "faster, on more CPU slots: the plan takes fewer slots within 10%")
    far = replace(near, alternative=Alternative({"ref_group": "actor_group"}, 0.25))
    assert alternative_line(far) == "next layout: ref_group on actor_group's devices, 250.00 ms (+25.0%)"
    console = _console()
    print_plan(far, console)
    assert "next layout: ref_group on actor_group's devices, 250.00 ms (+25.0%)" in console.export_text()


def test_groups_no_device_satisfies_are_refused_at_their_lines_of_the_file() -> None:
    from flowrl.errors import SpecError

    pipeline = ROOT / "pipelines" / "ppo.yaml"
    with pytest.raises(SpecError) as caught:
        plan_command(pipeline, ROOT / "devices" / "cpu-2core.yaml", as_json=False, output=None, console=_console())
    lines = str(caught.value).splitlines()
    assert lines[0] == "3 problems in the pipeline:"
    assert lines[1].startswith(f"  {pipeline}:10: devices.actor_group: actor_group needs 2 gpus with >= 40 GiB; ")
    assert lines[2].startswith(f"  {pipeline}:11: devices.critic_group: critic_group needs 1 gpu with >= 24 GiB; ")
    assert lines[3].startswith(f"  {pipeline}:12: devices.reward_group: ")
