"""Scenario files: every problem at once, each with its file and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.devices.files import load_inventory
from flowrl.simulator.scenario import resolve_scenario
from flowrl.spec.scenario_file import ScenarioFileError, load_scenario_file

ROOT = Path(__file__).resolve().parents[2]

BAD = """\
name: bad
noise: -1
sed: 3
events:
  - {step: 0, kind: throttle, device: gpu-1, speed: 0.5}
  - {step: 5, kind: lots, device: gpu-1}
  - {step: 5, kind: lost, device: gpu-1, speed: 2}
  - {step: 5, kind: added}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "scenario.yaml"
    path.write_text(text)
    return path


def test_every_problem_is_reported_with_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, BAD)
    with pytest.raises(ScenarioFileError) as caught:
        load_scenario_file(path)
    lines = str(caught.value).splitlines()
    assert lines[0] == "6 problems in the scenario:"
    assert lines[1:] == [
        f"  {path}:2: noise: out of range: allowed noise >= 0.0, found -1",
        f"  {path}:3: sed: unknown field 'sed' (did you mean 'seed'?)",
        f"  {path}:5: events.0.step: out of range: allowed step >= 1, found 0",
        f"  {path}:6: events.1.kind: unknown event kind 'lots' (did you mean 'lost'?); "
        "known kinds: throttle, lost, added",
        f"  {path}:7: events.2.speed: unknown field 'speed'; allowed: kind, step, device",
        f"  {path}:8: events.3.type: required field 'type' is missing",
    ]


def test_yaml_syntax_error_has_a_line(tmp_path: Path) -> None:
    path = write(tmp_path, "name: x\nevents: [\n")
    with pytest.raises(ScenarioFileError, match=rf"{path}:3: YAML syntax error"):
        load_scenario_file(path)


def test_missing_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(ScenarioFileError, match="no such file"):
        load_scenario_file(tmp_path / "none.yaml")


def test_devices_and_gpu_types_are_checked_against_the_inventory(tmp_path: Path) -> None:
    path = write(tmp_path, """\
name: x
events:
  - {step: 3, kind: lost, device: gpu-2}
  - {step: 5, kind: throttle, device: gpu-2, speed: 0.5}
  - {step: 6, kind: added, type: H100-80G}
  - {step: 7, kind: lost, device: gpu-9}
""")
    inventory = load_inventory(ROOT / "devices" / "mixed-4gpu.yaml")
    with pytest.raises(ScenarioFileError) as caught:
        resolve_scenario(load_scenario_file(path), inventory)
    text = str(caught.value)
    # gpu-2 is gone from step 3, so throttling it at step 5 is a mistake
    assert f"{path}:4: events.1.device: no device 'gpu-2'" in text and "at step 5" in text
    assert f"{path}:5: events.2.type: unknown GPU type 'H100-80G' (did you mean 'H100-80GB'?)" in text
    assert f"{path}:6: events.3.device: no device 'gpu-9'" in text


def test_an_added_gpu_gets_the_next_id(tmp_path: Path) -> None:
    path = write(tmp_path, "name: x\nevents:\n  - {step: 2, kind: added, type: H100-80GB}\n"
                 "  - {step: 4, kind: throttle, device: gpu-4, speed: 0.5}\n")
    inventory = load_inventory(ROOT / "devices" / "mixed-4gpu.yaml")
    scenario = resolve_scenario(load_scenario_file(path), inventory)
    added, throttled = scenario.events
    assert (added.device.id, added.device.host, added.device.memory_gb) == ("gpu-4", "node-0", 80)
    assert throttled.device.id == "gpu-4" and throttled.speed == 0.5
