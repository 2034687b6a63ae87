"""What each node has to do in one iteration: model, shape, sequences and lengths.

Every node but the generator works on the rollout it descends from, so its sequence
count and lengths are the generator's: ``data.batch_size * n`` completions of at most
``max_new_tokens`` after a prompt. Prompt length is estimated from the data source
(builtin prompts are 9 characters, one token each; a .jsonl file's prompts are read and
averaged) unless a ``prompt_tokens`` hint is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowrl.data.builtin import BUILTIN_DATASETS, BUILTIN_TASKS, PROMPT_LETTERS
from flowrl.data.files import load_split
from flowrl.errors import DataError
from flowrl.graph import PipelineGraph
from flowrl.planner.cost import ModelShape, adapted_weight_parameters, adapter_parameters, resolve_shape
from flowrl.spec.schema import GenerateNode, Output, UpdateNode, ValueNode, Work

CHARS_PER_TOKEN = 4.0
"""Characters per token of a subword tokenizer (English text); the builtin one uses 1."""
DEFAULT_PROMPT_TOKENS = 128
"""Prompt length assumed when the data cannot be read."""


@dataclass(frozen=True)
class NodeWork:
    """One node's work per iteration."""

    work: Work
    """What the node's role does (``_NodeBase.work``), which decides how it is priced."""
    output: Output
    """What its output holds per completion (``_NodeBase.output``)."""
    model: str | None
    """Model name, None for a function score or an advantage."""
    kind: str
    """Model kind (policy, value, reward); ``policy`` when there is no model."""
    dtype: str
    shape: ModelShape | None
    num_sequences: int
    """Completions processed: data.batch_size * n of the rollout."""
    prompt_tokens: int
    response_tokens: int
    """The rollout's max_new_tokens (completions are costed at full length)."""
    offload_to_cpu: bool = False
    checkpointing: bool = False
    sharded: bool = False
    """The model trains sharded over its update's devices (``ModelSpec.sharded``)."""
    adapter_parameters: int = 0
    """The parameters an update trains when the model has adapters (``ModelSpec.lora``), in
    the model's dtype; 0: every parameter is trained."""
    adapted_parameters: int = 0
    """Weights of the layers with adapters, of which generation keeps merged copies."""
    ppo_epochs: int = 1
    num_mini_batches: int = 1
    """Optimizer steps per epoch (update nodes)."""
    mini_batch_sequences: int = 1
    """Sequences per optimizer step (update nodes)."""
    micro_batch_tokens: int | None = None
    """Most padded tokens in one pass (update, reference_logprob, value); None: no limit."""
    group_size: int = 1
    """Samples per prompt of the rollout (its ``n``): generation prefills each prompt once,
    and a pass on a CPU that holds whole groups computes each prompt once."""
    old_outputs_pass: bool = False
    """An update that first runs a no-grad forward over its whole batch: a policy's log-probs
    before its first step when it takes several (epochs or mini-batches), a value model's
    values when no value node gives them (``roles.update``)."""

    @property
    def trained_parameters(self) -> int:
        """The parameters an update trains: the adapters', or every parameter of the model."""
        if self.adapter_parameters or self.shape is None:
            return self.adapter_parameters
        return self.shape.num_parameters(self.kind)

    def shares_prompts(self, on_cpu: bool) -> bool:
        """Whether this node's passes compute each prompt once per group: a policy's
        log-prob passes (reference, update) on a CPU, in one pass over the rows in rollout
        order (no token budget splitting them; for an update, one epoch of one mini-batch, the
        rows unshuffled, and no recomputed activations, whose passes run padded)."""
        single_step = self.num_mini_batches == 1 and self.ppo_epochs == 1 and not self.checkpointing
        in_order = self.micro_batch_tokens is None and (self.work != "train" or single_step)
        log_probs = self.kind == "policy" and self.work in ("forward", "train")
        return on_cpu and log_probs and self.group_size > 1 and in_order

    def rank_sequences(self, width: int, mini_batch: bool = False) -> int:
        """Sequences on the busiest of ``width`` ranks: of the whole batch, or of one of its
        mini-batches (``mini_batch``, an update's optimizer step). Ranks hold whole rows, so
        8 on 3 ranks is 3 on the busiest, which sets the step's passes and its peak; a
        generation's ranks hold whole prompts, so 2 prompts of 4 samples on 3 ranks is 4."""
        rows = min(self.num_sequences, self.mini_batch_sequences) if mini_batch else self.num_sequences
        if self.work == "decode" and self.group_size > 1:
            # generation splits whole prompts, each with its group's samples
            prompts = -(-rows // self.group_size)
            return -(-prompts // max(1, width)) * self.group_size
        return -(-rows // max(1, width))

    def pass_sequences(self, sequences: float) -> float:
        """Sequences of ``sequences`` that one pass holds at once (``micro_batch_tokens``
        of full-length rows; at least one row)."""
        if self.micro_batch_tokens is None:
            return sequences
        rows = max(1, self.micro_batch_tokens // max(1, self.prompt_tokens + self.response_tokens))
        return min(sequences, float(rows))


def node_work(
    pipeline: PipelineGraph, node: str, base_dir: Path | None = None,
    prompt_tokens: int | None = None,
) -> NodeWork:
    spec = pipeline.spec
    node_spec = spec.nodes[node]
    rollout = pipeline.rollout_of(node)
    assert rollout is not None  # validation guarantees every node a rollout
    rollout_spec = spec.nodes[rollout]
    assert isinstance(rollout_spec, GenerateNode)
    sequences = spec.data.batch_size * rollout_spec.n
    prompt = prompt_tokens if prompt_tokens is not None else estimate_prompt_tokens(pipeline, base_dir)
    model_name = node_spec.model
    model = spec.models[model_name] if model_name is not None else None
    shape = resolve_shape(model.path, base_dir) if model is not None else None
    mini_batches, mini_sequences = 1, sequences
    epochs = 1
    old_outputs_pass = False
    if isinstance(node_spec, UpdateNode):
        mini_sequences = min(node_spec.mini_batch_size or sequences, sequences)
        mini_batches = -(-sequences // mini_sequences)  # ceiling division
        epochs = node_spec.ppo_epochs
        if model is not None and model.kind == "value":
            old_outputs_pass = not any(isinstance(spec.nodes.get(producer), ValueNode)
                                       for producer in pipeline.producers(node))
        else:
            old_outputs_pass = epochs > 1 or mini_batches > 1
    return NodeWork(
        work=node_spec.work,
        output=node_spec.output,
        model=model_name,
        kind=model.kind if model is not None else "policy",
        dtype=model.dtype if model is not None else "fp32",
        shape=shape,
        num_sequences=sequences,
        prompt_tokens=prompt,
        response_tokens=rollout_spec.max_new_tokens,
        offload_to_cpu=bool(model and model.offload_to_cpu),
        checkpointing=bool(model and model.gradient_checkpointing),
        sharded=bool(model and model.sharded),
        adapter_parameters=(adapter_parameters(shape, model.lora.rank, model.lora.target_modules)
                            if model is not None and model.lora is not None and shape is not None else 0),
        adapted_parameters=(adapted_weight_parameters(shape, model.lora.target_modules)
                            if model is not None and model.lora is not None and shape is not None else 0),
        ppo_epochs=epochs,
        num_mini_batches=mini_batches,
        mini_batch_sequences=mini_sequences,
        micro_batch_tokens=_pass_budget(getattr(node_spec, "micro_batch_tokens", None)),
        group_size=rollout_spec.n,
        old_outputs_pass=old_outputs_pass,
    )


def _pass_budget(value: int | str | None) -> int | None:
    """A node's token budget per pass as planned: ``auto`` not resolved yet
    (``flowrl.planner.micro_batches``) counts as one row per pass, the least it can need."""
    return 1 if value == "auto" else (value if isinstance(value, int) else None)


def estimate_prompt_tokens(pipeline: PipelineGraph, base_dir: Path | None = None) -> int:
    """Mean prompt length in tokens, from the first rows of the data source."""
    spec = pipeline.spec
    source = spec.data.source
    character_level = all(model.path.startswith("builtin:") for model in spec.models.values())
    if source.startswith("builtin:") and source[len("builtin:"):] in BUILTIN_TASKS:
        return PROMPT_LETTERS + 1  # letters and "=", one token each
    try:
        location = source
        if source.startswith("builtin:"):
            location = str(BUILTIN_DATASETS[source[len("builtin:"):]](None))
        rows = load_split(location, spec.data.split, spec.data.subset, base_dir)
    except (DataError, KeyError):  # planning goes on with a default; a run reports the data's problem
        return DEFAULT_PROMPT_TOKENS
    if spec.data.prompt_key not in rows.column_names:  # likewise (datasets raises a plain ValueError)
        return DEFAULT_PROMPT_TOKENS
    sample = rows.select(range(min(len(rows), 1000)))[spec.data.prompt_key]
    chars = sum(_prompt_chars(prompt) for prompt in sample) / max(1, len(sample))
    per_token = 1.0 if character_level else CHARS_PER_TOKEN
    return max(1, round(chars / per_token))


def _prompt_chars(prompt: Any) -> int:
    if isinstance(prompt, list):  # a chat: its messages' text
        return sum(len(str(message.get("content", ""))) for message in prompt if isinstance(message, dict))
    return len(str(prompt or ""))
