"""Host-to-device copies that do not make the host wait for the device.

A copy from ordinary (pageable) host memory to a GPU may wait until the GPU has run all the
work queued before it; between the passes of an update or a reference call that turns into
idle GPU time while the host prepares the next pass. A copy from contiguous pinned memory is
queued like a kernel instead (a strided source would be made contiguous in pageable memory
first, so the pinned copy is made contiguous). PyTorch's pinned-memory cache keeps each
pinned block until its copy has run, so the host tensor may be dropped at once.
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` on ``device``; a host tensor bound for a GPU goes through contiguous pinned
    memory without waiting. A host tensor that is pinned and contiguous already is copied
    from as it is: the caller must not change it in place while the copy may be running."""
    target = torch.device(device)
    if target.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(target)
    if tensor.is_contiguous() and tensor.is_pinned():
        pinned = tensor
    else:
        pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        pinned.copy_(tensor)
    return pinned.to(target, non_blocking=True)
