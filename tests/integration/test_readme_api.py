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
