"""The Triton kernels of a decode step (imported only where one runs: a CUDA device with
Triton installed). ``attention_kernel``: the attention of one share of the window for a
(row, KV head); ``merge_kernel``: the shares' partial softmax sums merged into the output
(``decode_attention``); ``product_kernel``: a block of a matrix product over one slice of its
inner dimension, or of the gated product of an MLP (``decode_products``)."""

from __future__ import annotations

import triton
import triton.language as tl

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
def attention_kernel(qkv_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, column_ptr, valid_ptr, out_ptr,
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
    partner = (dims + HEAD_DIM // 2) % HEAD_DIM
    sign = tl.where(dims < HEAD_DIM // 2, -1.0, 1.0)
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
    mine = dims + share * HEAD_DIM < HEAD_DIM  # every dimension, in the first share only
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
    # Bounds from the launch's arguments alone (the same count for every share; a last
    # share's columns past the window are masked): Triton's interpreter cannot take a loop
    # bound computed from the program's id.
    for block in tl.range(0, per_share, BLOCK_COLUMNS):
        columns = start + block + tl.arange(0, BLOCK_COLUMNS)
        valid = tl.load(valid_ptr + row * valid_stride + columns, mask=columns < stop, other=0) != 0
        valid = valid & (columns != column)
        # Only the valid columns are read: a batch's padding and the window's unwritten end
        # cost no memory traffic, and what they hold (stale, even non-finite after an
        # overflow) never enters.
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
def merge_kernel(best_ptr, total_ptr, acc_ptr, out_ptr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
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


@triton.jit(do_not_specialize=["rows", "split_stride"])  # batch sizes share a compile
def product_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, rows, outputs, per_split, x_stride, w_stride,
                   split_stride, out_stride, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                   EXACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    # out[split, m, n] = sum of x[m, k] * w[n, k] over the split's slice of k (``per_split``
    # columns, a whole number of blocks), plus bias[n] in split 0. GATED: w holds the gate
    # rows [0, outputs) and then the up rows [outputs, 2 outputs), and the block stores
    # silu(gate) * up from its two float32 sums (one split only).
    block_n = tl.program_id(0)
    split = tl.program_id(1)
    block_m = tl.program_id(2)
    ms = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = split * per_split + tl.arange(0, BLOCK_K)
    m_mask = ms < rows
    n_mask = ns < outputs
    x_block = x_ptr + ms[:, None] * x_stride + ks[None, :]
    # The weight's rows are outputs, contiguous along k: read as a [k, n] block.
    w_block = w_ptr + ns[None, :] * w_stride + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in tl.range(0, per_split, BLOCK_K):
        a = tl.load(x_block + k, mask=m_mask[:, None], other=0.0)
        b = tl.load(w_block + k, mask=n_mask[None, :], other=0.0)
        acc += _dot(a, b, EXACT)
        if GATED:
            u = tl.load(w_block + outputs * w_stride + k, mask=n_mask[None, :], other=0.0)
            up += _dot(a, u, EXACT)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + ns, mask=n_mask, other=0.0).to(tl.float32)
        acc += tl.where(split == 0, bias, 0.0)[None, :]
    if GATED:
        acc = acc * tl.sigmoid(acc) * up
    out = out_ptr + split * split_stride + ms[:, None] * out_stride + ns[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])
