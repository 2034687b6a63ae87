"""fr.validate and fr.run take a pipeline file's path, as the commands do."""

from __future__ import annotations

from pathlib import Path

import pytest

import flowrl as fr
from flowrl.errors import SpecError

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"


def test_a_files_problems_found_after_its_text_are_placed_at_its_lines(tmp_path: Path) -> None:
    text = (PIPELINES / "grpo_tiny.yaml").read_text()
    assert "source: builtin:digits" in text
    file = tmp_path / "p.yaml"
    file.write_text(text.replace("source: builtin:digits", "source: missing.jsonl"))
    line = 1 + file.read_text().splitlines().index(
        next(row for row in file.read_text().splitlines() if "missing.jsonl" in row))
    with pytest.raises(SpecError, match=rf"{file}:{line}: data.source"):
        fr.validate(file)
    # relative paths are the file's folder's
    (tmp_path / "missing.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n' * 8)
    assert fr.validate(str(file)).name == fr.load_pipeline(file).name
