"""A prompt shared by consecutive rows computed once: the same log-probs and gradients as the
padded forward, and a packed layout checked by hand."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from flowrl.backends.shared_prompt import shared_prompt_layout
from flowrl.backends.tokenizer import build_char_tokenizer
from flowrl.roles.forward import completion_logprobs
from tests.tiny_models import text_rollout, tiny_policy


def test_the_packed_layout_holds_each_prompt_once_then_its_rows_completions() -> None:
    # rows 0-1 share prompt [7, 8] (row 2's prompt [9] is left-padded); completions are
    # right-padded: lengths 2, 1, 3
    ids = torch.tensor([[7, 8, 11, 12, 0], [7, 8, 13, 0, 0], [0, 9, 14, 15, 16]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [0, 1, 1, 1, 1]])
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    layout = shared_prompt_layout(ids, mask, positions, prompt_length=2)
    assert layout is not None
    assert layout.saved_tokens == 2  # row 1's two prompt tokens
    assert layout.input_ids.tolist() == [7, 8, 11, 12, 13, 9, 14, 15, 16]
    assert layout.position_ids.tolist() == [0, 1, 2, 3, 2, 0, 1, 2, 3]
    # each padded token's packed index (9 = padding: the zero row); row 1's prompt is row 0's
    assert layout.source.tolist() == [[0, 1, 2, 3, 9], [0, 1, 4, 9, 9], [9, 5, 6, 7, 8]]
    assert layout.prompt_index.tolist() == [[0, 1], [5, 0]]
    assert layout.prompt_valid.tolist() == [[True, True], [True, False]]
    assert layout.completion_index.tolist() == [[2, 3, 0], [4, 0, 0], [6, 7, 8]]
    assert layout.row_group.tolist() == [0, 0, 1]
    # no prompt repeats: nothing to share
    assert shared_prompt_layout(ids[1:], mask[1:], positions[1:], prompt_length=2) is None


def _grouped_rollout() -> object:
    # groups of 3, 1 and 2 rows; prompts of 4, 9 and 2 characters, completions of 1..12
    prompts = ["1+1="] * 3 + ["123456+7="] + ["9="] * 2
    completions = ["2", "two", "2 ok", "123463 is it", "9", "9!"]
    return text_rollout(build_char_tokenizer(), prompts, completions, group_size=3, max_new_tokens=12)


def _tiny_qwen2(seed: int) -> torch.nn.Module:
    """Grouped-query attention (4 heads over 2 key/value heads) and q/k/v biases."""
    tokenizer = build_char_tokenizer()
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return Qwen2ForCausalLM(config)


@pytest.mark.parametrize("build", [tiny_policy, _tiny_qwen2])
def test_shared_prompts_give_the_padded_forwards_log_probs_and_gradients(
    build: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    import flowrl.backends.shared_prompt as shared_prompt
    import flowrl.roles.forward as forward

    rollout = _grouped_rollout()
    mask = rollout.completion_mask.float()  # type: ignore[attr-defined]
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0)) * mask
    calls = []
    attention = shared_prompt._shared_prompt_attention

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return attention(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(shared_prompt, "_shared_prompt_attention", counted)
    results = []
    for share_above in (1.01, 0.0):  # never shared, always
        monkeypatch.setattr(forward, "SHARE_PROMPTS_ABOVE", share_above)
        monkeypatch.setattr(forward, "PACK_BELOW", 0.0)  # the padded forward, not the packed one
        model = build(seed=5)  # type: ignore[operator]
        logprobs = completion_logprobs(model, rollout, torch.device("cpu"))  # type: ignore[arg-type]
        (logprobs * weights).sum().backward()
        results.append((logprobs.detach(), {name: p.grad for name, p in model.named_parameters()}))
    assert len(calls) == model.config.num_hidden_layers  # only the second pass shared its prompts
    (padded, padded_grads), (shared, shared_grads) = results
    torch.testing.assert_close(shared * mask, padded * mask, atol=1e-5, rtol=0)
    for name, grad in padded_grads.items():
        assert grad is not None, name
        torch.testing.assert_close(shared_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    # the model is left as it was
    assert model.config._attn_implementation != shared_prompt.NAME
