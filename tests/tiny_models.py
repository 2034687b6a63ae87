"""Tiny models that tests build for themselves: a 1-layer Llama of hidden size 32 over the
character tokenizer, as a policy or with a scalar head, wrapped in a ``ModelState``."""

from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

from flowrl.backends.tokenizer import build_char_tokenizer
from flowrl.backends.value_model import ScalarHeadModel
from flowrl.roles.batch import Rollout
from flowrl.roles.state import ModelState


def tiny_llama_config() -> LlamaConfig:
    tokenizer = build_char_tokenizer()
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def tiny_policy(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config())


def tiny_scalar_model(seed: int = 0) -> ScalarHeadModel:
    """A backbone with a fresh (zero) scalar head."""
    torch.manual_seed(seed)
    return ScalarHeadModel(LlamaModel(tiny_llama_config()))


def model_state(name: str, module: torch.nn.Module, seed: int = 0) -> ModelState:
    kind = "value" if isinstance(module, ScalarHeadModel) else "policy"
    return ModelState(name, module, build_char_tokenizer(), torch.device("cpu"), torch.Generator().manual_seed(seed),
                      kind=kind)


def text_rollout(tokenizer: Any, prompts: list[str], completions: list[str], group_size: int,
                 max_new_tokens: int) -> Rollout:
    """A rollout of these texts: prompts left-padded, completions right-padded, as generation leaves them."""
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    completion = tokenizer(completions, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    return Rollout(
        prompt_ids=encoded["input_ids"], prompt_mask=encoded["attention_mask"],
        completion_ids=completion["input_ids"], completion_mask=completion["attention_mask"],
        group_size=group_size, prompts=prompts, completions=completions, answers=[None] * len(prompts),
        max_new_tokens=max_new_tokens, temperature=1.0,
    )


def ordered_char_tokenizer(order: str) -> Any:
    """A tokenizer of one token per character of ``order``, its id the character's position;
    'u', 'p' and 'e' are its unknown, pad and end-of-sequence tokens (so texts leave them out)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab={token: index for index, token in enumerate(order)}, unk_token="u"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="u", pad_token="p", eos_token="e")
