"""The README's two fresh-machine commands are exactly what CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    quick_start = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", quick_start, flags=re.S)


def test_readme_has_exactly_two_commands_and_ci_runs_both() -> None:
    commands = _readme_commands()
    assert len(commands) == 2, commands
    assert all("\n" not in command for command in commands)
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert commands[0] in ci_lines
    # CI wraps the test command to tell "no tests collected" (exit 5) apart
    assert any(line.startswith(commands[1]) for line in ci_lines), commands[1]


def test_cpu_install_pins_the_cpu_torch_wheel() -> None:
    install = _readme_commands()[0]
    assert "torch==2.13.0" in install
