"""The ``score`` role backed by a reward model: one scalar per completion, read at its end.

The reward model (a :class:`~flowrl.backends.value_model.ScalarHeadModel`) reads the
rollout's token ids, so it must share the policy's tokenizer (true of the builtin models),
or, with ``retokenize``, the prompts and completions as text through its own tokenizer.
Its score is the scalar at the last real token of prompt + completion, the end-of-sequence
token when generation stopped there: prompts are left-padded and completions right-padded,
so that is the last column where the joined attention mask is 1, whatever the padding.
"""

from __future__ import annotations

from typing import Any

import torch

from flowrl.backends.model_facts import config_positions
from flowrl.backends.transfer import to_device
from flowrl.roles.batch import NodeOutput, Rollout, Scores
from flowrl.roles.forward import in_micro_batches
from flowrl.roles.score import score_metrics
from flowrl.roles.state import ModelState


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[N]`` column of each row's last 1 in ``attention_mask`` (0 for a row of zeros)."""
    columns = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (attention_mask.bool() * (columns + 1)).amax(dim=1).sub(1).clamp(min=0)


def sequence_scores(
    module: torch.nn.Module,
    rollout: Rollout,
    device: torch.device,
    micro_batch_tokens: int | None = None,
) -> torch.Tensor:
    """``[N]`` float32 reward-model scores of a rollout, on the CPU; passes of at most
    ``micro_batch_tokens`` padded tokens (length-sorted rows, ``flowrl.roles.forward.micro_batches``)."""
    return in_micro_batches(rollout, micro_batch_tokens, lambda part: _scores(module, part, device)).cpu()


def _scores(module: torch.nn.Module, rollout: Rollout, device: torch.device) -> torch.Tensor:
    input_ids, attention_mask, position_ids = rollout.joined()
    # Columns before the first and after the last real token of any row are padding
    # everywhere (positions are explicit, so the rest compute the same values): a pass of
    # length-sorted rows holds about the tokens its budget counted.
    start = int(attention_mask.bool().any(dim=0).long().argmax())
    end = int(last_token_index(attention_mask).max()) + 1
    columns = slice(start, end)
    scalars = module(
        input_ids=to_device(input_ids[:, columns], device),
        attention_mask=to_device(attention_mask[:, columns], device),
        position_ids=to_device(position_ids[:, columns], device),
    ).float()
    last = to_device(last_token_index(attention_mask[:, columns]), scalars.device)
    return scalars[torch.arange(scalars.shape[0], device=scalars.device), last]


def reward_texts(rollout: Rollout, tokenizer: Any) -> tuple[list[str], bool]:
    """Each row's prompt and completion as one text for a reward model's own tokenizer, and
    whether those texts hold their special tokens already: a chat prompt and its completion as
    an assistant message through the tokenizer's chat template when it has one (its special
    tokens written by the template), else the prompt text and the completion joined."""
    completions = list(rollout.completions)
    chats = rollout.data_prompts if rollout.chat and rollout.data_prompts else [None] * len(completions)
    if not getattr(tokenizer, "chat_template", None) or not all(isinstance(chat, list) for chat in chats):
        # a mixed batch too: the chat rows' prompts as the policy's template rendered them
        return [prompt + completion for prompt, completion in zip(rollout.prompts, completions)], False
    texts = [tokenizer.apply_chat_template([*chat, {"role": "assistant", "content": completion}], tokenize=False)
             for chat, completion in zip(chats, completions)]
    return texts, True


def retokenized_scores(module: torch.nn.Module, tokenizer: Any, rollout: Rollout, device: torch.device,
                       micro_batch_tokens: int | None = None) -> torch.Tensor:
    """``[N]`` float32 scores of a rollout read as text by the reward model's ``tokenizer``
    (:func:`reward_texts`), in passes of at most ``micro_batch_tokens`` of the policy's tokens."""
    longest = _positions(module)

    def scores(part: Rollout) -> torch.Tensor:
        texts, templated = reward_texts(part, tokenizer)
        # a text longer than the model's positions keeps its end, where the score is read
        side, tokenizer.truncation_side = tokenizer.truncation_side, "left"
        try:
            encoded = tokenizer(texts, add_special_tokens=not templated, padding=True, return_tensors="pt",
                                truncation=longest is not None, max_length=longest)
        finally:
            tokenizer.truncation_side = side
        mask = encoded["attention_mask"]
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)  # whichever side the tokenizer pads
        scalars = module(input_ids=to_device(encoded["input_ids"], device), attention_mask=to_device(mask, device),
                         position_ids=to_device(positions, device)).float()
        last = to_device(last_token_index(mask), scalars.device)
        return scalars[torch.arange(scalars.shape[0], device=scalars.device), last]

    return in_micro_batches(rollout, micro_batch_tokens, scores).cpu()


def _positions(module: torch.nn.Module) -> int | None:
    """The most positions the reward model reads (its config's, as validation reads them),
    None when it does not say."""
    config = getattr(getattr(module, "backbone", module), "config", None)
    return config_positions(config.to_dict()) if config is not None else None


def run_reward_model(
    state: ModelState, rollout: Rollout, weight: float, micro_batch_tokens: int | None = None,
    retokenize: bool = False,
) -> NodeOutput:
    """Scores times ``weight``, as :func:`flowrl.roles.score.run_score` returns them; with
    ``retokenize``, of the texts read by the reward model's own tokenizer."""
    state.module.eval()
    with torch.inference_mode():
        if retokenize:
            values = retokenized_scores(state.module, state.tokenizer, rollout, state.device, micro_batch_tokens)
        else:
            values = sequence_scores(state.module, rollout, state.device, micro_batch_tokens)
    scores = Scores(values=values.clone() * weight, num_failed=0)
    return NodeOutput(
        value=scores,
        metrics=score_metrics(scores, with_failures=False),
        tokens_in=rollout.num_prompt_tokens + rollout.num_completion_tokens,
    )
