"""A decode step's attention for one new token per row over a static KV cache.

From a layer's stacked q/k/v projection of the new token, :func:`decode_attention` applies
the rotary positions, writes the token's key and value into the cache column of this step,
and attends each row's query heads over the valid cached columns of the window.

On CUDA this is Triton. The alternative, the rotary and the cache writes as small
element-wise kernels and then ``scaled_dot_product_attention`` with an additive mask, costs
about six kernels and 25 us per layer at a batch of 256: the library kernels are built for long
queries, copy the strided cache window, and give the query heads of a grouped KV head separate
programs that each read the cache again. Here the programs of a (row, KV head) rotate the
group's queries and the new key in registers, and each walks its share of the window in blocks
of whole cached rows (every cached byte is read once, in contiguous runs) with an online
softmax. The first share's program also stores the new key and value and counts the new
column from registers, so no program reads back what was written in the same step.

A window longer than ``SPLIT_COLUMNS`` is cut into shares run side by side (at a batch of 256
one program per (row, KV head) leaves most of the card's memory bandwidth unused), and a second
small kernel merges the shares' partial softmax sums. Elsewhere (CPU, no Triton) the same
arithmetic runs as plain torch operations.
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
SPLIT_COLUMNS = 64
"""Columns of the window one program walks at most (rounded up to whole blocks; see
``MAX_SPLITS``)."""
MAX_SPLITS = 16
"""The most shares a window is cut into: a longer window gives each share more columns."""


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


def window_shares(window: int) -> tuple[int, int]:
    """(shares, columns per share) for a window: shares of at most ``SPLIT_COLUMNS`` columns
    in whole blocks, and no more than ``MAX_SPLITS`` of them."""
    shares = min(MAX_SPLITS, max(1, -(-window // SPLIT_COLUMNS)))
    per_share = -(-(-(-window // shares)) // BLOCK_COLUMNS) * BLOCK_COLUMNS
    return -(-window // per_share), per_share


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
    shares, per_share = window_shares(window)
    # tl.dot needs 16 rows at least.
    block_group = max(16, triton.next_power_of_2(group))
    programs = batch * kv_heads
    # Partial results of each share (unused with one share: the kernel writes ``out``).
    best = torch.empty((programs, shares, block_group) if shares > 1 else (1,), dtype=torch.float32,
                       device=qkv.device)
    total = torch.empty_like(best)
    acc = torch.empty((programs, shares, block_group, head_dim) if shares > 1 else (1,), dtype=torch.float32,
                      device=qkv.device)
    _kernel[(programs, shares)](
        qkv, cos, sin, keys, values, column, valid, out, best, total, acc,
        qkv.stride(0), cos.stride(0), keys.stride(0), keys.stride(1), keys.stride(2),
        valid.stride(0), window, per_share, scaling,
        KV_HEADS=kv_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_GROUP=block_group,
        BLOCK_COLUMNS=BLOCK_COLUMNS, SHARES=shares, EXACT=qkv.dtype == torch.float32,
        num_warps=4, num_stages=2,
    )
    if shares > 1:
        _merge_kernel[(programs,)](best, total, acc, out, GROUP=group, HEAD_DIM=head_dim,
                                   BLOCK_GROUP=block_group, SHARES=shares, num_warps=4)
    return out


if triton is not None:
    EMPTY = tl.constexpr(-1.0e30)
    """The running maximum of a share that has seen no column yet: finite, so that an empty
    share's corrections stay exp2(0) = 1 and its weights exp2(-inf) = 0 (never inf - inf)."""

    @triton.jit
    def _dot(a, b, EXACT: tl.constexpr):
        # fp32 inputs get fp32 products (tl.dot would round them to tf32).
        if EXACT:
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _rotated(ptr, partner_ptr, cos, sin, sign, mask):
        # rotate-half: x * cos + (-x_hi, x_lo) * sin, the partner of dimension d being d +- half
        x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
        partner = tl.load(partner_ptr, mask=mask, other=0.0).to(tl.float32)
        return x * cos + sign * partner * sin

    @triton.jit
    def _kernel(qkv_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, column_ptr, valid_ptr, out_ptr,
                best_ptr, total_ptr, acc_ptr, qkv_stride, trig_stride, stride_row, stride_head,
                stride_column, valid_stride, window, per_share, scaling,
                KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_GROUP: tl.constexpr, BLOCK_COLUMNS: tl.constexpr, SHARES: tl.constexpr,
                EXACT: tl.constexpr):
        program = tl.program_id(0)
        share = tl.program_id(1)
        first = share == 0
        row = program // KV_HEADS
        head = program % KV_HEADS
        dtype = out_ptr.dtype.element_ty
        dims = tl.arange(0, HEAD_DIM)
        half: tl.constexpr = HEAD_DIM // 2
        partner = (dims + half) % HEAD_DIM
        sign = tl.where(dims < half, -1.0, 1.0)
        queries = tl.arange(0, BLOCK_GROUP)
        q_mask = queries[:, None] < GROUP
        heads = KV_HEADS * GROUP
        cos = tl.load(cos_ptr + row * trig_stride + dims).to(tl.float32)
        sin = tl.load(sin_ptr + row * trig_stride + dims).to(tl.float32)

        # The group's queries and the new key, rotated; the new value.
        q_base = qkv_ptr + row * qkv_stride + ((head * GROUP + queries) * HEAD_DIM)[:, None]
        rq = _rotated(q_base + dims[None, :], q_base + partner[None, :], cos[None, :], sin[None, :],
                      sign[None, :], q_mask).to(dtype)
        k_base = qkv_ptr + row * qkv_stride + (heads + head) * HEAD_DIM
        rk = _rotated(k_base + dims, k_base + partner, cos, sin, sign, dims < HEAD_DIM).to(dtype)
        v = tl.load(qkv_ptr + row * qkv_stride + (heads + KV_HEADS + head) * HEAD_DIM + dims)
        column = tl.load(column_ptr)
        cache = row * stride_row + head * stride_head
        mine = (dims < HEAD_DIM) & first
        tl.store(k_ptr + cache + column * stride_column + dims, rk, mask=mine)
        tl.store(v_ptr + cache + column * stride_column + dims, v, mask=mine)

        # exp2 instead of exp: fold log2(e) into the scale once. The first share starts from
        # the new column (always valid); the others from nothing.
        scale = scaling * 1.4426950408889634
        own = tl.sum(rq.to(tl.float32) * rk.to(tl.float32)[None, :], axis=1) * scale
        best = tl.where(first, own, EMPTY)
        total = tl.where(first, 1.0, 0.0) + tl.zeros((BLOCK_GROUP,), tl.float32)
        acc = tl.broadcast_to(v.to(tl.float32)[None, :], (BLOCK_GROUP, HEAD_DIM)) * tl.where(first, 1.0, 0.0)
        start = share * per_share
        stop = tl.minimum(start + per_share, window)
        for block in tl.range(start, stop, BLOCK_COLUMNS):
            columns = block + tl.arange(0, BLOCK_COLUMNS)
            valid = tl.load(valid_ptr + row * valid_stride + columns, mask=columns < stop, other=0) != 0
            valid = valid & (columns != column)
            offsets = cache + columns[:, None] * stride_column + dims[None, :]
            kc = tl.load(k_ptr + offsets, mask=valid[:, None], other=0.0)
            vc = tl.load(v_ptr + offsets, mask=valid[:, None], other=0.0)
            scores = _dot(rq, tl.trans(kc), EXACT) * scale
            scores = tl.where(valid[None, :], scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            weights = tl.exp2(scores - new_best[:, None])
            correction = tl.exp2(best - new_best)
            total = total * correction + tl.sum(weights, axis=1)
            acc = acc * correction[:, None] + _dot(weights.to(dtype), vc, EXACT)
            best = new_best
        if SHARES == 1:
            out = out_ptr + ((program * GROUP + queries) * HEAD_DIM)[:, None] + dims[None, :]
            tl.store(out, (acc / total[:, None]).to(dtype), mask=q_mask)
        else:
            part = (program * SHARES + share) * BLOCK_GROUP + queries
            tl.store(best_ptr + part, best)
            tl.store(total_ptr + part, total)
            tl.store(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=q_mask)

    @triton.jit
    def _merge_kernel(best_ptr, total_ptr, acc_ptr, out_ptr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BLOCK_GROUP: tl.constexpr, SHARES: tl.constexpr):
        # The shares' softmax sums rescaled to their common maximum, then added.
        program = tl.program_id(0)
        queries = tl.arange(0, BLOCK_GROUP)
        q_mask = queries[:, None] < GROUP
        dims = tl.arange(0, HEAD_DIM)
        best = tl.full((BLOCK_GROUP,), EMPTY, tl.float32)
        for share in tl.static_range(SHARES):
            best = tl.maximum(best, tl.load(best_ptr + (program * SHARES + share) * BLOCK_GROUP + queries))
        total = tl.zeros((BLOCK_GROUP,), tl.float32)
        acc = tl.zeros((BLOCK_GROUP, HEAD_DIM), tl.float32)
        for share in tl.static_range(SHARES):
            part = (program * SHARES + share) * BLOCK_GROUP + queries
            weight = tl.exp2(tl.load(best_ptr + part) - best)
            total += weight * tl.load(total_ptr + part)
            acc += weight[:, None] * tl.load(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=q_mask,
                                             other=0.0)
        out = out_ptr + ((program * GROUP + queries) * HEAD_DIM)[:, None] + dims[None, :]
        tl.store(out, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)
