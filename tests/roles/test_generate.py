"""The generate role lays out rollouts as GRPO expects them."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flowrl.backends.tokenizer import build_char_tokenizer
from flowrl.data import PromptExample
from flowrl.roles.generate import run_generate
from flowrl.roles.state import ModelState
from flowrl.spec.schema import GenerateNode


def test_rollout_is_grouped_by_prompt_and_decodes_its_own_tokens() -> None:
    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    state = ModelState("actor", LlamaForCausalLM(config), tokenizer, torch.device("cpu"), torch.Generator().manual_seed(0))
    prompts = [PromptExample("ab=", "a"), PromptExample("xyzw=", "x")]
    node = GenerateNode(model="actor", inputs=["prompts"], n=3, max_new_tokens=5)
    output = run_generate(state, prompts, node)
    rollout = output.value

    assert rollout.prompts == ["ab="] * 3 + ["xyzw="] * 3
    assert rollout.answers == ["a"] * 3 + ["x"] * 3
    assert rollout.group_size == 3
    # prompts are left-padded to the longest (5 characters)
    assert rollout.prompt_mask.tolist()[0] == [0, 0, 1, 1, 1]
    assert rollout.completion_ids.shape[1] <= 5
    for row, text in enumerate(rollout.completions):
        kept = [t for t, m in zip(rollout.completion_ids[row].tolist(), rollout.completion_mask[row].tolist()) if m]
        assert tokenizer.decode(kept, skip_special_tokens=True) == text
    assert output.tokens == int(rollout.prompt_mask.sum() + rollout.completion_mask.sum())
    # tensors leave inference mode, so a training step on the same worker can use them
    assert not rollout.completion_ids.is_inference()
