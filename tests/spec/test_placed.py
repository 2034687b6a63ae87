"""Errors a run finds as it starts, placed at the pipeline file's line or the override."""

from __future__ import annotations

from pathlib import Path

from flowrl.errors import DataError, ModelLoadError, SpecError, SpecIssue
from flowrl.spec.inventory_file import InventoryFileError
from flowrl.spec.loader import issue_locator, placed

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = ROOT / "pipelines" / "grpo_tiny.yaml"


def _line(text: str) -> int:
    return next(number for number, row in enumerate(PIPELINE.read_text().splitlines(), 1) if text in row)


def test_errors_that_name_a_field_are_placed_and_others_pass_through() -> None:
    locate = issue_locator(PIPELINE)
    data = placed(DataError("no such column", field="data.prompt_key"), locate)
    # the key is not in the file: the data section's line
    assert isinstance(data, SpecError) and str(data.issues[0]).startswith(f"{PIPELINE}:")
    tokenizer = ModelLoadError("the tokenizer cannot be read")
    tokenizer.field = "data.source"
    [issue] = placed(tokenizer, locate).issues  # type: ignore[attr-defined]
    assert (issue.file, issue.line, issue.path) == (str(PIPELINE), _line("source: builtin:digits"), "data.source")
    # an override's field is placed at the override
    [issue] = placed(DataError("bad", field="data.source"), issue_locator(PIPELINE, ["data.source=x.jsonl"])).issues  # type: ignore[attr-defined]
    assert issue.argument == "data.source=x.jsonl"
    # a reward function's issue without a place gets its line; one with a place keeps it
    kept = SpecIssue("nodes.reward.fn", "already placed", "other.yaml", 3)
    error = placed(SpecError([SpecIssue("nodes.reward.fn", "cannot be called"), kept]), locate)
    assert [(i.file, i.line) for i in error.issues] == [  # type: ignore[attr-defined]
        (str(PIPELINE), _line("fn: digits")), ("other.yaml", 3)]
    # nothing to place: the same error
    # (an inventory file's issues belong to that file, not the pipeline's)
    inventory = InventoryFileError([SpecIssue("hosts.a.gpus", "unknown type")])
    for same in (DataError("a bad row in a step"), ModelLoadError("no field"), SpecError([kept]), inventory):
        assert placed(same, locate) is same
