"""On a machine with a GPU: a worker per card, models in bf16 there, NVML sampled in it.

Without a GPU the run is refused before anything starts, naming the group and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flowrl.api.run import check_runnable, run
from flowrl.errors import FlowrlError
from flowrl.spec.loader import load_pipeline

PIPELINE = Path(__file__).resolve().parents[2] / "pipelines" / "grpo_tiny_gpu.yaml"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_a_gpu_group_on_a_machine_without_one_is_refused_before_start() -> None:
    with pytest.raises(FlowrlError, match=r"devices.gpu_group.type: this machine has no GPU .*set type: cpu"):
        check_runnable(load_pipeline(PIPELINE))


@pytest.mark.gpu
@pytest.mark.integration
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_gpu_pipeline_runs_its_models_on_the_gpu_worker(tmp_path: Path) -> None:
    result = run(load_pipeline(PIPELINE), steps=12, output_dir=tmp_path / "out")
    plan = json.loads((tmp_path / "out" / "plan-0.json").read_text())["runtime"]
    assert plan["model_slots"] == {"actor": ["gpu-0"], "reference": ["gpu-0"]}
    assert {plan["node_slots"][node] for node in ("rollout", "ref", "train")} == {"gpu-0"}
    samples = [d for record in result.records for d in record.devices if d.kind == "gpu"]
    assert samples and all(d.device == "gpu-0" and d.memory_gb > 0 for d in samples)
    assert all(torch.isfinite(torch.tensor(r.metrics["actor/loss"])) for r in result.records)
