"""The ``generate`` role: sample ``n`` completions for each prompt."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch
from transformers import PreTrainedModel

from flowrl.backends.generation import GenerationOutput, generate_tokens
from flowrl.backends.hf import embedding_rows, stop_token_ids
from flowrl.backends.static_decode import decoder_for, unsupported_reason
from flowrl.errors import FlowrlError
from flowrl.roles.batch import NodeOutput, Rollout
from flowrl.roles.state import ModelState
from flowrl.roles.texts import LaterTexts, decode_texts, token_rows


def run_generate(
    state: ModelState, prompts: Sequence[Any], node: Any, generator: torch.Generator | None = None, greedy: bool = False
) -> NodeOutput:
    """Sample ``node.n`` completions per prompt; ``prompts`` are data-source examples.

    ``generator`` replaces the model's own sampling RNG (an evaluation must not move the
    training run's stream); ``greedy`` takes the likeliest token at every position.
    """
    tokenizer = state.tokenizer
    rows = [example for example in prompts for _ in range(node.n)]
    texts = [example.prompt for example in rows]
    answers = [example.answer for example in rows]
    prompt_ids, prompt_mask = encode_prompts(tokenizer, rows)
    _check_token_range(state, prompt_ids, prompt_mask)
    input_ids = prompt_ids.to(state.device)
    attention_mask = prompt_mask.to(state.device)
    was_training = state.module.training
    state.module.eval()
    stop_ids = stop_token_ids(tokenizer, state.module)
    settings = dict(
        max_new_tokens=node.max_new_tokens,
        eos_token_id=stop_ids,
        pad_token_id=tokenizer.pad_token_id,
        temperature=node.temperature,
        top_p=node.top_p,
        top_k=node.top_k,
        greedy=greedy,
        generator=generator if generator is not None else state.generator,
    )
    engine_started = time.perf_counter()
    try:
        output = _engine(state, node)(input_ids, attention_mask, **settings)
    finally:
        state.module.train(was_training)
    # The engine returns once its outputs are computed (its last step reads the finished rows
    # back): the rest of the node is the hand-off (copies, and the texts off a GPU).
    engine_s = time.perf_counter() - engine_started
    # Generation runs under inference mode; clones outside it are ordinary tensors that a
    # training step on this same worker may use.
    completion_ids = output.completion_ids.cpu().clone()
    completion_mask = output.completion_mask.cpu().clone()
    rows_of_tokens = token_rows(completion_ids, completion_mask)
    # On a GPU worker the texts decode beside the next node (roles.texts)
    completions: Sequence[str] = (LaterTexts.start(tokenizer, rows_of_tokens) if state.device.type == "cuda"
                                  else decode_texts(tokenizer, rows_of_tokens))
    rollout = Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        group_size=node.n,
        prompts=texts,
        completions=completions,
        answers=answers,
        max_new_tokens=node.max_new_tokens,
        temperature=node.temperature,
        sampled_logprobs=None if output.sampled_logprobs is None else output.sampled_logprobs.cpu().clone(),
        pad_token_id=int(tokenizer.pad_token_id),
        data_prompts=[example.reward_prompt for example in rows],
        columns=_columns(rows),
        chat=any(example.chat for example in rows),
        truncated=truncated_rows(completion_ids, completion_mask, node.max_new_tokens, stop_ids),
    )
    return NodeOutput(
        value=rollout,
        metrics={**rollout_metrics(rollout), "perf/generate_engine_s": engine_s},
        tokens_in=rollout.num_prompt_tokens,
        tokens_out=rollout.num_completion_tokens,
    )


def encode_prompts(tokenizer: Any, examples: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and mask: an example's ``prompt_ids`` when it has them (a
    prompt cut to data.max_prompt_tokens), else its text tokenized as is (a chat template
    already put in any special tokens)."""
    missing = [index for index, example in enumerate(examples) if getattr(example, "prompt_ids", None) is None]
    encoded = tokenizer([examples[i].prompt for i in missing], add_special_tokens=False)["input_ids"] if missing else []
    ids: list[list[int]] = [list(getattr(example, "prompt_ids", None) or ()) for example in examples]
    for index, row in zip(missing, encoded):
        ids[index] = list(row)
    width = max((len(row) for row in ids), default=0)
    if width == 0:
        raise FlowrlError("every prompt of the batch is empty after tokenization; check data.prompt_key")
    pad = int(tokenizer.pad_token_id)
    input_ids = torch.tensor([[pad] * (width - len(row)) + row for row in ids], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in ids], dtype=torch.long)
    return input_ids, mask


def _check_token_range(state: ModelState, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> None:
    """A prompt token the model's embedding has no row for (a tokenizer with tokens its model
    lacks) is an error that names it, before the model fails on it."""
    limit = embedding_rows(state.module)
    real = prompt_ids[prompt_mask.bool()]
    if limit is None or real.numel() == 0 or int(real.max()) < limit:
        return
    token = int(real.max())
    raise FlowrlError(
        f"a prompt holds token id {token} ({state.tokenizer.convert_ids_to_tokens(token)!r}), but the embedding of "
        f"model '{state.name}' has {limit} rows: its tokenizer has tokens the model lacks; give the model the "
        "tokenizer it was trained with, or take such tokens out of the prompts"
    )


def _columns(rows: Sequence[Any]) -> dict[str, list[Any]]:
    """Dataset column -> one value per row; a column some rows lack gets None there."""
    names: dict[str, None] = {}
    for example in rows:
        names.update(dict.fromkeys(getattr(example, "columns", {}) or {}))
    return {name: [(getattr(example, "columns", {}) or {}).get(name) for example in rows] for name in names}


def _engine(state: ModelState, node: Any) -> Callable[..., GenerationOutput]:
    """The decode function the node asked for (``engine``); see GenerateNode.engine."""
    engine = getattr(node, "engine", "auto")
    if engine in ("static", "auto"):
        decoder = decoder_for(state.module)
        if decoder is not None:
            return decoder.generate
        if engine == "static":
            raise FlowrlError(
                f"engine: static cannot run this model ({unsupported_reason(state.module)}); "
                "set engine: loop (or auto) on the generate node"
            )
    module = state.module
    assert isinstance(module, PreTrainedModel)  # a generate node's model is a policy (schema)
    return lambda ids, mask, **settings: generate_tokens(module, ids, mask, **settings)


def truncated_rows(completion_ids: torch.Tensor, completion_mask: torch.Tensor, max_new_tokens: int,
                   stop_ids: Sequence[int]) -> torch.Tensor:
    """[N] bool: rows of ``max_new_tokens`` tokens whose last token is no stop token (a row
    whose stop token came last finished)."""
    lengths = completion_mask.sum(dim=1)
    full = lengths >= max_new_tokens
    last = completion_ids.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)
    stops = torch.tensor(list(stop_ids), dtype=last.dtype)
    return full & ~torch.isin(last, stops)


def rollout_metrics(rollout: Rollout) -> dict[str, float]:
    lengths = rollout.completion_mask.sum(dim=1).float()
    cut = rollout.truncated if rollout.truncated is not None else lengths >= rollout.max_new_tokens
    return {
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float(cut.float().mean()),
        "prompt_length/mean": float(rollout.prompt_mask.sum(dim=1).float().mean()),
    }
