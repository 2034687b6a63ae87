"""Training one model sharded over a group (FSDP2): each rank keeps 1/world of every
parameter, of its gradient and of the optimizer's moments.

``torch.distributed.fsdp.fully_shard`` turns each decoder layer (and then the whole model)
into a unit whose parameters are DTensors sharded over the group's mesh. A unit's forward
all-gathers its parameters and frees them after; its backward reduce-scatters the gradients.
Both are collectives: every rank must run the same number of forward and backward passes,
in the same order. The update (``roles.update``) therefore gives every rank as many passes as
the rank with the most (a rank with fewer rows runs passes whose loss is multiplied by zero),
and gradients are reduce-scattered only in the last pass of an optimizer step.

The reduce-scatter sums (divide factor 1), as the all-reduce path does: each rank's loss is
already weighted by its share of the mini-batch. Passes that are not training (old log-probs
before the first step) run with the whole model gathered once (:func:`gathered`), so a rank
may run any number of them. :func:`full_state_dict` gathers whole tensors for checkpoints
and weight pushes; every rank must call it.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import torch

from flowrl.backends.compiled_layers import decoder_layers


def is_sharded(module: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def shard(module: torch.nn.Module, mesh: Any) -> None:
    """Shard ``module`` in place over ``mesh``: a unit per decoder layer (so one layer's
    parameters are whole at a time), then the rest (embeddings, final norm, head)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for layer in decoder_layers(module) or []:
        fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)
    assert isinstance(module, FSDPModule)
    for unit in module.modules():  # each unit reduces its own gradients
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)
            # A plain sum (gloo has no pre-multiplied sum, the op a factor would otherwise use).
            unit.set_force_sum_reduction_for_comms(True)


def set_gradient_sync(module: torch.nn.Module, sync: bool) -> None:
    """Whether the next backward reduce-scatters the gradients (the last pass of a step) or
    only adds into this rank's unsharded gradients (the passes before it)."""
    from torch.distributed.fsdp import FSDPModule

    assert isinstance(module, FSDPModule)
    module.set_requires_gradient_sync(sync)


@contextlib.contextmanager
def gathered(module: torch.nn.Module) -> Iterator[None]:
    """Inside this block the whole model is gathered on every rank (one all-gather, at the
    start: every rank must enter), and forward passes run without collectives."""
    from torch.distributed.fsdp import FSDPModule

    units = [unit for unit in module.modules() if isinstance(unit, FSDPModule)]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            # fully_shard's own choice: the layers free their gathered parameters after the
            # forward, the root keeps them for the backward that follows at once
            unit.set_reshard_after_forward(unit is not module, recurse=False)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a plain tensor as it is)."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole tensors of a sharded model's state dict (every rank must call)."""
    from torch.distributed.tensor import DTensor

    return {name: value.full_tensor() if isinstance(value, DTensor) else value
            for name, value in module.state_dict().items()}


def clip_sharded_gradients(params: list[torch.nn.Parameter], max_norm: float, sum_over_ranks: Any) -> float:
    """The global gradient norm of sharded parameters (each rank's squares summed over the
    ranks by ``sum_over_ranks``), and, with ``max_norm`` > 0, the gradients scaled as
    ``torch.nn.utils.clip_grad_norm_`` scales them."""
    squares = [local_part(p.grad).detach().float().pow(2).sum() for p in params if p.grad is not None]
    local = float(torch.stack(squares).sum()) if squares else 0.0
    total = math.sqrt(sum_over_ranks([local])[0])
    if max_norm > 0 and math.isfinite(total):
        coefficient = min(1.0, max_norm / (total + 1e-6))
        if coefficient < 1.0:
            for p in params:
                if p.grad is not None:
                    local_part(p.grad).mul_(coefficient)
    return total
