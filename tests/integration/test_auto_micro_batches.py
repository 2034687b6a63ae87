"""A run with ``micro_batch_tokens: auto``: resolved before the first plan, written down, used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowrl.api.run import run
from flowrl.spec.loader import load_pipeline

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_a_run_resolves_auto_and_records_it(tmp_path: Path) -> None:
    pipeline = load_pipeline(ROOT / "pipelines" / "grpo_tiny.yaml",
                             ["nodes.ref.micro_batch_tokens=auto", "nodes.train.micro_batch_tokens=auto"])
    output = tmp_path / "out"
    result = run(pipeline, steps=2, output_dir=output)
    assert len(result.metric("actor/pg_loss")) == 2
    plan = json.loads((output / "plan-0.json").read_text())
    # tiny-llama beside this machine's memory: both passes take the whole batch
    resolved = {item["node"]: (item["rows"], item["most_rows"], item["tokens"]) for item in plan["micro_batch_tokens_auto"]}
    rows = pipeline.spec.data.batch_size * pipeline.spec.nodes["rollout"].n
    assert resolved == {"ref": (rows, rows, None), "train": (rows, rows, None)}
    events = (output / "events.jsonl").read_text()
    assert f"train: micro_batch_tokens auto -> no budget, all rows in one pass ({rows} of {rows} rows" in events
    # the saved pipeline keeps `auto`: a resumed run resolves it again on its own machine
    assert load_pipeline(output / "config.yaml").spec.nodes["train"].micro_batch_tokens == "auto"
