"""Completion log-probs through the fused output head against the model's own logits."""

from __future__ import annotations

import torch

from flowrl.algorithms.logprobs import token_logprobs
from flowrl.backends.tokenizer import build_char_tokenizer
from flowrl.roles.forward import completion_logprobs, completion_window, output_head
from tests.tiny_models import text_rollout, tiny_policy


def _rollout() -> object:
    return text_rollout(build_char_tokenizer(), ["1+2=", "10+20=", "7+1=", "3+3="], ["3", "30 ok", "8", "6!"],
                        group_size=2, max_new_tokens=6)


def _plain_logprobs(model: torch.nn.Module, rollout: object) -> torch.Tensor:
    """The model's whole forward, then log_softmax + gather on every completion column."""
    window = completion_window(rollout, torch.device("cpu"))  # type: ignore[arg-type]
    logits = model(input_ids=window.input_ids, attention_mask=window.attention_mask,
                   position_ids=window.position_ids, use_cache=False).logits
    labels = rollout.completion_ids[:, : window.width]  # type: ignore[attr-defined]
    return window.pad(token_logprobs(window.completion_positions(logits), labels))


def test_fused_head_gives_the_models_log_probs_and_gradients() -> None:
    rollout = _rollout()
    fused_model, plain_model = tiny_policy(seed=3), tiny_policy(seed=3)
    assert output_head(fused_model) is not None
    mask = rollout.completion_mask.float()  # type: ignore[attr-defined]
    fused = completion_logprobs(fused_model, rollout, torch.device("cpu"))  # type: ignore[arg-type]
    plain = _plain_logprobs(plain_model, rollout)
    # Real completion tokens agree; padding is 0 in the fused path (never computed) and is
    # masked by every consumer.
    torch.testing.assert_close(fused * mask, plain * mask, atol=1e-5, rtol=0)
    assert float(fused[mask == 0].abs().sum()) == 0.0
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0)) * mask
    (fused * weights).sum().backward()
    (plain * weights).sum().backward()
    for (name, mine), theirs in zip(fused_model.named_parameters(), plain_model.parameters()):
        assert mine.grad is not None and theirs.grad is not None, name
        torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_models_with_transformed_logits_use_their_own_forward() -> None:
    model = tiny_policy()
    model.config.final_logit_softcapping = 30.0
    assert output_head(model) is None
    assert output_head(model.model) is None  # a backbone has no output head
