"""Forward passes over a rollout's completion tokens: log-probabilities, and the window and
micro-batching that value heads share."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from flowrl.algorithms.logprobs import (
    linear_token_logprobs,
    linear_token_logprobs_and_entropy,
    token_entropy,
    token_logprobs,
)
from flowrl.backends.compiled_layers import run_compiled
from flowrl.backends.logits import transforms_logits
from flowrl.backends.packed_attention import can_pack, packed
from flowrl.backends.shared_prompt import shared_prompt_layout, shared_prompts
from flowrl.backends.transfer import to_device
from flowrl.roles.sharded import is_sharded
from flowrl.roles.batch import Rollout


@dataclass(frozen=True)
class CompletionWindow:
    """The columns of prompt + completion worth a forward pass.

    Trailing columns that are padding in every row (all samples stopped early) cost compute
    and give nothing: they are left out, and come back as zeros (masked downstream).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    prompt_length: int
    width: int
    """Completion columns computed."""
    num_columns: int
    """Completion columns of the rollout."""
    host_mask: torch.Tensor
    """``attention_mask`` on the host: what a pass decides from it (packing) and the indices
    it makes from it cost no wait for the device."""

    def completion_positions(self, per_position: torch.Tensor) -> torch.Tensor:
        """The outputs at the positions that predict each completion token (P-1 .. P+width-2)."""
        return per_position[:, self.prompt_length - 1 : self.prompt_length + self.width - 1]

    def pad(self, values: torch.Tensor) -> torch.Tensor:
        """[N, width] -> [N, num_columns], zeros on the columns left out."""
        if self.width < self.num_columns:
            values = torch.nn.functional.pad(values, (0, self.num_columns - self.width))
        return values


def completion_window(rollout: Rollout, device: torch.device) -> CompletionWindow:
    input_ids, attention_mask, position_ids = rollout.joined()
    # Leading prompt columns that are padding in every row are left out too (prompts are
    # left-padded): positions are explicit, so the remaining columns compute the same values.
    real_prompt_columns = rollout.prompt_mask.bool().any(dim=0)
    start = int(real_prompt_columns.long().argmax()) if bool(real_prompt_columns.any()) else 0
    prompt_length = rollout.prompt_ids.shape[1] - start
    width = max(int(rollout.completion_mask.sum(dim=1).max()), 1)
    end = start + prompt_length + width
    host_mask = attention_mask[:, start:end]
    return CompletionWindow(
        input_ids=to_device(input_ids[:, start:end], device),
        attention_mask=to_device(host_mask, device),
        position_ids=to_device(position_ids[:, start:end], device),
        prompt_length=prompt_length,
        width=width,
        num_columns=rollout.completion_ids.shape[1],
        host_mask=host_mask,
    )


def micro_batches(rollout: Rollout, max_tokens: int | None) -> list[torch.Tensor]:
    """Row indices of the forward passes over ``rollout``, at most ``max_tokens`` padded
    tokens each (rows x the widest row's prompt + completion); None: one pass of every row.

    Rows are sorted by length first, so each pass holds rows of similar length and the
    window of each pass (:func:`completion_window`) cuts away nearly all padding. A row
    longer than the budget gets a pass of its own.
    """
    num_rows = rollout.num_sequences
    if max_tokens is None or num_rows == 0:
        return [torch.arange(num_rows)]
    prompt_lengths = rollout.prompt_mask.sum(dim=1).tolist()
    completion_lengths = rollout.completion_mask.sum(dim=1).clamp(min=1).tolist()
    order = sorted(range(num_rows), key=lambda row: (prompt_lengths[row] + completion_lengths[row], row))
    groups: list[list[int]] = []
    widest_prompt = widest_completion = 0
    for row in order:
        prompt = max(widest_prompt, prompt_lengths[row])
        completion = max(widest_completion, completion_lengths[row])
        if groups and groups[-1] and (len(groups[-1]) + 1) * (prompt + completion) <= max_tokens:
            groups[-1].append(row)
        else:
            groups.append([row])
            prompt, completion = prompt_lengths[row], completion_lengths[row]
        widest_prompt, widest_completion = prompt, completion
    return [torch.tensor(group, dtype=torch.long) for group in groups]


def in_micro_batches(
    rollout: Rollout, max_tokens: int | None, compute: Callable[[Rollout], torch.Tensor]
) -> torch.Tensor:
    """``compute`` over the :func:`micro_batches` of ``rollout``, rows back in their order."""
    groups = micro_batches(rollout, max_tokens)
    if len(groups) == 1:
        return compute(rollout)
    parts = [compute(rollout.select(rows)) for rows in groups]
    order = to_device(torch.cat(groups), parts[0].device)
    joined = torch.cat(parts, dim=0)
    return torch.empty_like(joined).index_copy_(0, order, joined)


