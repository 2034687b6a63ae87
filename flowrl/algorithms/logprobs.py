"""Log-probabilities and entropies of tokens from logits, without a full fp32 copy.

``log_softmax(logits.float())`` over a whole rollout allocates ``N * T * V`` fp32 values
(2 GB for 32 x 512 tokens at a 32k vocabulary) and autograd keeps them until backward.
:func:`token_logprobs` walks the flattened positions in chunks of ``chunk_size`` rows, casts
one chunk at a time to fp32 and keeps only ``logsumexp`` per position (``N * T`` floats) for
the backward pass, which recomputes each chunk's softmax.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from flowrl.backends.compiled_layers import CompiledFunction

DEFAULT_CHUNK_SIZE = 1024
"""Positions (rows of the flattened ``[N * T, V]`` logits) per chunk: 1024 rows x 152k vocab
in fp32 is ~0.6 GB of scratch, small next to a model's activations."""


def _check(logits: Tensor, labels: Tensor, temperature: float, chunk_size: int) -> None:
    if logits.dim() != labels.dim() + 1 or logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} must be labels {tuple(labels.shape)} plus a vocab dim"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def _chunk_logprobs(scaled: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """(logsumexp, log-prob of each label) of one chunk of fp32 scaled logits ``[R, V]``;
    ``labels`` is ``[R, 1]``."""
    logsumexp = torch.logsumexp(scaled, dim=-1)
    return logsumexp, scaled.gather(-1, labels).squeeze(-1) - logsumexp


def _chunk_grad(scaled: Tensor, logsumexp: Tensor, labels: Tensor, scale: Tensor, hit: Tensor | None = None) -> Tensor:
    """Gradient in the scaled logits of one chunk, fp32: ``scale * (onehot(label) - softmax)``,
    since d/dz [z_label - logsumexp(z)] = onehot(label) - softmax(z), z = logits / t; ``labels``
    and ``scale`` (upstream gradient / t) are ``[R, 1]``. A chunk of some of the vocabulary's
    columns: ``labels`` are the column within the chunk, ``hit`` ``[R, 1]`` 1.0 where the row's
    label is one of the chunk's columns, else 0.0 (no onehot in that row)."""
    grad = torch.exp(scaled - logsumexp[:, None]).neg_()
    grad.scatter_add_(-1, labels, torch.ones_like(scale) if hit is None else hit)
    return grad.mul_(scale)


