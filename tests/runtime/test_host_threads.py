"""Which thread of a worker's RoleHost runs a node call."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from flowrl.runtime.host import RoleHost


def _host(device: str) -> RoleHost:
    # the process's own thread count, so that making the host changes nothing for other tests
    return RoleHost(f"{device}-0", device, torch.get_num_threads(), seed=0, base_dir=None)


def test_on_a_gpu_worker_calls_without_a_model_run_beside_the_compute_thread() -> None:
    host = _host("cuda")
    score, adv = SimpleNamespace(model=None), SimpleNamespace(model=None)
    ref = SimpleNamespace(model="reference")
    assert host._thread_of(ref) is host._compute  # type: ignore[arg-type]
    beside = host._thread_of(score)  # type: ignore[arg-type]
    assert beside is not host._compute
    # one second thread: calls beside the device's still run one at a time, in order
    assert host._thread_of(adv) is beside  # type: ignore[arg-type]


def test_on_a_cpu_slot_every_call_runs_on_the_compute_thread() -> None:
    host = _host("cpu")
    for model in (None, "actor"):
        assert host._thread_of(SimpleNamespace(model=model)) is host._compute  # type: ignore[arg-type]