def completion_logprobs(
    module: torch.nn.Module,
    rollout: Rollout,
    device: torch.device,
    micro_batch_tokens: int | None = None,
) -> torch.Tensor:
    """[N, T] float32 log-probabilities of each completion token (padding included; mask it).

    Only the completion columns' logits become log-probabilities, and in row chunks, so the
    full-vocabulary float32 tensor of the whole batch never exists at once.
    """
    return in_micro_batches(rollout, micro_batch_tokens, lambda part: _logprobs(module, part, device, False)[0])


def completion_logprobs_and_entropy(
    module: torch.nn.Module, rollout: Rollout, device: torch.device, entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`completion_logprobs` of one pass and the entropy of the policy at each
    completion token ([N, T] float32, padding included: mask it). With ``entropy_grad`` the
    entropy is differentiable (an entropy bonus); otherwise only the fused head's is (at no
    cost unless a loss uses it) and a model without one gives a metric."""
    logprobs, entropy = _logprobs(module, rollout, device, True, entropy_grad)
    assert entropy is not None
    return logprobs, entropy


def _logprobs(module: torch.nn.Module, rollout: Rollout, device: torch.device,
              with_entropy: bool, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    window = completion_window(rollout, device)
    labels = to_device(rollout.completion_ids[:, : window.width], device)
    head = output_head(module)
    replaced = sharded_output_head(module) if head is None else None
    if head is None and replaced is None:
        logits = module(
            input_ids=window.input_ids,
            attention_mask=window.attention_mask,
            position_ids=window.position_ids,
            use_cache=False,
        ).logits
        completion = window.completion_positions(logits)
        logprobs = token_logprobs(completion, labels, temperature=rollout.temperature)
        entropy = None
        if with_entropy:
            # differentiable, autograd keeps each chunk's fp32 softmax: only when a loss reads it
            with contextlib.nullcontext() if entropy_grad else torch.no_grad():
                entropy = window.pad(token_entropy(completion, temperature=rollout.temperature))
        return window.pad(logprobs), entropy
    # The output head runs on the completion tokens only (not the prompt's positions, not the
    # padding after a row's end): the largest matrix product of the pass, and its logits are
    # never all in memory at once.
    # the indices are made on the host: on a GPU, nonzero() would wait for the device
    real = to_device(rollout.completion_mask[:, : window.width].reshape(-1).nonzero().squeeze(-1), device)
    real_labels = labels.reshape(-1).index_select(0, real)
    if replaced is not None:
        values, row_entropy = _sharded_fused_logprobs(module, window, real, real_labels, rollout.temperature,
                                                      with_entropy, entropy_grad, *replaced)
        return _unflatten(values, row_entropy, real, labels.shape, window, device)
    assert head is not None
    backbone, linear = head
    hidden = _completion_rows(_hidden_states(module, backbone, window), window, real)
    values, row_entropy = _fused_head(hidden, linear, real_labels, rollout.temperature, with_entropy)
    return _unflatten(values, row_entropy, real, labels.shape, window, device)


def _completion_rows(hidden: torch.Tensor, window: CompletionWindow, real: torch.Tensor) -> torch.Tensor:
    """[R, H]: the hidden states that predict the real completion tokens, from [N, L, H]."""
    picked = window.completion_positions(hidden)
    return picked.reshape(-1, picked.shape[-1]).index_select(0, real)


def _fused_head(hidden: torch.Tensor, linear: torch.nn.Linear, labels: torch.Tensor, temperature: float,
                with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fused output head on rows ``hidden`` [R, H]: log-probs [R] and, asked for, entropies."""
    arguments = (hidden, linear.weight, labels, linear.bias, temperature)
    if with_entropy:
        return linear_token_logprobs_and_entropy(*arguments)
    return linear_token_logprobs(*arguments), None