def _logits_forward(logits: Tensor, labels: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """(logsumexp, log-prob of each label) of one chunk of logits in any dtype."""
    return _chunk_logprobs(logits.to(torch.float32) / temperature, labels)


def _logits_forward_entropy(logits: Tensor, labels: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """(logsumexp, log-prob of each label, entropy of each row) of one chunk of logits:
    the entropy ``lse - sum(softmax(z) * z)`` comes from the same pass over the chunk."""
    scaled = logits.to(torch.float32) / temperature
    logsumexp, picked = _chunk_logprobs(scaled, labels)
    entropy = logsumexp - (torch.exp(scaled - logsumexp[:, None]) * scaled).sum(dim=-1)
    return logsumexp, picked, entropy


def _logits_backward(logits: Tensor, logsumexp: Tensor, labels: Tensor, grad_out: Tensor,
                     temperature: float, with_sum: bool, hit: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Gradient in one chunk of logits (their dtype) from the upstream gradient ``grad_out``
    ``[R, 1]`` fp32; with ``with_sum``, also its fp32 sum over the rows (a bias gradient);
    ``hit`` as for :func:`_chunk_grad`."""
    grad = _chunk_grad(logits.to(torch.float32) / temperature, logsumexp, labels, grad_out / temperature, hit)
    return grad.to(logits.dtype), grad.sum(dim=0) if with_sum else None


def _logits_backward_entropy(logits: Tensor, logsumexp: Tensor, entropy: Tensor, labels: Tensor, grad_out: Tensor,
                             grad_entropy: Tensor, temperature: float,
                             with_sum: bool, hit: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """:func:`_logits_backward` with an upstream gradient ``grad_entropy`` ``[R, 1]`` of the
    rows' entropies ``entropy`` ``[R]`` too: with p = softmax(z), dH/dz = -p * (z - lse + H)
    (H = -sum p log p and log p = z - lse), added to the log-prob's onehot - p."""
    scaled = logits.to(torch.float32) / temperature
    grad = _chunk_grad(scaled, logsumexp, labels, grad_out / temperature, hit)
    probs = torch.exp(scaled - logsumexp[:, None])
    grad -= (grad_entropy / temperature) * probs * (scaled - (logsumexp - entropy)[:, None])
    return grad.to(logits.dtype), grad.sum(dim=0) if with_sum else None


# On a GPU each chunk's cast, scaling, log-sum-exp and gather are one or two fused kernels
# instead of a pass over the fp32 chunk each (about a third of a small model's update time
# outside the matrix products, otherwise).
_chunk_forward = CompiledFunction(_logits_forward, "the log-prob chunks")
_chunk_forward_entropy = CompiledFunction(_logits_forward_entropy, "the log-prob and entropy chunks")
_chunk_backward = CompiledFunction(_logits_backward, "the log-prob chunk gradients")
_chunk_backward_entropy = CompiledFunction(_logits_backward_entropy, "the log-prob and entropy chunk gradients")


class _TokenLogprobs(torch.autograd.Function):
    """``log_softmax(logits / t)[label]`` computed chunk by chunk, backward recomputed."""

    @staticmethod
    def forward(
        ctx: Any, logits: Tensor, labels: Tensor, temperature: float, chunk_size: int
    ) -> Tensor:
        flat_logits = logits.reshape(-1, logits.shape[-1])
        flat_labels = labels.reshape(-1, 1)
        num_rows = flat_logits.shape[0]
        out = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
        logsumexp = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
        for start in range(0, num_rows, chunk_size):
            rows = slice(start, start + chunk_size)
            logsumexp[rows], out[rows] = _chunk_forward(flat_logits[rows], flat_labels[rows], temperature)
        ctx.save_for_backward(logits, labels, logsumexp)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        return out.view(labels.shape)

    @staticmethod
    def backward(
        ctx: Any, grad_out: Tensor
    ) -> tuple[Tensor | None, None, None, None]:
        logits, labels, logsumexp = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        flat_logits = logits.reshape(-1, logits.shape[-1])
        flat_labels = labels.reshape(-1, 1)
        flat_grad_out = grad_out.reshape(-1, 1).to(torch.float32)
        grad_logits = torch.empty_like(flat_logits)
        for start in range(0, flat_logits.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            grad_logits[rows] = _chunk_backward(flat_logits[rows], logsumexp[rows], flat_labels[rows],
                                                flat_grad_out[rows], temperature, False)[0]
        return grad_logits.view_as(logits), None, None, None


def token_logprobs(
    logits: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """Log-probability of each label under ``softmax(logits / temperature)``, in fp32.

    Equal to ``torch.log_softmax(logits.float() / temperature, -1).gather(-1, labels[..., None])``
    (TRL calls the same operation ``selective_log_softmax``) and differentiable with respect
    to ``logits``. ``logits`` is ``[N, T, V]`` (any float dtype) and ``labels`` ``[N, T]``
    holds valid token ids; padded positions need a valid id too (e.g. the pad id) and are
    masked by the caller. The sampling temperature must be the one used by generation, or the
    ratio to the old policy is wrong from the first step.
    """
    _check(logits, labels, temperature, chunk_size)
    result: Tensor = _TokenLogprobs.apply(
        logits, labels.long(), float(temperature), int(chunk_size)
    )
    return result


def token_entropy(
    logits: Tensor, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> Tensor:
    """Entropy of ``softmax(logits / temperature)`` at each position, ``[N, T]`` fp32.

    Meant for metrics (call it under ``torch.no_grad()``): with gradients on, autograd keeps
    each chunk's fp32 intermediates, so there is no memory saving.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    flat_logits = logits.reshape(-1, logits.shape[-1])
    chunks = []
    for start in range(0, flat_logits.shape[0], chunk_size):
        scaled = flat_logits[start : start + chunk_size].to(torch.float32) / temperature
        log_probs = torch.log_softmax(scaled, dim=-1)
        chunks.append(-(log_probs.exp() * log_probs).sum(dim=-1))
    if not chunks:
        return torch.zeros(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    return torch.cat(chunks).view(logits.shape[:-1])


FUSED_CHUNK_ELEMENTS = 1 << 26
"""Logits per chunk of :func:`linear_token_logprobs` (rows x vocabulary): 256 MB per fp32
scratch tensor whatever the vocabulary (2,097 rows at 32k, 441 at 152k). The backward's
chunks come on top of every activation of the pass (it runs first), so they stay bounded.

On an H100 (``benchmarks/fused_head.py``, commit ce77335, ``fused_head_h100_ce77335.json``),
forward and backward of a pass of 16,384 hidden states of 896 took 9.1 ms at a 32k vocabulary
and 49.3 ms at 152k in chunks of 2,096 and 440 rows (twice the rows of 2^25 logits, one fewer
than 2^26 gives), against 11.2 and 57.7 at 2^25 and 17.4 and 98.8 at half of it; the forward
alone 2.2 and 15.0 ms against 2.5 and 18.6."""


def fused_chunk_rows(vocab_size: int) -> int:
    """Rows per chunk of :func:`linear_token_logprobs` for a vocabulary of ``vocab_size``."""
    return max(64, FUSED_CHUNK_ELEMENTS // max(vocab_size, 1))


class _LinearTokenLogprobs(torch.autograd.Function):
    """``log_softmax((hidden @ weight.T + bias) / t)[label]`` chunk by chunk; the logits of a
    chunk exist only while that chunk is computed, in the forward (chunks of rows) and again in
    the backward (chunks of vocabulary columns over every row, from the forward's log-sum-exp)."""

    @staticmethod
    def forward(
        ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor,
        temperature: float, chunk_rows: int, with_entropy: bool,
    ) -> tuple[Tensor, Tensor | None]:
        num_rows = hidden.shape[0]
        out = torch.empty(num_rows, dtype=torch.float32, device=hidden.device)
        logsumexp = torch.empty(num_rows, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(num_rows, dtype=torch.float32, device=hidden.device) if with_entropy else None
        for start in range(0, num_rows, chunk_rows):
            rows = slice(start, start + chunk_rows)
            logits = F.linear(hidden[rows], weight, bias)
            if entropy is not None:
                logsumexp[rows], out[rows], entropy[rows] = _chunk_forward_entropy(logits, labels[rows, None],
                                                                                   temperature)
            else:
                logsumexp[rows], out[rows] = _chunk_forward(logits, labels[rows, None], temperature)
        ctx.save_for_backward(hidden, weight, bias, labels, logsumexp, entropy)
        ctx.temperature = temperature
        ctx.chunk_rows = chunk_rows
        # an output that the loss does not use gets None in backward, not a tensor of zeros
        ctx.set_materialize_grads(False)
        return out, entropy

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor | None, grad_entropy: Tensor | None = None) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, labels, logsumexp, entropy = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        temperature = ctx.temperature
        vocab = weight.shape[0]
        columns = backward_columns(hidden.shape[0], vocab, ctx.chunk_rows)
        # The backward walks the vocabulary, not the rows: each chunk of columns gives its
        # part of the weight (and bias) gradient whole, in one product over every row, and
        # adds a [R, H] part to the hidden states' gradient. By rows, every chunk would add
        # a whole [V, H] fp32 weight gradient: at a 152k vocabulary and hidden size 896,
        # 0.5 GB read and written per chunk of rows, most of the pass's time.
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_hidden else None
        grad_weight = torch.empty_like(weight) if need_weight else None
        grad_bias = torch.empty(vocab, dtype=torch.float32, device=weight.device) if need_bias else None
        upstream = (torch.zeros(hidden.shape[0], 1, dtype=torch.float32, device=hidden.device) if grad_out is None
                    else grad_out.to(torch.float32)[:, None])
        entropy_upstream = None if grad_entropy is None else grad_entropy.to(torch.float32)[:, None]
        for start in range(0, vocab, columns):
            part = slice(start, start + columns)
            width = min(columns, vocab - start)
            logits = F.linear(hidden, weight[part], None if bias is None else bias[part])
            local = labels - start
            hit = ((local >= 0) & (local < width)).to(torch.float32)[:, None]
            index = local.clamp(0, width - 1)[:, None]
            if entropy_upstream is None:
                grad_logits, column_sum = _chunk_backward(logits, logsumexp, index, upstream, temperature,
                                                          grad_bias is not None, hit)
            else:
                grad_logits, column_sum = _chunk_backward_entropy(
                    logits, logsumexp, entropy, index, upstream, entropy_upstream, temperature,
                    grad_bias is not None, hit)
            if grad_hidden is not None:
                grad_hidden += grad_logits @ weight[part]  # each part's product rounded once, summed in fp32
            if grad_weight is not None:
                grad_weight[part] = grad_logits.t() @ hidden
            if grad_bias is not None and column_sum is not None:
                grad_bias[part] = column_sum
        return (
            None if grad_hidden is None else grad_hidden.to(hidden.dtype),
            grad_weight,
            None if grad_bias is None else grad_bias.to(weight.dtype),
            None, None, None, None,
        )


COLUMN_MULTIPLE = 64
"""The backward's chunks of columns are a multiple of this many (where at least that many fit):
a chunk's [R, C] logits and gradient are operands of its products, and a row length that is no
multiple of 8 bf16 values leaves their rows unaligned for the card's fast kernels. On an H100,
16,384 rows at a 32k vocabulary in chunks of 2,046 columns took 18.3 ms per forward and
backward against 11.4 ms for 16,000 rows in chunks of 2,096; at 152k, 16,000 rows in chunks of
2,089 took 158 ms against 59 ms for 16,384 rows in chunks of 2,040
(``benchmarks/results/fused_head_h100_288ddb6.json``)."""


def backward_columns(rows: int, vocab: int, chunk_rows: int) -> int:
    """Vocabulary columns per chunk of the fused head's backward over ``rows`` rows: at most as
    many logits per chunk as the forward's chunks of ``chunk_rows`` rows hold (the same memory),
    rounded down to a multiple of ``COLUMN_MULTIPLE`` where that many fit."""
    columns = max(1, min(vocab, chunk_rows * vocab // max(rows, 1)))
    if columns >= COLUMN_MULTIPLE and columns < vocab:
        columns -= columns % COLUMN_MULTIPLE
    return columns


def linear_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    chunk_rows: int | None = None,
) -> Tensor:
    """Log-probability of each label under ``softmax((hidden @ weight.T + bias) / temperature)``.

    The output head and the log-softmax in one: equal to
    ``token_logprobs(F.linear(hidden, weight, bias), labels, temperature)`` but the
    full-vocabulary logits of all rows never exist, neither in the forward nor for the
    backward (which recomputes each chunk's logits from the saved ``hidden``). ``hidden`` is
    ``[R, H]``, ``weight`` ``[V, H]``, ``labels`` ``[R]``; the result is ``[R]`` fp32 and
    differentiable in ``hidden``, ``weight`` and ``bias``.
    """
    rows = _linear_chunk_rows(hidden, weight, labels, temperature, chunk_rows)
    result: tuple[Tensor, Tensor | None] = _LinearTokenLogprobs.apply(
        hidden, weight, bias, labels.long(), float(temperature), rows, False
    )
    return result[0]


def _linear_chunk_rows(hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float,
                       chunk_rows: int | None) -> int:
    """Rows per chunk, after checking the arguments of the fused head."""
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1] or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} must be [R, H], weight {tuple(weight.shape)} [V, H] "
            f"and labels {tuple(labels.shape)} [R]"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    rows = fused_chunk_rows(weight.shape[0]) if chunk_rows is None else chunk_rows
    if rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {rows}")
    return int(rows)


def linear_token_logprobs_and_entropy(
    hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None = None, temperature: float = 1.0,
    chunk_rows: int | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`linear_token_logprobs` and, from the same chunks, the entropy of each row's
    ``softmax(logits / temperature)`` ([R] fp32), both differentiable in ``hidden``,
    ``weight`` and ``bias`` (an entropy bonus); the backward recomputes each chunk's logits
    once for both."""
    rows = _linear_chunk_rows(hidden, weight, labels, temperature, chunk_rows)
    values, entropy = _LinearTokenLogprobs.apply(hidden, weight, bias, labels.long(), float(temperature), rows, True)
    return values, entropy
