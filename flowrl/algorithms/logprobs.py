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
from torch import Tensor

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
            scaled = flat_logits[rows].to(torch.float32) / temperature
            logsumexp[rows] = torch.logsumexp(scaled, dim=-1)
            out[rows] = scaled.gather(-1, flat_labels[rows]).squeeze(-1) - logsumexp[rows]
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
            scaled = flat_logits[rows].to(torch.float32) / temperature
            # d/dz [z_label - logsumexp(z)] = onehot(label) - softmax(z); z = logits / t
            grad = -torch.exp(scaled - logsumexp[rows].unsqueeze(-1))
            grad.scatter_add_(-1, flat_labels[rows], torch.ones_like(flat_grad_out[rows]))
            grad_logits[rows] = (grad * (flat_grad_out[rows] / temperature)).to(grad_logits.dtype)
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
