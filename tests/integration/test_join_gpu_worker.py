"""A joined Dask cluster with a GPU worker: the worker started the Dask way for a GPU
(``--resources GPU=1``, ``CUDA_VISIBLE_DEVICES``) is a GPU slot, and a ``type: gpu`` group's
models run on its card."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.test_join_scheduler import dask_processes

pytestmark = [pytest.mark.integration, pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

REPO = Path(__file__).resolve().parents[2]


def test_a_joined_gpu_worker_runs_the_gpu_group(tmp_path: Path) -> None:
    workers = {"gpu-w": ({"CUDA_VISIBLE_DEVICES": "0"}, ["--resources", "GPU=1"]),
               "cpu-a": ({"CUDA_VISIBLE_DEVICES": ""}, []), "cpu-b": ({"CUDA_VISIBLE_DEVICES": ""}, [])}
    with dask_processes(tmp_path, workers) as address:
        from distributed import Client

        with Client(address, timeout=30) as client:
            client.wait_for_workers(3, timeout=120)
        output = tmp_path / "out"
        result = subprocess.run(
            [sys.executable, "-m", "flowrl.cli.main", "run", str(REPO / "pipelines" / "grpo_tiny_gpu.yaml"), "--scheduler", address,
             "--plain", "--steps", "4", f"trainer.output_dir={output}"],
            capture_output=True, text=True, timeout=600, cwd=tmp_path,
        )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    plan = json.loads((output / "plan-0.json").read_text())
    assert plan["runtime"]["node_slots"]["rollout"] == "gpu-w"
    assert plan["runtime"]["node_slots"]["train"] == "gpu-w"
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    # device memory is measured only where the models sit on a CUDA device
    assert all(row.get("perf/max_memory_allocated_gb", 0) > 0 for row in rows)
