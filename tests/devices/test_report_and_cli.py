"""Start-up log lines and the ``flowrl devices`` command, rendered to an injected console."""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path

import pytest
from rich.console import Console

from flowrl.cli.devices import devices_command
from flowrl.devices.groups import offload_notes, pipeline_groups
from flowrl.devices.files import load_inventory
from flowrl.devices.matching import match_groups
from flowrl.devices.report import inventory_lines, match_lines
from flowrl.errors import SpecError
from flowrl.spec.loader import load_pipeline

ROOT = Path(__file__).parents[2]
MIXED_FILE = ROOT / "devices" / "mixed-4gpu.yaml"
PPO = ROOT / "pipelines" / "ppo.yaml"


def console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=200, color_system=None), out


def test_start_up_lines_for_the_ppo_pipeline_on_the_mixed_node() -> None:
    inventory = load_inventory(MIXED_FILE)
    spec = load_pipeline(PPO).spec
    match = match_groups(pipeline_groups(spec), inventory)
    assert inventory_lines(inventory) == [
        "Detected 4 GPUs: gpu-0 A100-40GB (40 GiB), gpu-1 A100-40GB (40 GiB), "
        "gpu-2 V100-32GB (32 GiB), gpu-3 H100-80GB (80 GiB); 2 CPU slots (64 cores, 512 GiB)"
    ]
    assert match_lines(match, inventory, offload_notes(spec)) == [
        "actor_group -> [gpu-3 H100-80GB, gpu-0 A100-40GB] "
        "(matched 2/2, memory OK, +0 GiB headroom)",
        "critic_group -> [gpu-1 A100-40GB] (matched 1/1, memory OK, +16 GiB headroom)",
        "reward_group -> [gpu-2 V100-32GB] (matched 1/1, memory OK, +8 GiB headroom)",
        "reference_group -> cpu-0 (cpu, offloaded: reference)",
    ]


def test_models_without_a_group_get_their_own_cpu_group(tmp_path: Path) -> None:
    text = (ROOT / "pipelines" / "grpo_tiny.yaml").read_text()
    text = text.replace("reference: {path: builtin:tiny-llama, device_group: ref_group}",
                        "reference: {path: builtin:tiny-llama}")
    text = text.replace("  ref_group:   {type: cpu}\n", "")
    path = tmp_path / "p.yaml"
    path.write_text(text)
    assert list(pipeline_groups(load_pipeline(path).spec)) == ["actor_group", "auto:reference"]


def test_devices_command_shows_a_file_inventory() -> None:
    term, out = console()
    devices_command(None, ROOT / "devices" / "h200-8x.yaml", False, term)
    text = out.getvalue()
    assert "gpu-7" in text and "H200-141GB" in text and "hopper" in text
    assert "Detected 8 GPUs" in text


def test_devices_command_says_the_plan_may_share_devices_unless_exclusive(tmp_path: Path) -> None:
    term, out = console()
    devices_command(PPO, MIXED_FILE, False, term)
    assert "The plan (flowrl plan) may run a group on another group's devices" in out.getvalue()
    text = PPO.read_text()
    # the GPU groups kept to themselves: the CPU group has no other CPU group to share with
    text = re.sub(r"^(  (actor|critic|reward)_group: +\{)", r"\1exclusive: true, ", text, flags=re.MULTILINE)
    assert text.count("exclusive: true") == 3
    path = tmp_path / "ppo.yaml"
    path.write_text(text)
    term, out = console()
    devices_command(path, MIXED_FILE, False, term)
    assert "another group's devices" not in out.getvalue() and "actor_group" in out.getvalue()


def test_devices_command_matches_a_pipeline_as_json() -> None:
    term, out = console()
    devices_command(PPO, MIXED_FILE, True, term)
    data = json.loads(out.getvalue())
    assert data["match"]["assignment"]["actor_group"] == ["gpu-3", "gpu-0"]
    assert len(data["inventory"]["devices"]) == 6


def test_devices_command_shows_the_match_then_fails_with_exit_code_2(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # this machine, without NVML
    term, out = console()
    with pytest.raises(SpecError) as caught:
        devices_command(PPO, None, False, term)
    assert caught.value.exit_code == 2
    # each group at its line of the file
    lines = str(caught.value).splitlines()
    assert lines[0] == "3 problems in the pipeline:"
    assert lines[1].startswith(f"  {PPO}:10: devices.actor_group: actor_group needs 2 gpus with >= 40 GiB; this "
                               "inventory has no gpus")
    assert [line.split(": ")[0].rsplit(":", 1)[-1] for line in lines[1:]] == ["10", "11", "12"]
    text = out.getvalue()
    assert "unmatched" in text and "reference_group" in text and "cpu-0" in text
