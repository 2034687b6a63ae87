"""Process groups by device: gloo for CPU workers, NCCL for GPU workers."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from flowrl.errors import ClusterError
from flowrl.roles.data_parallel import DataParallel
from flowrl.roles.state import ModelState
from flowrl.roles.update import update_policy
from flowrl.runtime.collective import MULTICAST_OFF, DeviceGroup, backend_for, free_port
from flowrl.spec.schema import UpdateNode
from flowrl.backends.tokenizer import build_char_tokenizer
from tests.tiny_models import text_rollout, tiny_policy


def test_the_backend_follows_the_device() -> None:
    assert backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(torch.device("cuda", 0)) == "nccl"
    group = DeviceGroup("127.0.0.1", free_port("127.0.0.1"), 0, 1, timeout_s=10)
    assert group.backend == "gloo"
    tensor = torch.tensor([1.5, -2.0])
    group.all_reduce(tensor)  # one rank: the sum is the tensor itself
    assert tensor.tolist() == [1.5, -2.0]


@pytest.mark.skipif(dist.is_nccl_available(), reason="this torch has NCCL")
def test_a_gpu_group_without_nccl_is_a_clear_error() -> None:
    with pytest.raises(ClusterError, match="needs NCCL"):
        DeviceGroup("127.0.0.1", free_port("127.0.0.1"), 0, 1, timeout_s=10, device="cuda")


def _state(device: str) -> ModelState:
    return ModelState("actor", tiny_policy(0).to(device), build_char_tokenizer(), torch.device(device),
                      torch.Generator().manual_seed(0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_nccl_group_of_one_trains_like_no_group() -> None:
    """One NCCL rank on the card: gradients are summed through NCCL (CUDA buckets, staged CPU
    flags and numbers) and the update equals the one without a group."""
    group = DeviceGroup("127.0.0.1", free_port("127.0.0.1"), 0, 1, timeout_s=60, device="cuda")
    assert group.backend == "nccl"
    assert all(os.environ.get(key) == value for key, value in MULTICAST_OFF.items())
    on_card, on_cpu = torch.arange(4.0, device="cuda"), torch.tensor([3.0, 4.0], dtype=torch.float64)
    group.all_reduce(on_card)
    group.all_reduce(on_cpu)
    assert on_card.tolist() == [0.0, 1.0, 2.0, 3.0] and on_cpu.tolist() == [3.0, 4.0]

    node = UpdateNode(model="actor", inputs=["rollout", "adv"], lr=1e-2, ppo_epochs=2, mini_batch_size=4,
                      max_grad_norm=0.5)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    results = []
    # The first update of a process may take other kernels than later ones (on an H100 its
    # weights differed from a second identical update's in the last bits, and Adam turns such
    # bits of near-zero gradients into steps of the learning rate's size): the update that
    # comes first is not compared.
    for dp in (None, None, DataParallel(group, (1.0,))):
        state = _state("cuda")
        rollout = text_rollout(state.tokenizer, ["ab=", "ab=", "cd=", "cd=", "efg=", "efg="],
                               ["1", "xyz", "34", "z", "5678", "ab"], group_size=2, max_new_tokens=4)
        update_policy(state, rollout, advantages, None, node, seed=0, dp=dp)
        results.append(state.module.state_dict())
    for name, tensor in results[2].items():
        torch.testing.assert_close(tensor, results[1][name], rtol=1e-5, atol=1e-6, msg=name)
