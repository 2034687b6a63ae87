"""A decode step's attention for one new token per row over a static KV cache.

From a layer's stacked q/k/v projection of the new token, :func:`decode_attention` applies
the rotary positions, writes the token's key and value into the cache column of this step,
and attends each row's query heads over the valid cached columns of the window.

On CUDA this is one Triton kernel per layer. The alternative, the rotary and the cache writes
as small element-wise kernels and then ``scaled_dot_product_attention`` with an additive mask,
costs about six kernels and 25 us per layer at a batch of 256: the library kernels are built
for long queries, copy the strided cache window, and give the query heads of a grouped KV head
separate programs that each read the cache again. Here one program per (row, KV head) rotates
the group's queries and the new key in registers, stores the key and value, and walks the
window in blocks with an online softmax, reading every cached byte once; the new column's
contribution comes from registers, so the program never reads back what it wrote. Elsewhere
(CPU, no Triton) the same arithmetic runs as plain torch operations.
"""

from __future__ import annotations

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


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions (rotate-half form, as transformers' Llama and Qwen2)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def triton_usable(qkv: torch.Tensor, head_dim: int) -> bool:
    """True when the Triton kernel can run: a CUDA tensor and a head size that is a power of
    two of at least 32 (each half of a head is a block of at least 16 for ``tl.dot``)."""
    return triton is not None and qkv.is_cuda and head_dim >= 32 and head_dim & (head_dim - 1) == 0


def decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor, column: torch.Tensor, key_valid: torch.Tensor,
                     scaling: float) -> torch.Tensor:
    """Attention of one new token per row.

    ``qkv`` [B, (heads + 2 kv_heads) * head_dim]: the new token's queries, key and value side by
    side; ``cos`` / ``sin`` [B, head_dim]: the rotary rows of each row's position;
    ``keys`` / ``values`` [B, kv_heads, W, head_dim]: the cache window (views into a larger
    cache, last dimension contiguous), whose column ``column`` ([1], long) receives the new
    key and value; ``key_valid`` [B, W] (bool): the columns each row attends to, the new one
    included. Returns [B, kv_heads, heads per kv head, head_dim].
    """
    head_dim = keys.shape[-1]
    if triton_usable(qkv, head_dim):
        return _triton_attention(qkv, cos, sin, keys, values, column, key_valid, scaling)
    return _plain_attention(qkv, cos, sin, keys, values, column, key_valid, scaling)


def _plain_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor, column: torch.Tensor, key_valid: torch.Tensor,
                     scaling: float) -> torch.Tensor:
    batch, kv_heads, _, head_dim = keys.shape
    kv_size = kv_heads * head_dim
    q_size = qkv.shape[-1] - 2 * kv_size
    cos, sin = cos[:, None, None, :], sin[:, None, None, :]
    q = rotate(qkv[:, :q_size].reshape(batch, kv_heads, -1, head_dim), cos, sin)
    k = qkv[:, q_size:q_size + kv_size].reshape(batch, kv_heads, 1, head_dim)
    keys.index_copy_(2, column, rotate(k, cos, sin))
    values.index_copy_(2, column, qkv[:, q_size + kv_size:].reshape(batch, kv_heads, 1, head_dim))
    # One query per row: the query heads of a KV group become the "length" axis of one
    # attention over that group's cached keys, so the cache is never repeated per head.
    bias = torch.zeros(key_valid.shape, dtype=q.dtype, device=q.device)
    bias.masked_fill_(~key_valid, torch.finfo(q.dtype).min)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias[:, None, None, :], scale=scaling)


