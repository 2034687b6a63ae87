"""Batched sampling from a causal LM with a KV cache, without ``model.generate``.

One prefill forward over the left-padded prompts, then one forward per new token on the
cached keys and values. Everything per token stays on the model's device: sampling uses the
exponential-race trick (``argmax(probs / E)`` with ``E ~ Exponential(1)``, equivalent to
drawing from ``probs``), finished rows are masked with tensor ops, and the only host sync is
the "has every row finished?" check that lets the loop stop early.

Why not ``model.generate``: it runs a stack of logits processors, stopping criteria and
input-preparation hooks on every token; for the small models of an RL loop that Python is a
large share of a step, and this loop does only what rollouts need.

Log-probabilities: ``sampled_logprobs`` is the log-probability of each chosen token under the
temperature-scaled distribution ``softmax(logits / temperature)`` BEFORE top-k/top-p
filtering. That is the quantity a trainer recomputes from the same weights (a full forward
divided by the temperature), so the old/new policy ratio is 1 for unchanged weights, even
though the token was drawn from the truncated distribution.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel


@dataclass(frozen=True)
class GenerationOutput:
    """The completions of one batch; T is the number of decode steps actually run."""

    completion_ids: torch.Tensor
    """LongTensor [B, T]: generated tokens, the eos kept, pad after it (right padding)."""
    completion_mask: torch.Tensor
    """LongTensor [B, T]: 1 for generated tokens up to and including eos, 0 after."""
    num_decode_steps: int
    """T: forward passes that produced a token (stops early once every row hit eos)."""
    sampled_logprobs: torch.Tensor
    """Float32 [B, T]: log-prob of each token under softmax(logits / temperature), before
    top-k/top-p filtering; 0 where the mask is 0."""


def generate_tokens(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
    eos_token_id: int | Sequence[int],
    pad_token_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
) -> GenerationOutput:
    """Sample up to ``max_new_tokens`` tokens for each left-padded prompt row; a row ends with
    the first of the ``eos_token_id`` tokens it samples (one id or several).

    ``greedy`` takes the most likely token (temperature, top-k and top-p do not change the
    choice). ``generator`` drives the sampling noise, so a seeded generator on the model's
    device makes sampling reproducible.
    """
    check_arguments(input_ids, attention_mask, max_new_tokens, temperature, top_p, top_k)
    batch_size, prompt_length = input_ids.shape
    device = input_ids.device
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode(), decode_threads(model, batch_size, device):
            return _decode_loop(
                model, input_ids, attention_mask.to(torch.long), batch_size, prompt_length,
                max_new_tokens, stop_ids(eos_token_id), pad_token_id, temperature, top_p, top_k,
                greedy, generator, device,
            )
    finally:
        model.train(was_training)


def stop_ids(eos_token_id: int | Sequence[int]) -> tuple[int, ...]:
    """The ids that end a row, from one id or several (a generation config's list)."""
    ids = (eos_token_id,) if isinstance(eos_token_id, int) else tuple(int(token) for token in eos_token_id)
    if not ids:
        raise ValueError("generation needs at least one eos token id to stop at")
    return ids


def is_stop(tokens: torch.Tensor, ids: tuple[int, ...]) -> torch.Tensor:
    """Where ``tokens`` is one of ``ids``: comparisons with constants, so a captured CUDA
    graph holds them as they are and the host never waits for the device."""
    hit = tokens == ids[0]
    for token in ids[1:]:
        hit |= tokens == token
    return hit


SMALL_DECODE_MACS = 1 << 22
"""Multiply-adds of one MLP product of one decode step (rows x hidden x MLP width) below
which a CPU decode runs on one thread: a thread pool's start and join on every product costs
more than the second core gives. Measured on 2 cores in grpo_tiny runs (OpenMP's default
wait): builtin:tiny-llama (32 x 128 x 512 = 2.1 M) samples 16 tokens in 37-41 ms on one thread
against 38-48 ms on two; builtin:small-llama (8.4 M) 32 tokens in 0.29-0.30 s on one against
0.24-0.26 s on two."""


@contextlib.contextmanager
def decode_threads(model: PreTrainedModel, rows: int, device: torch.device) -> Iterator[None]:
    """One torch thread for the decode of a small model on a CPU (``SMALL_DECODE_MACS``),
    the process's setting again afterwards."""
    config = getattr(model, "config", None)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    width = int(getattr(config, "intermediate_size", 0) or 4 * hidden)
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1 or not hidden or rows * hidden * width >= SMALL_DECODE_MACS:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _decode_loop(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    batch_size: int,
    prompt_length: int,
    max_new_tokens: int,
    eos_token_ids: tuple[int, ...],
    pad_token_id: int,
    temperature: float,
    top_p: float,
    top_k: int,
    greedy: bool,
    generator: torch.Generator | None,
    device: torch.device,
) -> GenerationOutput:
    """The prefill and per-token loop; tensors are preallocated so each step only indexes."""
    cache_argument = _cache_argument_name(model)
    cache = _new_cache(model)
    # The full mask is allocated once and sliced per step instead of concatenated per step.
    # Finished rows keep attending (mask 1) and are fed pad tokens, as model.generate does.
    full_mask = torch.ones(batch_size, prompt_length + max_new_tokens, dtype=torch.long,
                           device=device)
    full_mask[:, :prompt_length] = attention_mask
    # Left padding: a row's first real token is position 0; pad positions are masked anyway.
    position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    completion_ids = torch.full((batch_size, max_new_tokens), pad_token_id, dtype=torch.long,
                                device=device)
    completion_mask = torch.zeros(batch_size, max_new_tokens, dtype=torch.long, device=device)
    sampled_logprobs = torch.zeros(batch_size, max_new_tokens, dtype=torch.float32,
                                   device=device)
    unfinished = torch.ones(batch_size, dtype=torch.bool, device=device)

    step_input = input_ids
    num_decode_steps = 0
    for step in range(max_new_tokens):
        outputs = model(
            input_ids=step_input,
            attention_mask=full_mask[:, : prompt_length + step],
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **{cache_argument: cache},
        )
        logits = outputs.logits[:, -1, :].float()
        tokens, logprobs = sample_next_token(logits, temperature, top_p, top_k, greedy, generator)
        tokens = torch.where(unfinished, tokens, pad_token_id)
        completion_ids[:, step] = tokens
        completion_mask[:, step] = unfinished
        sampled_logprobs[:, step] = logprobs.masked_fill(~unfinished, 0.0)
        unfinished &= ~is_stop(tokens, eos_token_ids)
        num_decode_steps = step + 1
        if not bool(unfinished.any()):
            break
        step_input = tokens[:, None]
        position_ids = position_ids[:, -1:] + 1

    return GenerationOutput(
        completion_ids=completion_ids[:, :num_decode_steps],
        completion_mask=completion_mask[:, :num_decode_steps],
        num_decode_steps=num_decode_steps,
        sampled_logprobs=sampled_logprobs[:, :num_decode_steps],
    )


def sample_next_token(
    logits: torch.Tensor,
    temperature: float | torch.Tensor,
    top_p: float,
    top_k: int,
    greedy: bool,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of ``logits`` [B, V] (fp32); return (tokens, their log-probs).

    The log-probs are under softmax(logits / temperature), before any filtering.
    """
    noise = None if greedy else torch.empty_like(logits).exponential_(generator=generator)
    return sample_with_noise(logits, temperature, top_p, top_k, noise)


def sample_with_noise(
    logits: torch.Tensor,
    temperature: float | torch.Tensor,
    top_p: float,
    top_k: int,
    noise: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample_next_token` with its randomness given: ``noise`` [B, V] holds Exp(1)
    draws (None: greedy). No generator inside, so ``torch.compile`` can fuse it whole."""
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    if noise is None:
        tokens = logprobs.argmax(dim=-1)
    else:
        filtered = filter_top_k_top_p(logprobs, top_k, top_p)
        # Exponential race: argmax(p_i / E_i), E_i ~ Exp(1), picks i with probability p_i.
        # In log space: argmax(log p_i - log E_i); filtered tokens have log p = -inf.
        tokens = (filtered - noise.log()).argmax(dim=-1)
    chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, chosen


def filter_top_k_top_p(logprobs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set to -inf every token outside the top-k and outside the top-p nucleus.

    The nucleus is the smallest set of most likely tokens whose probability reaches ``top_p``;
    the most likely token is always kept, so a tiny ``top_p`` means greedy.
    """
    vocab_size = logprobs.shape[-1]
    if top_k > 0 and top_k < vocab_size:
        kth_largest = torch.topk(logprobs, top_k, dim=-1).values[:, -1:]
        logprobs = logprobs.masked_fill(logprobs < kth_largest, float("-inf"))
    if top_p < 1.0:
        sorted_logprobs, order = torch.sort(logprobs, dim=-1, descending=True)
        sorted_probs = sorted_logprobs.exp()
        # Probability mass strictly before each token; a token is dropped when the tokens
        # ahead of it already reach top_p (so the first token always stays).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logprobs = logprobs.masked_fill(drop, float("-inf"))
    return logprobs


def check_arguments(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
) -> None:
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids and attention_mask must both be [batch, prompt_length]; got "
            f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}"
        )
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (use greedy=True for argmax), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")


def _cache_argument_name(model: PreTrainedModel) -> str:
    """transformers 5 names the forward argument ``cache``; 4.x named it ``past_key_values``."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _new_cache(model: PreTrainedModel) -> DynamicCache:
    try:
        return DynamicCache(config=model.config)
    except TypeError:  # transformers before 4.56 took no config
        return DynamicCache()
