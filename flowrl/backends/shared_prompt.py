"""Forward passes in which a prompt shared by consecutive rows (the samples of one GRPO group)
is computed once.

A rollout of G prompts with n samples each holds every prompt n times. Laid out for a
padded forward, each layer spends its matrix products on all n copies. Here the rows go into
one packed sequence instead: each group's prompt tokens once, then each of its rows'
completion tokens. A completion token attends to its group's prompt and to its own row's
earlier tokens, never to the other rows' completions, so every token gets the hidden state
it has in the padded forward; the positions are the rows' own. In the backward, the prompt's
tokens gather the gradients of all the rows that read them, as n copies would have.

The attention is dispatched by name through transformers' ``AttentionInterface``, as for
:mod:`flowrl.backends.packed_attention`, and is computed in two batched calls per layer: the
prompts (causal) and the completions (each row's queries over its prompt's keys and its own),
gathered from the packed sequence; the attention then costs what it costs on padded rows.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from flowrl.backends.packed_attention import attending_with

NAME = "flowrl_shared_prompt"
"""The attention implementation's registered name."""

_state = threading.local()


@dataclass(frozen=True)
class SharedPromptLayout:
    """Where each token of a padded [N, L] window sits in the packed sequence (length T)."""

    input_ids: torch.Tensor
    """[T]: each group's prompt tokens, then each of its rows' completion tokens."""
    position_ids: torch.Tensor
    """[T]: each token's position in its own row."""
    source: torch.Tensor
    """[N, L]: the packed index of each padded token (a repeated prompt token: its group's);
    T at padding (a zero row is appended there)."""
    prompt_index: torch.Tensor
    """[G, Pm]: packed indices of each group's prompt tokens, 0 after the last."""
    prompt_valid: torch.Tensor
    """[G, Pm] bool."""
    completion_index: torch.Tensor
    """[N, Cm]: packed indices of each row's completion tokens, 0 after the last."""
    completion_valid: torch.Tensor
    """[N, Cm] bool."""
    row_group: torch.Tensor
    """[N]: the group of each row."""
    prompt_mask: torch.Tensor
    """[G, 1, Pm, Pm] bool: what each prompt token attends to (the same in every layer)."""
    completion_mask: torch.Tensor
    """[N, 1, Cm, Pm + Cm] bool: what each completion token attends to, its group's prompt
    keys first."""
    saved_tokens: int
    """Prompt tokens the layout leaves out (the repeats)."""
    order: torch.Tensor
    """[T]: the packed index of each output of ``cat(prompt outputs, completion outputs)``
    inverted: ``outputs[order]`` is in packed order."""

    def unpack(self, packed_hidden: torch.Tensor) -> torch.Tensor:
        """[T, H] packed hidden states -> [N, L, H] padded, zeros at padding."""
        padded = torch.cat([packed_hidden, packed_hidden.new_zeros(1, packed_hidden.shape[-1])])
        return padded.index_select(0, self.source.reshape(-1)).view(*self.source.shape, -1)


