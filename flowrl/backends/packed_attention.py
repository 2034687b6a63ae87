"""Forward passes over packed sequences: several rows laid end to end in one row, with no
padding, each attending only to itself.

A batch of rows of different lengths, padded to the longest, spends every layer's matrix
products on the padding. Packed, the same rows are one sequence of their real tokens; the
attention has to stay inside each row, and the positions restart at 0 for each row.

transformers dispatches attention by name (``config._attn_implementation``) through
``AttentionInterface`` and builds masks through ``AttentionMaskInterface``. This module
registers one more name: while :func:`packed` is active for a model, its attention stays
inside each row (causal, from the row bounds given) and no mask of the packed length squared
is ever built; outside that block the model is untouched. Only models that dispatch through
the interface (``_supports_attention_backend``) can be packed: :func:`can_pack` says which.

On a CUDA device with half-precision tensors, one variable-length flash-attention kernel
(``torch.nn.attention.varlen``) covers every row of a layer, forward and backward. Elsewhere
the rows go one ``scaled_dot_product_attention`` each: a loop of a few calls per layer for a
pass of hundreds of rows would make the pass launch-bound on a GPU, which is why the kernel
is preferred there. The loop splits the packed tensors with ``split`` and joins the outputs
with ``cat``, so its backward gathers every row's gradient in one copy (slicing each row out
would give each row a zero-filled gradient of the whole pass to add up).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

NAME = "flowrl_packed"
"""The attention implementation's registered name."""

_state = threading.local()


def _bounds() -> list[int] | None:
    bounds: list[int] | None = getattr(_state, "bounds", None)
    return bounds


@functools.cache
def _varlen() -> tuple[Callable[..., Any], frozenset[str]] | None:
    """torch's variable-length attention and its keyword names, or None where this torch
    has none (the causal switch and grouped-query support are named differently across
    versions)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    names = frozenset(inspect.signature(varlen_attn).parameters)
    if not names & {"is_causal", "window_size"}:
        return None
    return varlen_attn, names


def varlen_usable(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """True when one variable-length kernel can attend a packed pass: CUDA on a card the
    flash kernels run on (compute capability 8.0 or newer), half precision and a head size
    they take."""
    return (_varlen() is not None and device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
            and 0 < head_dim <= 256 and head_dim % 8 == 0 and torch.cuda.get_device_capability(device) >= (8, 0))


def _cumulative_bounds(bounds: list[int], device: torch.device) -> torch.Tensor:
    """The row bounds as the kernel takes them (int32 on the device), made once per pass."""
    cached: dict[torch.device, torch.Tensor] = _state.__dict__.setdefault("cumulative", {})
    if device not in cached:
        cached[device] = torch.tensor(bounds, dtype=torch.int32, device=device)
    return cached[device]


def _varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[int],
                      scaling: float | None) -> torch.Tensor:
    """[1, heads, T, D] queries, [1, kv_heads, T, D] keys and values -> [1, T, heads, D]."""
    found = _varlen()
    assert found is not None
    varlen_attn, names = found
    groups = query.shape[1] // key.shape[1]
    q, k, v = (tensor[0].transpose(0, 1) for tensor in (query, key, value))  # [T, heads, D]
    options: dict[str, Any] = {"scale": scaling}
    if "window_size" in names:
        options["window_size"] = (-1, 0)  # causal
    else:
        options["is_causal"] = True
    if groups > 1:
        if "enable_gqa" in names:
            options["enable_gqa"] = True
        else:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    cumulative = _cumulative_bounds(bounds, query.device)
    longest = max(end - start for start, end in zip(bounds, bounds[1:]))
    out = varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cumulative, cumulative,
                      longest, longest, **options)
    return out[None]


def _looped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[int],
                      scaling: float | None) -> torch.Tensor:
    """One ``scaled_dot_product_attention`` per row; same shapes as :func:`_varlen_attention`."""
    groups = query.shape[1] // key.shape[1]
    lengths = [end - start for start, end in zip(bounds, bounds[1:])]
    outputs = [
        F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=groups > 1)
        for q, k, v in zip(query.split(lengths, dim=2), key.split(lengths, dim=2), value.split(lengths, dim=2))
        if q.shape[2] > 0
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


@torch.compiler.disable
def _packed_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention inside each packed row; query [1, heads, T, D], key and value
    [1, kv_heads, T, D]; returns [1, T, heads, D] as transformers' attention functions do.

    Never traced by ``torch.compile`` (a compiled layer breaks its graph here): the bounds
    change every pass."""
    bounds = _bounds()
    if bounds is None:
        raise RuntimeError("packed attention called outside flowrl.backends.packed_attention.packed()")
    if varlen_usable(query.device, query.dtype, query.shape[-1]):
        return _varlen_attention(query, key, value, bounds, scaling), None
    return _looped_attention(query, key, value, bounds, scaling), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """No mask is built: the attention function takes what it needs from its own state."""
    return None


@contextlib.contextmanager
def attending_with(module: torch.nn.Module, name: str, attention: Callable[..., Any]) -> Iterator[None]:
    """Inside this block, ``module``'s attention layers call ``attention`` (registered with
    transformers as ``name``, with the signature of its attention functions) and build no
    mask; outside it the model is untouched."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, _no_mask)
    config = getattr(module, "config")
    previous = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous


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
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    _state.bounds = bounds
    _state.cumulative = {}
    try:
        with attending_with(module, NAME, _packed_attention):
            yield
    finally:
        _state.bounds = None
        _state.cumulative = {}
