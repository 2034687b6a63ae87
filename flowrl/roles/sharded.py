"""Training one model sharded over a group (FSDP2): each rank keeps 1/world of every
parameter, of its gradient and of the optimizer's state (moments, and a bf16 model's fp32
masters).

``torch.distributed.fsdp.fully_shard`` turns each decoder layer (and then the whole model)
into a unit whose parameters are DTensors sharded over the group's mesh. A unit's forward
all-gathers its parameters and frees them after; its backward reduce-scatters the gradients.
Both are collectives: every rank must run the same number of forward and backward passes,
in the same order. The update (``roles.update``) therefore gives every rank as many passes as
the rank with the most (a rank with fewer rows runs passes whose loss is multiplied by zero),
and gradients are reduce-scattered only in the last pass of an optimizer step.

The reduce-scatter sums (divide factor 1), as the all-reduce path does: each rank's loss is
already weighted by its share of the mini-batch.

A sharded model's worker also keeps the whole weights in a plain copy of the model (see
``roles.state.ModelState.sharded``): generation, scoring, the old log-probs, checkpoints and
weight pushes read that copy, with no collective, and :func:`copy_whole` refreshes it after
each update. Whole tensors for a checkpoint or a move come from :func:`whole_optimizer_state`
(every rank must call it); :func:`shard_optimizer_state` and :func:`load_whole` go the other
way and need no peer, so a state saved on any number of ranks loads onto any other.
"""

from __future__ import annotations

import math
from typing import Any

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


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a plain tensor as it is)."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


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


def copy_whole(sharded: torch.nn.Module, whole: torch.nn.Module) -> None:
    """Write the sharded model's current parameters into the plain model ``whole`` (the same
    architecture), one unit at a time: each unit's parameters gathered at once, copied,
    freed again (every rank must call)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    targets = dict(whole.named_parameters())
    copied: set[str] = set()
    with torch.no_grad():
        for unit in [module for module in sharded.modules() if isinstance(module, FSDPModule)]:
            unit.unshard()  # this unit's own parameters become whole tensors until reshard()
            for name, param in sharded.named_parameters():
                if name not in copied and not isinstance(param, DTensor):
                    targets[name].copy_(param)
                    copied.add(name)
            unit.reshard()
        for name, param in sharded.named_parameters():  # any left outside every unit
            if name not in copied:
                targets[name].copy_(param.full_tensor() if isinstance(param, DTensor) else param)


def load_whole(sharded: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Set the sharded model's parameters from whole tensors (``state_dict`` names): each
    rank takes its own shard, with no collective."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, param in sharded.named_parameters():
            if name not in weights:
                continue
            value = weights[name]
            if isinstance(param, DTensor):
                # src_data_rank=None: every rank holds the whole tensor and keeps its slice
                part = distribute_tensor(value.to(param.device, param.dtype), param.device_mesh,
                                         param.placements, src_data_rank=None)
                param.to_local().copy_(part.to_local())
            else:
                param.copy_(value)


def whole_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state dict with every sharded tensor whole, in host memory (every rank
    must call, in the same order: the state dict lists parameters by index)."""
    from torch.distributed.tensor import DTensor

    saved = optimizer.state_dict()
    # one tensor at a time into host memory: the whole state never sits on the device
    state = {
        index: {key: value.full_tensor().cpu() if isinstance(value, DTensor) else value
                for key, value in entry.items()}
        for index, entry in saved["state"].items()
    }
    return {**saved, "state": state}


def shard_optimizer_state(whole: dict[str, Any], params: list[torch.nn.Parameter]) -> dict[str, Any]:
    """A whole optimizer state dict (:func:`whole_optimizer_state`, or a one-device run's)
    cut to this rank's shards of ``params`` (the optimizer's parameters, in its order);
    per-parameter tensors of the parameter's shape become shards, scalars (the step count)
    stay as they are. No collective."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    state: dict[Any, dict[str, Any]] = {}
    for index, entry in whole["state"].items():
        param = params[int(index)]
        state[index] = {
            key: distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
            if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.shape == param.shape
            else value
            for key, value in entry.items()
        }
    return {**whole, "state": state}
