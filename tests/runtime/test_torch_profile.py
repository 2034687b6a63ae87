"""trainer.torch_profile: the named steps' node calls run under torch.profiler, write a trace
and a table each, and their times are left out of the plan's measurements."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flowrl.api.run import run
from flowrl.spec.loader import load_pipeline

PIPELINE = Path(__file__).resolve().parents[2] / "pipelines" / "grpo_tiny.yaml"


def test_a_profiled_step_writes_each_nodes_trace_and_table_and_is_not_a_measurement(tmp_path: Path) -> None:
    output = tmp_path / "out"
    graph = load_pipeline(PIPELINE, ["trainer.steps=6", "trainer.torch_profile=[3]"])
    run(graph, output_dir=output)

    folder = output / "torch_profile"
    assert [path.name for path in folder.iterdir()] == ["step-3"]
    nodes = set(graph.spec.nodes)
    files = {path.name for path in (folder / "step-3").iterdir()}
    assert files == {f"{node}.{kind}" for node in nodes for kind in ("txt", "trace.json")}
    # the update's table: its operators by own CPU time, the backward and the optimizer among them
    table = (folder / "step-3" / "train.txt").read_text()
    assert "Self CPU" in table and "aten::" in table
    assert "Optimizer.step" in table
    trace = json.loads((folder / "step-3" / "train.trace.json").read_text())
    assert any(event.get("name", "").startswith("aten::") for event in trace["traceEvents"])

    events = [json.loads(line) for line in (output / "events.jsonl").read_text().splitlines()]
    (profile,) = [event for event in events if event["kind"] == "profile"]
    assert profile["step"] == 3 and str(folder / "step-3") in profile["message"]

    # Calibration learns on the first half of the measured steps after step 1 and judges on
    # the rest: 2 and 4, then 5 and 6 (with step 3 it would have learned on 2 and 3).
    calibrated = json.loads((output / "plan-0.json").read_text())["calibrated"]
    assert calibrated["learned_from_steps"] == [2, 4]
    assert calibrated["judged_on_steps"] == [5, 6]


def test_profiled_steps_are_checked_against_the_steps_asked_on_the_command_line(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from flowrl.cli.main import app

    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(PIPELINE.read_text().replace("steps: 120", "steps: 2"))
    assert "steps: 2" in pipeline.read_text()
    out = tmp_path / "out"
    short = CliRunner().invoke(app, ["run", str(pipeline), "-o", str(out), "--plain", "trainer.torch_profile=[3]"])
    assert short.exit_code == 2, short.output
    assert "torch_profile names step 3, past the run's 2 steps" in " ".join(short.output.split())
    longer = CliRunner().invoke(app, ["run", str(pipeline), "-o", str(out), "--plain", "--steps", "3",
                                      "trainer.torch_profile=[3]"])
    assert longer.exit_code == 0, longer.output
    assert (out / "torch_profile" / "step-3" / "train.txt").is_file()


def test_a_profile_that_cannot_be_written_where_asked_goes_to_the_temporary_folder(tmp_path: Path) -> None:
    from flowrl.runtime.torch_profile import fallback_folder, profiled

    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    asked = str(blocked / "step-7")  # under a file: no folder can be made there
    with pytest.warns(UserWarning, match="could not write the torch profile of adv"):
        with profiled(asked, "adv", on_gpu=False):
            torch.ones(3).sum()
    fallback = fallback_folder(asked)
    assert fallback.name == "step-7"
    assert (fallback / "adv.txt").is_file() and (fallback / "adv.trace.json").is_file()
    (fallback / "adv.txt").unlink()
    (fallback / "adv.trace.json").unlink()
