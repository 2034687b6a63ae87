"""Host-to-device copies that do not make the host wait for the device.

A copy from ordinary (pageable) host memory to a GPU may wait until the GPU has run all the
work queued before it; between the passes of an update or a reference call that turns into
idle GPU time while the host prepares the next pass. A copy from pinned memory is queued like
a kernel instead. PyTorch's pinned-memory cache keeps each pinned block until its copy has
run, so the host tensor may be dropped at once.
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` on ``device``; a host tensor bound for a GPU goes through pinned memory
    without waiting."""
    target = torch.device(device)
    if target.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(target, non_blocking=True)
    return tensor.to(target)
