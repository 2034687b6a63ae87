"""Forward passes over packed sequences: several rows laid end to end in one row, with no
padding, each attending only to itself.

A batch of rows of different lengths, padded to the longest, spends every layer's matrix
products on the padding. Packed, the same rows are one sequence of their real tokens; the
attention has to stay inside each row, and the positions restart at 0 for each row.

transformers dispatches attention by name (``config._attn_implementation``) through
``AttentionInterface`` and builds masks through ``AttentionMaskInterface``. This module
registers one more name: while :func:`packed` is active for a model, its attention runs per
row (causal, from the row bounds given) and no mask of the packed length squared is ever
built; outside that block the model is untouched. Only models that dispatch through the
interface (``_supports_attention_backend``) can be packed: :func:`can_pack` says which.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch
import torch.nn.functional as F

NAME = "flowrl_packed"
"""The attention implementation's registered name."""

_state = threading.local()


def _bounds() -> list[int] | None:
    bounds: list[int] | None = getattr(_state, "bounds", None)
    return bounds


@torch.compiler.disable
def _packed_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention inside each packed row; query [1, heads, T, D], key and value
    [1, kv_heads, T, D]; returns [1, T, heads, D] as transformers' attention functions do.

    Never traced by ``torch.compile`` (a compiled layer breaks its graph here): the loop
    runs over bounds that change every pass."""
    bounds = _bounds()
    if bounds is None:
        raise RuntimeError("packed attention called outside flowrl.backends.packed_attention.packed()")
    groups = query.shape[1] // key.shape[1]
    out = torch.empty_like(query)
    for start, end in zip(bounds, bounds[1:]):
        if start == end:
            continue
        out[:, :, start:end] = F.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
            is_causal=True, scale=scaling, enable_gqa=groups > 1,
        )
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """Packed rows need no mask: the attention takes the row bounds instead."""
    return None


_registered = False


def _register() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, _packed_attention)
    AttentionMaskInterface.register(NAME, _no_mask)
    _registered = True


def can_pack(module: torch.nn.Module) -> bool:
    """True for a transformers model whose attention layers dispatch by name and attend
    causally over the whole row (no sliding windows, no soft-capped attention scores)."""
    config = getattr(module, "config", None)
    if config is None or not getattr(module, "_supports_attention_backend", False):
        return False
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return False
    if getattr(config, "attn_logit_softcapping", None):
        return False
    layer_types = getattr(config, "layer_types", None) or []
    return all(kind == "full_attention" for kind in layer_types)


@contextlib.contextmanager
def packed(module: torch.nn.Module, lengths: list[int]) -> Iterator[None]:
    """Run ``module`` on packed rows of ``lengths`` tokens (in order) inside this block.

    The caller passes ``input_ids`` [1, sum(lengths)] and ``position_ids`` restarting at 0
    for each row, and no attention mask.
    """
    _register()
    config = getattr(module, "config")
    previous = config._attn_implementation
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    _state.bounds = bounds
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = previous
        _state.bounds = None
