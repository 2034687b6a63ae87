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

import importlib.util
from typing import Any

import torch
import torch.nn.functional as F

BLOCK_COLUMNS = 64
"""Cached columns one loop iteration of the kernel reads."""
SPLIT_COLUMNS = 128
"""Columns of the window one program walks at most (rounded up to whole blocks; see
``MAX_SPLITS``). On an H100 at a batch of 256 (0.4B shape, windows up to 160 columns), the
attention and merge kernels took at most 0.25 ms per decode step with 128 against 0.28 ms
with 64 and 0.33 ms with 32: fewer, longer programs, and fewer windows that need the merge."""
MAX_SPLITS = 16
"""The most shares a window is cut into: a longer window gives each share more columns."""


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions (rotate-half form, as transformers' Llama and Qwen2)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def triton_usable(qkv: torch.Tensor, head_dim: int) -> bool:
    """True when the Triton kernel can run: a CUDA tensor and a head size that is a power of
    two (a head is one ``tl.arange`` block) of at least 32, the smallest the kernel is tested at
    (``tl.dot`` itself needs 16)."""
    return qkv.is_cuda and head_dim >= 32 and head_dim & (head_dim - 1) == 0 and _has_triton()


def _has_triton() -> bool:
    # Triton ships with CUDA builds of torch; CPU builds may lack it. The kernels' module
    # imports it when a kernel first runs.
    return importlib.util.find_spec("triton") is not None


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
    kernel, merge_kernel = _kernels()
    # tl.dot needs 16 rows at least.
    block_group = max(16, 1 << (group - 1).bit_length())
    programs = batch * kv_heads
    # Partial results of each share (unused with one share: the kernel writes ``out``).
    best = torch.empty((programs, shares, block_group) if shares > 1 else (1,), dtype=torch.float32,
                       device=qkv.device)
    total = torch.empty_like(best)
    acc = torch.empty((programs, shares, block_group, head_dim) if shares > 1 else (1,), dtype=torch.float32,
                      device=qkv.device)
    kernel[(programs, shares)](
        qkv, cos, sin, keys, values, column, valid, out, best, total, acc,
        qkv.stride(0), cos.stride(0), keys.stride(0), keys.stride(1), keys.stride(2),
        valid.stride(0), window, per_share, scaling,
        KV_HEADS=kv_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_GROUP=block_group,
        BLOCK_COLUMNS=BLOCK_COLUMNS, SHARES=shares, EXACT=qkv.dtype == torch.float32,
        num_warps=4, num_stages=2,
    )
    if shares > 1:
        merge_kernel[(programs,)](best, total, acc, out, GROUP=group, HEAD_DIM=head_dim,
                                   BLOCK_GROUP=block_group, SHARES=shares, num_warps=4)
    return out


def _kernels() -> tuple[Any, Any]:
    """The Triton kernels (the attention of each share, the merge of the shares), imported
    on first use (``decode_kernels``)."""
    from flowrl.backends import decode_kernels

    return decode_kernels.attention_kernel, decode_kernels.merge_kernel
