"""Attention of one new query per row over a static KV cache, as one Triton kernel.

A decode step's attention reads each row's cached keys and values once; at a batch of 256 and
a few hundred columns that is tens of megabytes per layer, a few microseconds at the card's
bandwidth. The library kernels behind ``scaled_dot_product_attention`` take 20-25 us for it,
because they are built for long queries: an additive mask tensor, the query heads of a
grouped KV head spread over separate programs that each read the cache again. This kernel
gives one program to each (row, KV head): it loads that head's group of query heads once,
walks the valid window of cached columns in blocks with an online softmax, and reads every
cached byte once. The per-row key validity (left padding) is a byte per column.

:func:`decode_attention` runs it on CUDA when Triton is importable and falls back to
``scaled_dot_product_attention`` elsewhere (CPU runs, no Triton), with the same result up to
bf16 rounding.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

try:  # Triton ships with CUDA builds of torch; CPU builds may lack it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

BLOCK_COLUMNS = 64
"""Cached columns one loop iteration of the kernel reads."""


def triton_usable(q: torch.Tensor) -> bool:
    """True when the Triton kernel can run on queries ``q`` [B, kv_heads, group, head_dim]:
    a CUDA tensor whose head size is a power of two of at least 16 (a block shape)."""
    head_dim = q.shape[-1]
    return triton is not None and q.is_cuda and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     key_valid: torch.Tensor, scaling: float) -> torch.Tensor:
    """Softmax attention of ``q`` [B, kv_heads, group, head_dim] (the query heads of each KV
    head side by side) over ``keys`` / ``values`` [B, kv_heads, W, head_dim] where
    ``key_valid`` [B, W] (bool) is True; returns [B, kv_heads, group, head_dim].

    ``keys`` and ``values`` may be strided views into a larger cache (their last dimension
    contiguous). Every row needs at least one valid column.
    """
    if triton_usable(q):
        return _triton_attention(q, keys, values, key_valid, scaling)
    bias = torch.zeros(key_valid.shape, dtype=q.dtype, device=q.device)
    bias.masked_fill_(~key_valid, torch.finfo(q.dtype).min)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias[:, None, None, :], scale=scaling)


def _triton_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      key_valid: torch.Tensor, scaling: float) -> torch.Tensor:
    batch, kv_heads, group, head_dim = q.shape
    window = keys.shape[2]
    if keys.stride(-1) != 1 or values.stride(-1) != 1 or keys.stride() != values.stride():
        raise ValueError("keys and values must share strides, with a contiguous last dimension")
    q = q.contiguous()
    out = torch.empty_like(q)
    valid = key_valid.view(torch.uint8) if key_valid.dtype == torch.bool else key_valid
    block_group = max(16, triton.next_power_of_2(group))  # tl.dot needs 16 rows at least
    _kernel[(batch * kv_heads,)](
        q, keys, values, valid, out,
        keys.stride(0), keys.stride(1), keys.stride(2),
        valid.stride(0), window, scaling,
        KV_HEADS=kv_heads, GROUP=group, HEAD_DIM=head_dim,
        BLOCK_GROUP=block_group, BLOCK_COLUMNS=BLOCK_COLUMNS, EXACT=q.dtype == torch.float32,
        num_warps=4, num_stages=2,
    )
    return out


if triton is not None:

    @triton.jit
    def _kernel(q_ptr: Any, k_ptr: Any, v_ptr: Any, valid_ptr: Any, out_ptr: Any,
                stride_row: Any, stride_head: Any, stride_column: Any,
                valid_stride: Any, window: Any, scaling: Any,
                KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_GROUP: tl.constexpr, BLOCK_COLUMNS: tl.constexpr, EXACT: tl.constexpr) -> None:
        program = tl.program_id(0)
        row = program // KV_HEADS
        head = program % KV_HEADS
        queries = tl.arange(0, BLOCK_GROUP)
        dims = tl.arange(0, HEAD_DIM)
        # q and out are contiguous [B, kv_heads, group, head_dim].
        q_offsets = (program * GROUP + queries)[:, None] * HEAD_DIM + dims[None, :]
        q_mask = queries[:, None] < GROUP
        q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0)
        cache = row * stride_row + head * stride_head

        best = tl.full((BLOCK_GROUP,), float("-inf"), tl.float32)
        total = tl.zeros((BLOCK_GROUP,), tl.float32)
        acc = tl.zeros((BLOCK_GROUP, HEAD_DIM), tl.float32)
        # exp2 instead of exp: fold log2(e) into the scale once.
        scale = scaling * 1.4426950408889634
        for start in tl.range(0, window, BLOCK_COLUMNS):
            columns = start + tl.arange(0, BLOCK_COLUMNS)
            in_window = columns < window
            valid = tl.load(valid_ptr + row * valid_stride + columns, mask=in_window, other=0) != 0
            offsets = cache + columns[:, None] * stride_column + dims[None, :]
            k = tl.load(k_ptr + offsets, mask=valid[:, None], other=0.0)
            v = tl.load(v_ptr + offsets, mask=valid[:, None], other=0.0)
            # fp32 inputs get fp32 products (tl.dot would round them to tf32).
            if EXACT:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                scores = tl.dot(q, tl.trans(k)) * scale
            scores = tl.where(valid[None, :], scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            # A block with no valid column keeps best at -inf: guard the rescale against nan.
            safe_best = tl.where(new_best == float("-inf"), 0.0, new_best)
            weights = tl.exp2(scores - safe_best[:, None])
            correction = tl.exp2(best - safe_best)
            total = total * correction + tl.sum(weights, axis=1)
            if EXACT:
                acc = acc * correction[:, None] + tl.dot(weights, v, input_precision="ieee")
            else:
                acc = acc * correction[:, None] + tl.dot(weights.to(v.dtype), v)
            best = new_best
        out = acc / total[:, None]
        tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)