def _unflatten(values: torch.Tensor, row_entropy: torch.Tensor | None, real: torch.Tensor, shape: torch.Size,
               window: CompletionWindow, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropies) of the real completion tokens back to [N, T],
    zeros elsewhere."""
    flat = torch.zeros(shape.numel(), dtype=torch.float32, device=device).index_copy(0, real, values)
    entropy = None
    if row_entropy is not None:
        flat_entropy = torch.zeros(shape.numel(), dtype=torch.float32, device=device).index_copy(0, real, row_entropy)
        entropy = window.pad(flat_entropy.view(shape))
    return window.pad(flat.view(shape)), entropy


class _HeadStandIn(torch.nn.Module):
    """Takes a sharded model's output head's place for one pass: called with the last hidden
    states [N, L, H] (inside the model's forward, so its parameters are gathered), it returns
    the fused head's log-probs of the real completion tokens instead of every position's
    logits. The head stays out of this module's children: its parameters keep their place."""

    def __init__(self, compute: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.compute = compute

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute(hidden)


def _sharded_fused_logprobs(
    module: torch.nn.Module, window: CompletionWindow, real: torch.Tensor, labels: torch.Tensor,
    temperature: float, with_entropy: bool, entropy_grad: bool, name: str, linear: torch.nn.Linear,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A sharded (FSDP2) model's log-probs through the fused head. Its parameters are whole
    only inside its own forward (which gathers them, and whose backward gathers them again
    and reduce-scatters their gradients), so the forward runs as it is, with the output head
    ``module.<name>`` replaced for the pass by :class:`_HeadStandIn`: no logits of the whole
    vocabulary for every position, and the rows laid out as a whole model's pass lays them
    out (:func:`_pass_layout`). On a CPU that is a whole model's arithmetic to the last bit;
    on a GPU a whole model's decoder layers run compiled and a sharded model's eagerly, so
    their last bits may differ."""
    layout = _pass_layout(module, window, _recomputed(getattr(module, "base_model", module)))
    entropies: list[torch.Tensor] = []

    def compute(hidden: torch.Tensor) -> torch.Tensor:
        rows = _completion_rows(layout.unpack(hidden), window, real)
        values, row_entropy = _fused_head(rows, linear, labels, temperature, with_entropy)
        if row_entropy is None:
            return values
        if entropy_grad:
            # Both leave as the model's output, whose backward hooks gather the parameters
            # again before any gradient reaches the head.
            return torch.stack((values, row_entropy))
        entropies.append(row_entropy.detach())  # a metric: its backward never runs
        return values

    setattr(module, name, _HeadStandIn(compute))
    try:
        with layout.context:
            output = module(**layout.inputs, use_cache=False).logits
    finally:
        setattr(module, name, linear)
    if with_entropy and entropy_grad:
        return output[0], output[1]
    return output, entropies[0] if entropies else None


SHARE_PROMPTS_ABOVE = 0.1
"""A pass on a CPU computes each prompt shared by consecutive rows once (a GRPO group's
samples: ``flowrl.backends.shared_prompt``) when that leaves out at least this share of its
real tokens. On 2 cores, 4 prompts of 10 tokens x 8 samples of 32 tokens on
builtin:small-llama: the reference pass 81 -> 71 ms, the update's forward and backward
248 -> 206 ms."""
PACK_BELOW = 0.8
"""A pass is packed when its real tokens are fewer than this share of its padded tokens.
Below it, the tokens saved pay for what a packed pass costs on top: a compiled layer sees a
new sequence length every pass (compiled once more, for dynamic shapes) and the hidden
states are scattered back to the padded layout."""


def _hidden_states(module: torch.nn.Module, backbone: torch.nn.Module, window: CompletionWindow) -> torch.Tensor:
    """The backbone's last hidden states over ``window`` [N, L, H], laid out by
    :func:`_pass_layout` (at padding: zeros, or what a padded pass computed there; masked
    downstream). On a GPU the decoder layers run compiled
    (``flowrl.backends.compiled_layers``)."""
    recomputed = _recomputed(backbone)
    layout = _pass_layout(module, window, recomputed)

    def pass_() -> torch.Tensor:
        hidden: torch.Tensor = backbone(**layout.inputs, use_cache=False).last_hidden_state
        return hidden

    with layout.context:
        # The same recomputation rules out compiled layers: the backward would recompute
        # them eagerly, and the tensors saved would not match.
        hidden = pass_() if recomputed else run_compiled(module, pass_)
    return layout.unpack(hidden)


@dataclass
class _PassLayout:
    """How one pass lays out a window's rows: the model's inputs, the block to run it in (the
    attention it needs) and how its outputs [B, T, ...] go back to the window's [N, L, ...]."""

    inputs: dict[str, torch.Tensor]
    context: contextlib.AbstractContextManager[None]
    unpack: Callable[[torch.Tensor], torch.Tensor]


def _pass_layout(module: torch.nn.Module, window: CompletionWindow, recomputed: bool) -> _PassLayout:
    """A prompt repeated in consecutive rows is computed once (``SHARE_PROMPTS_ABOVE``). Else
    rows whose lengths differ much are packed (one row of every real token, each row
    attending to itself, positions restarting per row), so no layer computes padding. Else
    the rows as they are, padded."""
    real = window.host_mask.bool()
    lengths = real.sum(dim=1)
    # On CPUs only so far: on a GPU the padded and packed passes run flash-attention kernels,
    # against which the masked attention here has not been timed.
    if window.input_ids.device.type == "cpu" and not recomputed and can_pack(module):
        shared = shared_prompt_layout(window.input_ids, window.attention_mask, window.position_ids, window.prompt_length)
        if shared is not None and shared.saved_tokens >= SHARE_PROMPTS_ABOVE * float(lengths.sum()):
            return _PassLayout({"input_ids": shared.input_ids[None], "position_ids": shared.position_ids[None]},
                               shared_prompts(module, shared), lambda out: shared.unpack(out[0]))
    if recomputed or not (can_pack(module) and float(lengths.sum()) < PACK_BELOW * real.numel()):
        return _PassLayout(_padded_inputs(window, real), contextlib.nullcontext(), lambda out: out)

    rows, columns = real.shape
    index = to_device(real.reshape(-1).nonzero().squeeze(-1), window.input_ids.device)

    def scatter(out: torch.Tensor) -> torch.Tensor:
        whole = out.new_zeros((rows * columns, *out.shape[2:]))
        return whole.index_copy(0, index, out[0]).view(rows, columns, *out.shape[2:])

    return _PassLayout({"input_ids": window.input_ids.reshape(-1).index_select(0, index)[None],
                        "position_ids": window.position_ids.reshape(-1).index_select(0, index)[None]},
                       packed(module, [int(length) for length in lengths.tolist()]), scatter)


def _padded_inputs(window: CompletionWindow, real: torch.Tensor) -> dict[str, torch.Tensor]:
    """The model's inputs for a pass over the padded rows. When every row's real tokens come
    first (padding only after them), a causal model's real tokens never see the padding, so
    the pass goes without a mask, with positions counted on through the padding: the
    attention then runs its plain causal kernel. A mask, or a position repeated at the
    padding (which transformers reads as the start of another packed sequence), sends it to
    a masked kernel instead: on an H100 the 0.4B reference pass took 0.175 s with padded
    rows against 0.144 s with none (``benchmarks/results/planner_accuracy_h100_ce77335.json``,
    ``node_steps``)."""
    if bool((real[:, 1:] <= real[:, :-1]).all()):
        columns = torch.arange(window.input_ids.shape[1], device=window.input_ids.device)
        return {"input_ids": window.input_ids, "position_ids": columns.expand_as(window.input_ids)}
    return {"input_ids": window.input_ids, "attention_mask": window.attention_mask,
            "position_ids": window.position_ids}


def _recomputed(backbone: torch.nn.Module) -> bool:
    """Whether this pass's layers run again in its backward: with activation checkpointing,
    after the packed attention is switched off, so a pass that will be differentiated is not
    packed then."""
    return torch.is_grad_enabled() and _checkpointed(backbone)


def _checkpointed(backbone: torch.nn.Module) -> bool:
    # transformers 5 renamed the flag (the old name warns); either may be what the model has
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(backbone), name) or name in vars(backbone):
            return bool(getattr(backbone, name))
    return False


def sharded_output_head(module: torch.nn.Module) -> tuple[str, torch.nn.Linear] | None:
    """(attribute name, head) of a sharded causal LM whose logits are its head's plain
    product and whose head is one of its own attributes (``lm_head``), so that a pass can
    stand in for it (:func:`_sharded_fused_logprobs`); None for any other model."""
    if not is_sharded(module):
        return None
    head = _plain_head(module)
    if head is None:
        return None
    return next(((name, head) for name, child in module.named_children() if child is head), None)


def _plain_head(module: torch.nn.Module) -> torch.nn.Linear | None:
    """The model's output head when it is a Linear whose product is the logits; else None."""
    get_head = getattr(module, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, torch.nn.Linear) or transforms_logits(getattr(module, "config", None)):
        return None
    return head


def output_head(module: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear] | None:
    """(backbone, output head) of a causal LM whose logits are ``head(backbone(...))``, so the
    log-probs can skip the full logits; None for any other model."""
    if is_sharded(module):
        # A sharded model's parameters are gathered by its own forward only (the fused head
        # would read the head's weight outside it, as a shard): see sharded_output_head.
        return None
    backbone = getattr(module, "base_model", None)
    head = _plain_head(module)
    if backbone is None or backbone is module or head is None:
        return None
    return backbone, head
