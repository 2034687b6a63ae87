"""``micro_batch_tokens: auto``: the most rows per pass that fit, resolved before the plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from flowrl.cli.plan import plan_command
from flowrl.devices.files import load_inventory
from flowrl.devices.groups import pipeline_groups
from flowrl.devices.inventory import GB_PER_GIB, Inventory
from flowrl.devices.matching import match_groups
from flowrl.errors import PlacementError, SpecError
from flowrl.graph import PipelineGraph
from flowrl.planner.compiled import compile_plan
from flowrl.planner.costs import EstimatedCosts
from flowrl.planner.micro_batches import ResolvedPass, resolve_micro_batches
from flowrl.spec.loader import load_pipeline, pipeline_from_dict
from flowrl.spec.schema import pass_tokens

from tests.planner.conftest import cpu, gpu, grpo, inventory

ROOT = Path(__file__).resolve().parents[2]
GPU_JOB = ROOT / "pipelines" / "grpo_0.4b_gpu.yaml"
AUTO = ["nodes.ref.micro_batch_tokens=auto", "nodes.train.micro_batch_tokens=auto"]
ROW_TOKENS = 9 + 256
"""A planned row of the 0.4B job: a builtin:digits prompt (8 letters and '=', a token each)
and max_new_tokens."""


def _resolve(graph: PipelineGraph, devices: Inventory) -> tuple[PipelineGraph, dict[str, ResolvedPass]]:
    match = match_groups(pipeline_groups(graph.spec), devices)
    resolved, costs, passes = resolve_micro_batches(graph, devices, match, EstimatedCosts(graph, base_dir=GPU_JOB.parent))
    # the estimates it hands back are those of the resolved pipeline, as if made afresh
    fresh = EstimatedCosts(resolved, base_dir=GPU_JOB.parent)
    assert costs.pipeline is resolved
    assert all(costs.work(node) == fresh.work(node) for node in resolved.topological_order())
    return resolved, {item.node: item for item in passes}


def test_on_a_40_gb_card_the_update_takes_the_most_rows_that_fit_and_no_more() -> None:
    devices = inventory(gpu(0, "A100-40GB", 40, 312, 1555), cpu(0))
    resolved, passes = _resolve(load_pipeline(GPU_JOB, AUTO), devices)
    train, ref = passes["train"], passes["ref"]
    assert train.most_rows == 256 and 1 < train.rows < 256 and train.devices == ["gpu-0"]
    assert train.tokens == train.rows * ROW_TOKENS
    assert resolved.spec.nodes["train"].micro_batch_tokens == train.tokens
    # the reference's no-grad pass keeps no activations: the whole batch fits in one pass, its
    # budget kept as a number on a GPU
    assert ref.rows == 256 and ref.tokens == 256 * ROW_TOKENS
    assert resolved.spec.nodes["ref"].micro_batch_tokens == ref.tokens
    # the resolved job plans within the reserve; one row more per pass does not fit
    plan = compile_plan(resolved, devices, base_dir=GPU_JOB.parent)
    peak = {device.device: device.peak_gb for device in plan.devices}["gpu-0"]
    assert peak * 1.10 <= 40 * GB_PER_GIB  # 42.9 GB: a 40 GiB card
    nodes = dict(resolved.spec.nodes)
    nodes["train"] = nodes["train"].model_copy(update={"micro_batch_tokens": (train.rows + 1) * ROW_TOKENS})
    bigger = PipelineGraph(resolved.spec.model_copy(update={"nodes": nodes}))
    with pytest.raises(PlacementError, match="gpu-0"):
        compile_plan(bigger, devices, base_dir=GPU_JOB.parent)


def test_on_a_141_gb_card_both_passes_take_the_whole_batch() -> None:
    devices = inventory(gpu(0, "H200", 141, 989, 4800), cpu(0))
    _, passes = _resolve(load_pipeline(GPU_JOB, AUTO), devices)
    whole = (256, 256 * ROW_TOKENS)
    assert {node: (item.rows, item.tokens) for node, item in passes.items()} == {"ref": whole, "train": whole}
    assert passes["train"].line() == "train: micro_batch_tokens auto -> 67840 tokens (256 of 256 rows per pass fit on gpu-0)"


def test_an_update_with_mini_batches_counts_a_mini_batch_per_rank() -> None:
    # 8 prompts x 4 samples, mini-batches of 8 sequences over 2 CPU slots: 4 rows per rank at once
    data = grpo({"path": "builtin:tiny-llama", "device_group": "actor"}, {"path": "builtin:tiny-llama"},
                {"actor": {"type": "cpu", "count": 2}}, batch_size=8, n=4, mini_batch_size=8,
                micro_batch_tokens="auto")
    resolved, passes = _resolve(pipeline_from_dict(data), inventory(cpu(0), cpu(1)))
    assert (passes["train"].most_rows, passes["train"].tokens) == (4, None)
    assert resolved.spec.nodes["train"].micro_batch_tokens is None


def test_when_one_row_does_not_fit_the_error_says_auto_was_tried_at_one_row() -> None:
    # 1.5B weights, gradients and AdamW moments alone (about 22 GB in bf16) overflow a 4 GB card
    devices = inventory(gpu(0, "small", 4, 65, 320), cpu(0))
    bigger = ["models.actor.path=builtin:qwen2-1.5b", "models.reference.path=builtin:qwen2-1.5b"]
    with pytest.raises(PlacementError, match=r"micro_batch_tokens: auto was tried at one row per pass, its least, "
                                             r"for ref, train\)"):
        _resolve(load_pipeline(GPU_JOB, AUTO + bigger), devices)
    # without auto nodes the message does not mention it
    with pytest.raises(PlacementError) as error:
        compile_plan(load_pipeline(GPU_JOB, bigger), devices, base_dir=GPU_JOB.parent)
    assert "auto" not in str(error.value)


def test_nothing_to_resolve_gives_the_pipeline_back() -> None:
    graph = load_pipeline(GPU_JOB)
    assert _resolve(graph, inventory(gpu(0, "A100-40GB", 40, 312, 1555), cpu(0))) == (graph, {})


def test_auto_in_a_file_and_a_wrong_word() -> None:
    assert load_pipeline(GPU_JOB, AUTO).spec.nodes["train"].micro_batch_tokens == "auto"
    for wrong, shown in (("largest", "'largest'"), ("0", "0"), ("true", "true")):
        with pytest.raises(SpecError) as error:
            load_pipeline(GPU_JOB, [f"nodes.train.micro_batch_tokens={wrong}"])
        assert str(error.value) == (
            "1 problem in the pipeline:\n  command line: "
            f"nodes.train.micro_batch_tokens={wrong}: expected a positive whole number of tokens per pass, "
            f"auto or null, found {shown}")
    # read as other integer fields read them: an int, not a float or a quoted number
    assert load_pipeline(GPU_JOB, ["nodes.train.micro_batch_tokens=4096"]).spec.nodes["train"].micro_batch_tokens == 4096
    for given in ("4096.0", "'4096'"):
        with pytest.raises(SpecError, match="expected a positive whole number of tokens per pass"):
            load_pipeline(GPU_JOB, [f"nodes.train.micro_batch_tokens={given}"])
    # a node call never sees auto: the planner resolves it before the run
    with pytest.raises(ValueError, match="resolves it before a run"):
        pass_tokens("auto")
    assert pass_tokens(4096) == 4096 and pass_tokens(None) is None


def test_flowrl_plan_prints_and_writes_what_auto_became(tmp_path: Path) -> None:
    devices = tmp_path / "a100.yaml"
    devices.write_text((ROOT / "devices" / "a100-4x40gb.yaml").read_text())
    console = Console(record=True, width=300, color_system=None)
    plan_command(GPU_JOB, devices, as_json=False, output=None, console=console, overrides=AUTO)
    text = console.export_text()
    assert "ref: micro_batch_tokens auto -> 67840 tokens (256 of 256 rows" in text
    assert "train: micro_batch_tokens auto -> " in text and " tokens (" in text
    console = Console(record=True, width=300, color_system=None)
    plan_command(GPU_JOB, devices, as_json=True, output=None, console=console, overrides=AUTO)
    written = json.loads(console.export_text())
    assert [item["node"] for item in written["micro_batch_tokens_auto"]] == ["ref", "train"]
    train = written["micro_batch_tokens_auto"][1]
    assert train["tokens"] == train["rows"] * ROW_TOKENS


def test_a_reward_models_score_node_takes_a_budget_and_a_functions_does_not() -> None:
    ppo = load_pipeline(ROOT / "pipelines" / "ppo.yaml", ["nodes.reward.micro_batch_tokens=auto"])
    devices = load_inventory(ROOT / "devices" / "mixed-4gpu.yaml")
    resolved, passes = _resolve(ppo, devices)
    reward = passes["reward"]
    assert reward.rows == reward.most_rows and reward.tokens is not None  # a small reward model on a GPU
    assert resolved.spec.nodes["reward"].micro_batch_tokens == reward.tokens
    with pytest.raises(SpecError, match="micro_batch_tokens bounds a reward model's forward passes; this score calls "
                                        "a function"):
        load_pipeline(ROOT / "pipelines" / "grpo_tiny.yaml", ["nodes.reward.micro_batch_tokens=4096"])
