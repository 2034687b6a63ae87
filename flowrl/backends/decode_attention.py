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

When a batch has too few (row, KV head) programs to keep the card's processors busy (a small
batch; at a batch of 64 there are enough), each window is cut into shares run side by
side, and a second small kernel merges the shares' partial softmax sums. Elsewhere (CPU, no
Triton) the same arithmetic runs as plain torch operations.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch
import torch.nn.functional as F

BLOCK_COLUMNS = 64
"""Cached columns one loop iteration of the kernel reads."""
NUM_WARPS = 4
NUM_STAGES = 2
"""The attention kernel's launch: warps per program, and loads in flight in its loop over
blocks (Triton's software pipelining)."""
MIN_SHARE_COLUMNS = 128
"""The fewest columns a share of a cut window is given (rounded up to whole blocks): on an
H100 at a batch of 256 with windows up to 160 columns, shares of 128 took 0.25 ms per decode
step against 0.28 ms with 64 and 0.33 ms with 32."""
MAX_SPLITS = 16
"""The most shares a window is cut into: a longer window gives each share more columns."""
CUT_BELOW = 0.5
"""A window is cut only while the batch has fewer (row, KV head) programs than this many per
processor of the card. An uncut window needs no merge kernel and no float32 partial sums. On an
H100 (132 processors), over the decode steps of a 32 + 256-token generation, the attention of a
layer took 6.1, 7.2 and 9.0 us uncut at batches of 64, 128 and 256 (128 to 512 programs)
against 6.3, 7.7 and 12.8 us in shares of 128 columns (``benchmarks/decode_attention.py``,
``benchmarks/results/decode_attention_h100.json``)."""
FILL_PER_PROCESSOR = 2
"""A window that is cut is cut into as many shares as give every processor this many programs
(within ``MIN_SHARE_COLUMNS`` and ``MAX_SPLITS``)."""


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions (rotate-half form, as transformers' Llama and Qwen2)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def triton_usable(qkv: torch.Tensor, head_dim: int) -> bool:
    """True when the Triton kernel can run: a CUDA tensor and a head size that is a power of
    two (a head is one ``tl.arange`` block) of at least 32, the smallest the kernel is tested at
    (``tl.dot`` itself needs 16)."""
    return qkv.is_cuda and head_dim >= 32 and head_dim & (head_dim - 1) == 0 and has_triton()


def has_triton() -> bool:
    """Whether Triton is installed. It ships with CUDA builds of torch; CPU builds may lack
    it. The kernels' module (``decode_kernels``) imports it when a kernel first runs."""
    return importlib.util.find_spec("triton") is not None


def decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor, column: torch.Tensor, key_valid: torch.Tensor,
                     scaling: float, all_written: bool = False) -> torch.Tensor:
    """Attention of one new token per row.

    ``qkv`` [B, (heads + 2 kv_heads) * head_dim]: the new token's queries, key and value side by
    side; ``cos`` / ``sin`` [B, head_dim]: the rotary rows of each row's position;
    ``keys`` / ``values`` [B, kv_heads, W, head_dim]: the cache window (views into a larger
    cache, last dimension contiguous), whose column ``column`` ([1], long) receives the new
    key and value; ``key_valid`` [B, W] (bool): the columns each row attends to, the new one
    included. Returns [B, kv_heads, heads per kv head, head_dim]. ``all_written``: every
    column of the window was written in this generation (none holds a stale value).
    """
    head_dim = keys.shape[-1]
    if triton_usable(qkv, head_dim):
        return _triton_attention(qkv, cos, sin, keys, values, column, key_valid, scaling)
    return _plain_attention(qkv, cos, sin, keys, values, column, key_valid, scaling, all_written)


def _plain_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor, column: torch.Tensor, key_valid: torch.Tensor,
                     scaling: float, all_written: bool = False) -> torch.Tensor:
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
    # A column not attended to may hold a stale non-finite key or value (an overflow in an
    # earlier generation): masked by the bias alone it would still make the row NaN. A window
    # written whole in this generation (a CPU's, which ends at the last column written) holds
    # none, and is not copied: on 2 cores the copies were 15 % of builtin:tiny-llama's
    # generation of 32 rows x 16 tokens.
    if not all_written:
        hidden = ~key_valid[:, None, :, None]
        keys, values = keys.masked_fill(hidden, 0.0), values.masked_fill(hidden, 0.0)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias[:, None, None, :], scale=scaling)


def window_shares(window: int, programs: int, processors: int) -> tuple[int, int]:
    """(shares, columns per share) for a window attended by ``programs`` (row, KV head)
    programs on a card of ``processors``: one share unless the programs are too few
    (``CUT_BELOW``); then enough shares to give every processor ``FILL_PER_PROCESSOR``
    programs, each of at least ``MIN_SHARE_COLUMNS`` columns, no more than ``MAX_SPLITS``. The
    shares are whole blocks."""
    shares = 1
    if programs < CUT_BELOW * processors:
        wanted = -(-FILL_PER_PROCESSOR * processors // max(programs, 1))
        shares = max(1, min(MAX_SPLITS, -(-window // MIN_SHARE_COLUMNS), wanted))
    per_share = -(-(-(-window // shares)) // BLOCK_COLUMNS) * BLOCK_COLUMNS
    return -(-window // per_share), per_share


def processor_count(device: torch.device) -> int:
    """The card's streaming multiprocessors (1 off CUDA: Triton's interpreter on a CPU)."""
    if device.type != "cuda":
        return 1
    return _cuda_processors(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _cuda_processors(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


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
    programs = batch * kv_heads
    shares, per_share = window_shares(window, programs, processor_count(qkv.device))
    kernel, merge_kernel = _kernels()
    # tl.dot needs 16 rows at least.
    block_group = max(16, 1 << (group - 1).bit_length())
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
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
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
