"""Host-to-device copies through pinned memory (``flowrl.backends.transfer``)."""

from __future__ import annotations

import pytest
import torch

from flowrl.backends.transfer import to_device


def test_a_copy_to_the_host_device_is_the_tensor_itself() -> None:
    tensor = torch.arange(12).view(3, 4)
    assert to_device(tensor, "cpu") is tensor


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_strided_host_slice_arrives_whole_and_the_host_may_reuse_its_memory() -> None:
    host = torch.arange(4 * 300, dtype=torch.long).view(4, 300)
    window = host[:, 17:290]  # strided, as a pass's window of a rollout is
    expected = window.clone()
    on_gpu = to_device(window, "cuda")
    host.fill_(-1)  # the copy was taken from a pinned copy of its own
    assert on_gpu.device.type == "cuda" and on_gpu.is_contiguous()
    assert torch.equal(on_gpu.cpu(), expected)
    pinned = torch.ones(5, pin_memory=True)
    assert torch.equal(to_device(pinned, "cuda").cpu(), torch.ones(5))