def repeats_of_previous_row(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[N] bool: row ``i`` holds the same tokens and mask as row ``i - 1``."""
    repeat = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    if input_ids.shape[0] > 1:
        repeat[1:] = ((input_ids[1:] == input_ids[:-1]) & (attention_mask[1:] == attention_mask[:-1])).all(dim=1)
    return repeat


def prompt_groups(repeat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the first row of each group [G], the group of each row [N]) of rows that
    ``repeat`` (:func:`repeats_of_previous_row`) splits into runs."""
    starts = ~repeat
    return starts.nonzero().squeeze(1), starts.long().cumsum(0) - 1


def shared_prompt_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                         prompt_length: int) -> SharedPromptLayout | None:
    """The packed layout of a window whose first ``prompt_length`` columns are left-padded
    prompts and the rest right-padded completions; None when no prompt repeats or a row has
    no prompt token."""
    real = attention_mask.bool()
    prompt_real, completion_real = real[:, :prompt_length], real[:, prompt_length:]
    if prompt_length == 0 or not bool(prompt_real.any(dim=1).all()):
        return None
    repeat = repeats_of_previous_row(input_ids[:, :prompt_length], attention_mask[:, :prompt_length])
    if not bool(repeat.any()):
        return None
    # A token is packed unless it is padding or a repeat of the row before's prompt; row-major
    # order then gives each group's prompt followed by its rows' completions.
    kept = real.clone()
    kept[:, :prompt_length] &= ~repeat[:, None]
    flat_kept = kept.reshape(-1)
    total = int(flat_kept.sum())
    packed_at = (flat_kept.long().cumsum(0) - 1).view_as(kept)
    first_row, row_group = prompt_groups(repeat)
    source = torch.where(kept, packed_at, torch.full_like(packed_at, total))
    # a repeated prompt reads its group's first row's tokens
    shared = packed_at[first_row[row_group], :prompt_length]
    source[:, :prompt_length] = torch.where(prompt_real, shared, torch.full_like(shared, total))

    prompt_lengths = prompt_real[first_row].sum(dim=1)
    completion_lengths = completion_real.sum(dim=1)
    prompt_index, prompt_valid = _left_aligned(packed_at[first_row, :prompt_length], prompt_real[first_row], prompt_lengths)
    completion_index, completion_valid = _left_aligned(packed_at[:, prompt_length:], completion_real, completion_lengths)
    outputs_at = torch.cat([prompt_index[prompt_valid], completion_index[completion_valid]])
    width, c_width = prompt_index.shape[1], completion_index.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=input_ids.device).tril()
    own = torch.ones(c_width, c_width, dtype=torch.bool, device=input_ids.device).tril()[None] & completion_valid[:, None, :]
    sees_prompt = prompt_valid.index_select(0, row_group)[:, None, :].expand(-1, c_width, -1)
    return SharedPromptLayout(
        input_ids=input_ids.reshape(-1)[flat_kept],
        position_ids=position_ids.reshape(-1)[flat_kept],
        source=source,
        prompt_index=prompt_index,
        prompt_valid=prompt_valid,
        completion_index=completion_index,
        completion_valid=completion_valid,
        row_group=row_group,
        # A padding query of a prompt sees key 0 (every prompt has one): finite, never read.
        prompt_mask=(causal[None] & prompt_valid[:, None, :])[:, None],
        completion_mask=torch.cat([sees_prompt, own], dim=2)[:, None],
        saved_tokens=int(prompt_real[repeat].sum()),
        order=torch.argsort(outputs_at),
    )


def _left_aligned(index: torch.Tensor, valid: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's valid entries of ``index`` moved to the front ([R, max length]), 0 after."""
    width = max(int(lengths.max()), 1) if lengths.numel() else 1
    aligned_valid = torch.arange(width, device=index.device)[None, :] < lengths[:, None]
    aligned = torch.zeros(index.shape[0], width, dtype=index.dtype, device=index.device)
    aligned[aligned_valid] = index[valid]
    return aligned, aligned_valid


def _layout() -> SharedPromptLayout | None:
    layout: SharedPromptLayout | None = getattr(_state, "layout", None)
    return layout


def _gather(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[1, heads, T, D] -> [R, heads, W, D] for an [R, W] index of packed positions."""
    picked = tensor[0].index_select(1, index.reshape(-1))
    return picked.view(tensor.shape[1], *index.shape, tensor.shape[-1]).transpose(0, 1)


@torch.compiler.disable
def _shared_prompt_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Query [1, heads, T, D], key and value [1, kv_heads, T, D] in the packed order of the
    active layout; returns [1, T, heads, D] as transformers' attention functions do."""
    layout = _layout()
    if layout is None:
        raise RuntimeError("shared-prompt attention called outside flowrl.backends.shared_prompt.shared_prompts()")
    gqa = query.shape[1] != key.shape[1]
    p_index, p_valid = layout.prompt_index, layout.prompt_valid
    c_index, c_valid = layout.completion_index, layout.completion_valid
    prompt_keys, prompt_values = _gather(key, p_index), _gather(value, p_index)
    prompt_out = F.scaled_dot_product_attention(
        _gather(query, p_index), prompt_keys, prompt_values,
        attn_mask=layout.prompt_mask, scale=scaling, enable_gqa=gqa)
    group = layout.row_group
    keys = torch.cat([prompt_keys.index_select(0, group), _gather(key, c_index)], dim=2)
    values = torch.cat([prompt_values.index_select(0, group), _gather(value, c_index)], dim=2)
    completion_out = F.scaled_dot_product_attention(
        _gather(query, c_index), keys, values,
        attn_mask=layout.completion_mask, scale=scaling, enable_gqa=gqa)
    # [R, heads, W, D] -> the valid rows' [tokens, heads, D], then packed order
    outputs = torch.cat([prompt_out.transpose(1, 2)[p_valid], completion_out.transpose(1, 2)[c_valid]])
    return outputs.index_select(0, layout.order)[None], None


@contextlib.contextmanager
def shared_prompts(module: torch.nn.Module, layout: SharedPromptLayout) -> Iterator[None]:
    """Run ``module`` on ``layout``'s packed sequence inside this block: the caller passes
    ``input_ids`` [1, T] and ``position_ids`` [1, T] from the layout, and no attention mask."""
    _state.layout = layout
    try:
        with attending_with(module, NAME, _shared_prompt_attention):
            yield
    finally:
        _state.layout = None
