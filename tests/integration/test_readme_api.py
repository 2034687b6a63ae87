"""The README's Python API example runs as written (with fewer steps)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_readme_python_example_runs(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    code = readme.split("## The Python API", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert "fr.run(p, steps=120)" in code
    script = tmp_path / "example.py"
    script.write_text(code.replace("steps=120", "steps=2"))
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "name: grpo-digits" in result.stdout
    # fr.run prints a line per step and per event, as flowrl run --plain does
    assert "step 2/2 | reward" in result.stdout and "[event] placement:" in result.stdout
    assert (tmp_path / "outputs" / "api-run" / "final" / "model.safetensors").exists()


def test_a_pipeline_file_path_and_an_observer_of_steps_only(tmp_path: Path) -> None:
    """fr.run and fr.validate take a pipeline file's path (its folder holds its relative
    paths); an observer may have on_step alone; the result counts the finished steps."""
    import flowrl as fr
    from flowrl.errors import FlowrlError

    pipeline = ROOT / "pipelines" / "grpo_tiny.yaml"
    assert fr.validate(str(pipeline)) == fr.load_pipeline(pipeline)

    class Steps:
        def __init__(self) -> None:
            self.steps: list[int] = []

        def on_step(self, record: object) -> None:
            self.steps.append(getattr(record, "step"))

    seen = Steps()
    result = fr.run(pipeline, steps=2, output_dir=tmp_path / "out", observer=seen)
    assert seen.steps == [1, 2] and result.finished_steps == 2
    assert fr.load_run(tmp_path / "out").finished_steps == 2
    with pytest.raises(FlowrlError, match="observer: a value of type object has neither on_step"):
        fr.run(pipeline, steps=1, output_dir=tmp_path / "other", observer=object())
    with pytest.raises(FlowrlError, match=r"run\(\) takes a pipeline .* not a value of type int"):
        fr.run(42)  # type: ignore[arg-type]


def test_a_resume_into_a_folder_without_a_run_says_it_starts_at_step_one(tmp_path: Path) -> None:
    """`--resume` in a job script that is rerun after a preemption starts the run the first
    time; it says so, naming a folder beside it that holds a run (a typo in -o)."""
    import flowrl as fr

    (tmp_path / "runs" / "grpo-a").mkdir(parents=True)
    (tmp_path / "runs" / "grpo-a" / "config.yaml").write_text("")

    class Events:
        def __init__(self) -> None:
            self.lines: list[str] = []

        def on_event(self, event: object) -> None:
            self.lines.append(getattr(event, "message"))

    seen = Events()
    fr.run(ROOT / "pipelines" / "grpo_tiny.yaml", steps=1, output_dir=tmp_path / "runs" / "grpo-b", resume=True,
           observer=seen)
    expected = (f"resume: {tmp_path / 'runs' / 'grpo-b'} held no earlier run, so this one starts at step 1 "
                f"(a folder beside it holds a run: {tmp_path / 'runs' / 'grpo-a'}; if -o meant that one, stop this run "
                "and resume there)")
    assert expected in seen.lines
