"""``offload_to_cpu``: an inference model's weights stay in host memory between calls and are on
the GPU only during a call; validation keeps it to models that are never sampled or trained."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowrl.errors import SpecError
from flowrl.planner.costs import EstimatedCosts
from flowrl.roles.reference import run_reference_logprob
from flowrl.roles.state import ModelState
from flowrl.spec.loader import pipeline_from_dict
from tests.integration.conftest import tiny_grpo
from tests.roles.test_update import _rollout


def _graph(tmp_path: Path, offloaded: str) -> object:
    spec = tiny_grpo(tmp_path, steps=1).to_dict()
    spec["models"][offloaded]["offload_to_cpu"] = True
    return pipeline_from_dict(spec)


def test_offloading_a_model_that_generates_or_trains_is_refused_by_validation(tmp_path: Path) -> None:
    _graph(tmp_path, "reference")  # the reference only scores log-probs: fine
    with pytest.raises(SpecError, match="models.actor.offload_to_cpu: node 'rollout' .generate. samples from or trains"):
        _graph(tmp_path, "actor")


def test_on_a_cpu_slot_paging_changes_nothing() -> None:
    state = ModelState.load("ref", "builtin:tiny-llama", dtype="fp32", device="cpu", seed=0, base_dir=None)
    state.page_out()
    assert not state.offloaded
    with state.paged_in():
        assert next(state.module.parameters()).device.type == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_offloaded_weights_leave_the_gpu_between_calls_and_the_call_fits_the_prediction(tmp_path: Path) -> None:
    graph = _graph(tmp_path, "reference")
    resident = ModelState.load("ref", "builtin:tiny-llama", dtype="fp32", device="cuda", seed=0, base_dir=None)
    rollout = _rollout(resident)
    expected = run_reference_logprob(resident, rollout).value
    weights_gb = sum(p.numel() * p.element_size() for p in resident.module.parameters()) / 1e9
    del resident
    torch.cuda.empty_cache()

    before = torch.cuda.memory_allocated()
    state = ModelState.load("ref", "builtin:tiny-llama", dtype="fp32", device="cuda", seed=0, base_dir=None)
    state.page_out()
    assert state.offloaded and next(state.module.parameters()).is_pinned()
    assert (torch.cuda.memory_allocated() - before) / 1e9 < 0.01 * weights_gb
    torch.cuda.reset_peak_memory_stats()
    with state.paged_in():
        logprobs = run_reference_logprob(state, rollout).value
    peak_gb = (torch.cuda.max_memory_allocated() - before) / 1e9
    torch.testing.assert_close(logprobs, expected)
    # back in host memory after the call
    assert (torch.cuda.memory_allocated() - before) / 1e9 < 0.01 * weights_gb
    assert next(state.module.parameters()).device.type == "cpu"
    # the planner's memory for the reference node: its weights plus the pass's transient memory
    predicted = EstimatedCosts(graph).memory("ref", 1)  # type: ignore[arg-type]
    print(f"offload: peak {peak_gb:.4f} GB, predicted {predicted.weights_gb + predicted.transient_gb:.4f} GB")
    assert peak_gb >= weights_gb
    assert peak_gb <= predicted.weights_gb + predicted.transient_gb