def _triton_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                      values: torch.Tensor, column: torch.Tensor, key_valid: torch.Tensor,
                      scaling: float) -> torch.Tensor:
    batch, kv_heads, window, head_dim = keys.shape
    group = (qkv.shape[-1] // head_dim - 2 * kv_heads) // kv_heads
    if keys.stride(-1) != 1 or values.stride() != keys.stride():
        raise ValueError("keys and values must share strides, with a contiguous last dimension")
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    out = torch.empty((batch, kv_heads, group, head_dim), dtype=qkv.dtype, device=qkv.device)
    valid = key_valid.view(torch.uint8) if key_valid.dtype == torch.bool else key_valid
    _kernel[(batch * kv_heads,)](
        qkv, cos, sin, keys, values, column, valid, out,
        qkv.stride(0), cos.stride(0), keys.stride(0), keys.stride(1), keys.stride(2),
        valid.stride(0), window, scaling,
        KV_HEADS=kv_heads, GROUP=group, HALF=head_dim // 2,
        # tl.dot needs 16 rows at least.
        BLOCK_GROUP=max(16, triton.next_power_of_2(group)), BLOCK_COLUMNS=BLOCK_COLUMNS,
        EXACT=qkv.dtype == torch.float32, num_warps=4, num_stages=2,
    )
    return out


if triton is not None:

    @triton.jit
    def _dot(a, b, EXACT: tl.constexpr):
        # fp32 inputs get fp32 products (tl.dot would round them to tf32).
        if EXACT:
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _kernel(qkv_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, column_ptr, valid_ptr,
                out_ptr, qkv_stride, trig_stride, stride_row, stride_head, stride_column,
                valid_stride, window, scaling,
                KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HALF: tl.constexpr,
                BLOCK_GROUP: tl.constexpr, BLOCK_COLUMNS: tl.constexpr, EXACT: tl.constexpr):
        program = tl.program_id(0)
        row = program // KV_HEADS
        head = program % KV_HEADS
        dtype = out_ptr.dtype.element_ty
        lo = tl.arange(0, HALF)
        queries = tl.arange(0, BLOCK_GROUP)
        q_mask = queries[:, None] < GROUP
        heads = KV_HEADS * GROUP
        trig = row * trig_stride
        cos_lo = tl.load(cos_ptr + trig + lo).to(tl.float32)
        cos_hi = tl.load(cos_ptr + trig + HALF + lo).to(tl.float32)
        sin_lo = tl.load(sin_ptr + trig + lo).to(tl.float32)
        sin_hi = tl.load(sin_ptr + trig + HALF + lo).to(tl.float32)

        # The group's queries, rotated: (x_lo, x_hi) -> (x_lo cos - x_hi sin, x_hi cos + x_lo sin).
        q_base = qkv_ptr + row * qkv_stride + ((head * GROUP + queries) * (2 * HALF))[:, None]
        q_lo = tl.load(q_base + lo[None, :], mask=q_mask, other=0.0).to(tl.float32)
        q_hi = tl.load(q_base + HALF + lo[None, :], mask=q_mask, other=0.0).to(tl.float32)
        rq_lo = (q_lo * cos_lo[None, :] - q_hi * sin_lo[None, :]).to(dtype)
        rq_hi = (q_hi * cos_hi[None, :] + q_lo * sin_hi[None, :]).to(dtype)

        # The new key (rotated) and value, stored at this step's column.
        k_base = qkv_ptr + row * qkv_stride + (heads + head) * (2 * HALF)
        v_base = qkv_ptr + row * qkv_stride + (heads + KV_HEADS + head) * (2 * HALF)
        k_lo = tl.load(k_base + lo).to(tl.float32)
        k_hi = tl.load(k_base + HALF + lo).to(tl.float32)
        rk_lo = (k_lo * cos_lo - k_hi * sin_lo).to(dtype)
        rk_hi = (k_hi * cos_hi + k_lo * sin_hi).to(dtype)
        v_lo = tl.load(v_base + lo)
        v_hi = tl.load(v_base + HALF + lo)
        column = tl.load(column_ptr)
        cache = row * stride_row + head * stride_head
        new = cache + column * stride_column
        tl.store(k_ptr + new + lo, rk_lo)
        tl.store(k_ptr + new + HALF + lo, rk_hi)
        tl.store(v_ptr + new + lo, v_lo)
        tl.store(v_ptr + new + HALF + lo, v_hi)

        # exp2 instead of exp: fold log2(e) into the scale once. The softmax starts from the
        # new column (always valid), so every running maximum is finite.
        scale = scaling * 1.4426950408889634
        best = tl.sum(rq_lo.to(tl.float32) * rk_lo.to(tl.float32)[None, :], axis=1)
        best = (best + tl.sum(rq_hi.to(tl.float32) * rk_hi.to(tl.float32)[None, :], axis=1)) * scale
        total = tl.full((BLOCK_GROUP,), 1.0, tl.float32)
        acc_lo = tl.broadcast_to(v_lo.to(tl.float32)[None, :], (BLOCK_GROUP, HALF))
        acc_hi = tl.broadcast_to(v_hi.to(tl.float32)[None, :], (BLOCK_GROUP, HALF))
        for start in tl.range(0, window, BLOCK_COLUMNS):
            columns = start + tl.arange(0, BLOCK_COLUMNS)
            valid = tl.load(valid_ptr + row * valid_stride + columns, mask=columns < window, other=0) != 0
            valid = valid & (columns != column)
            offsets = cache + columns[:, None] * stride_column + lo[None, :]
            kc_lo = tl.load(k_ptr + offsets, mask=valid[:, None], other=0.0)
            kc_hi = tl.load(k_ptr + offsets + HALF, mask=valid[:, None], other=0.0)
            vc_lo = tl.load(v_ptr + offsets, mask=valid[:, None], other=0.0)
            vc_hi = tl.load(v_ptr + offsets + HALF, mask=valid[:, None], other=0.0)
            scores = (_dot(rq_lo, tl.trans(kc_lo), EXACT) + _dot(rq_hi, tl.trans(kc_hi), EXACT)) * scale
            scores = tl.where(valid[None, :], scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            weights = tl.exp2(scores - new_best[:, None])
            correction = tl.exp2(best - new_best)
            total = total * correction + tl.sum(weights, axis=1)
            weights = weights.to(dtype)
            acc_lo = acc_lo * correction[:, None] + _dot(weights, vc_lo, EXACT)
            acc_hi = acc_hi * correction[:, None] + _dot(weights, vc_hi, EXACT)
            best = new_best
        out_base = out_ptr + ((program * GROUP + queries) * (2 * HALF))[:, None]
        tl.store(out_base + lo[None, :], (acc_lo / total[:, None]).to(dtype), mask=q_mask)
        tl.store(out_base + HALF + lo[None, :], (acc_hi / total[:, None]).to(dtype), mask=q_mask)
