"""Completion log-probs through the fused output head against the model's own logits."""

from __future__ import annotations

import pytest
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
    assert float(fused.detach()[mask == 0].abs().sum()) == 0.0
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0)) * mask
    (fused * weights).sum().backward()
    (plain * weights).sum().backward()
    for (name, mine), theirs in zip(fused_model.named_parameters(), plain_model.parameters()):
        assert mine.grad is not None and theirs.grad is not None, name
        torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_rows_padded_only_after_their_tokens_pass_without_a_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prompts of one length, completions right-padded: the padded pass drops the mask and
    # counts positions on through the padding, and its log-probs and gradients at the real
    # tokens are the masked forward's.
    import flowrl.roles.forward as forward

    monkeypatch.setattr(forward, "PACK_BELOW", 0.0)  # the padded pass, not the packed one
    rollout = text_rollout(build_char_tokenizer(), ["1+2=", "4+5=", "7+1=", "3+3="], ["3", "9 is it", "8", "6!"],
                           group_size=2, max_new_tokens=7)
    window = completion_window(rollout, torch.device("cpu"))  # type: ignore[arg-type]
    layout = forward._pass_layout(tiny_policy(seed=3), window, recomputed=False)
    assert set(layout.inputs) == {"input_ids", "position_ids"}
    assert layout.inputs["position_ids"].tolist() == [list(range(11))] * 4
    mask = rollout.completion_mask.float()  # type: ignore[attr-defined]
    fused_model, plain_model = tiny_policy(seed=3), tiny_policy(seed=3)
    fused = completion_logprobs(fused_model, rollout, torch.device("cpu"))  # type: ignore[arg-type]
    plain = _plain_logprobs(plain_model, rollout)
    torch.testing.assert_close(fused * mask, plain * mask, atol=1e-5, rtol=0)
    (fused * mask).sum().backward()
    (plain * mask).sum().backward()
    for (name, mine), theirs in zip(fused_model.named_parameters(), plain_model.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-5, rtol=1e-4, msg=name)
    # A left-padded prompt comes before real tokens: that pass keeps the mask.
    left_padded = completion_window(_rollout(), torch.device("cpu"))  # type: ignore[arg-type]
    assert "attention_mask" in forward._pass_layout(tiny_policy(seed=3), left_padded, recomputed=False).inputs


def test_the_entropy_comes_with_the_log_probs_from_either_head(monkeypatch: pytest.MonkeyPatch) -> None:
    # the fused head's entropy from its chunks, and the plain head's from the logits, both
    # equal -sum(p log p) of softmax(logits / t) at each real completion token
    import flowrl.roles.forward as forward

    rollout = _rollout()
    model = tiny_policy(seed=3)
    window = completion_window(rollout, torch.device("cpu"))  # type: ignore[arg-type]
    with torch.no_grad():
        logits = model(input_ids=window.input_ids, attention_mask=window.attention_mask,
                       position_ids=window.position_ids, use_cache=False).logits
    scaled = window.completion_positions(logits) / rollout.temperature  # type: ignore[attr-defined]
    log_p = torch.log_softmax(scaled, dim=-1)
    expected = window.pad(-(log_p.exp() * log_p).sum(dim=-1))
    mask = rollout.completion_mask.float()  # type: ignore[attr-defined]
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(forward, "output_head", lambda module: None)  # the model's own forward
        logprobs, entropy = forward.completion_logprobs_and_entropy(model, rollout, torch.device("cpu"))  # type: ignore[arg-type]
        # the fused head's entropy is differentiable at no cost; the plain one only when asked
        assert entropy.requires_grad == fused and logprobs.requires_grad
        torch.testing.assert_close(entropy * mask, expected * mask, atol=1e-5, rtol=0)


def test_an_entropy_bonus_has_the_same_gradient_through_either_head(monkeypatch: pytest.MonkeyPatch) -> None:
    import flowrl.roles.forward as forward

    rollout = _rollout()
    mask = rollout.completion_mask.float()  # type: ignore[attr-defined]
    generator = torch.Generator().manual_seed(1)
    weights, entropy_weights = torch.randn(mask.shape, generator=generator), torch.randn(mask.shape, generator=generator)
    gradients = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(forward, "output_head", lambda module: None)
        model = tiny_policy(seed=3)
        logprobs, entropy = forward.completion_logprobs_and_entropy(model, rollout, torch.device("cpu"),  # type: ignore[arg-type]
                                                                    entropy_grad=True)
        assert entropy.requires_grad
        ((logprobs * weights + entropy * entropy_weights) * mask).sum().backward()
        gradients.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert float(gradients[0].abs().sum()) > 0
    torch.testing.assert_close(gradients[0], gradients[1], atol=1e-5, rtol=1e-4)


def test_models_with_transformed_logits_use_their_own_forward() -> None:
    model = tiny_policy()
    model.config.final_logit_softcapping = 30.0
    assert output_head(model) is None
    assert output_head(model.model) is None  # a backbone has no output head


def _uneven_rollout() -> object:
    # Prompts of 2..9 characters and completions of 1..12: padded to the longest, most of
    # the window is padding, so the passes are packed.
    prompts = ["1+1=", "123456+7=", "9=", "40+2="]
    completions = ["2", "123463 is it", "9", "42?"]
    return text_rollout(build_char_tokenizer(), prompts, completions, group_size=2, max_new_tokens=12)


def test_packed_forward_equals_the_padded_one(monkeypatch: pytest.MonkeyPatch) -> None:
    import flowrl.roles.forward as forward

    rollout = _uneven_rollout()
    mask = rollout.completion_mask.float()  # type: ignore[attr-defined]
    results = []
    for pack_below in (0.0, 1.01):  # never packed, always packed
        monkeypatch.setattr(forward, "PACK_BELOW", pack_below)
        model = tiny_policy(seed=4)
        logprobs = completion_logprobs(model, rollout, torch.device("cpu"))  # type: ignore[arg-type]
        (logprobs * mask).sum().backward()
        results.append((logprobs.detach(), {name: p.grad for name, p in model.named_parameters()}))
    (padded, padded_grads), (packed, packed_grads) = results
    torch.testing.assert_close(packed * mask, padded * mask, atol=1e-5, rtol=0)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    # The model is left as it was: the next plain forward uses its own attention again.
    model = tiny_policy(seed=4)
    assert model.config._attn_implementation != "flowrl_packed"


def test_packing_attends_within_each_row_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two rows packed end to end give the hidden states each row gives alone.
    from types import SimpleNamespace

    import flowrl.backends.packed_attention as packed_attention
    from flowrl.backends.packed_attention import packed

    calls: list[int] = []

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(packed_attention, "F", SimpleNamespace(scaled_dot_product_attention=counted))
    model = tiny_policy(seed=5).eval()
    first, second = torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([[10, 11, 12]])
    with torch.no_grad():
        alone = [model.model(input_ids=ids, use_cache=False).last_hidden_state[0] for ids in (first, second)]
        with packed(model, [5, 3]):
            together = model.model(input_ids=torch.cat([first, second], dim=1),
                                   position_ids=torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]]),
                                   use_cache=False).last_hidden_state[0]
    torch.testing.assert_close(together, torch.cat(alone), atol=1e-5, rtol=0)
    assert len(calls) == 2 * model.config.num_hidden_layers  # one attention per row and layer


def test_models_with_sliding_windows_are_not_packed() -> None:
    from flowrl.backends.packed_attention import can_pack

    model = tiny_policy()
    assert can_pack(model)
    model.config.sliding_window = 4
    assert not can_pack(model)
    assert not can_pack(model.lm_head)


def test_a_checkpointed_model_is_not_packed_where_its_backward_recomputes_the_layers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Activation checkpointing runs each layer again inside backward, after the packed
    # attention is switched off: the gradients must still be those of the padded pass.
    import flowrl.roles.forward as forward

    rollout = _uneven_rollout()
    mask = rollout.completion_mask.float()  # type: ignore[attr-defined]
    grads = []
    for pack_below, checkpointing in ((0.0, False), (1.01, True)):
        monkeypatch.setattr(forward, "PACK_BELOW", pack_below)
        model = tiny_policy(seed=6)
        if checkpointing:
            model.gradient_checkpointing_enable()
        model.train()
        (completion_logprobs(model, rollout, torch.device("cpu")) * mask).sum().backward()  # type: ignore[arg-type]
        grads.append({name: p.grad for name, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_the_row_loop_splits_and_joins_instead_of_slicing() -> None:
    # The CPU path's backward must gather the rows' gradients, not add one zero-filled
    # gradient of the whole pass per row: every row's gradient equals that row alone.
    from flowrl.backends.packed_attention import _looped_attention

    generator = torch.Generator().manual_seed(6)
    query = torch.randn(1, 4, 9, 8, generator=generator, requires_grad=True)
    key = torch.randn(1, 2, 9, 8, generator=generator, requires_grad=True)
    value = torch.randn(1, 2, 9, 8, generator=generator, requires_grad=True)
    out = _looped_attention(query, key, value, [0, 4, 4, 9], scaling=None)
    assert out.shape == (1, 9, 4, 8)
    weights = torch.randn(out.shape, generator=generator)
    (out * weights).sum().backward()
    for start, end in ((0, 4), (4, 9)):
        q, k, v = (t.detach()[:, :, start:end].clone().requires_grad_() for t in (query, key, value))
        alone = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.testing.assert_close(out.detach()[:, start:end], alone.detach().transpose(1, 2))
        (alone.transpose(1, 2) * weights[:, start:end]).sum().backward()
        for whole, part in ((query, q), (key, k), (value, v)):
            assert whole.grad is not None and part.grad is not None
            torch.testing.assert_close(whole.grad[:, :, start:end], part.grad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_varlen_kernel_attends_a_packed_pass_like_the_row_loop() -> None:
    from flowrl.backends.packed_attention import _looped_attention, _varlen_attention, packed, varlen_usable

    bounds = [0, 37, 38, 140, 301]
    results = []
    for attend in (_varlen_attention, _looped_attention):
        generator = torch.Generator(device="cuda").manual_seed(7)  # the same tensors for both
        tensors = [torch.randn(1, heads, 301, 64, generator=generator, device="cuda", dtype=torch.bfloat16)
                   for heads in (14, 2, 2)]
        leaves = [t.requires_grad_() for t in tensors]
        with packed(tiny_policy(), [37, 1, 102, 161]):
            out = attend(*leaves, bounds, scaling=0.125)
        weights = torch.randn(out.shape, generator=torch.Generator(device="cuda").manual_seed(8), device="cuda",
                              dtype=torch.bfloat16)
        (out.float() * weights.float()).sum().backward()
        results.append((out.detach().float(), [leaf.grad.float() for leaf in leaves if leaf.grad is not None]))
    assert varlen_usable(tensors[0].device, tensors[0].dtype, 64)
    (fused, fused_grads), (looped, looped_grads) = results
    torch.testing.assert_close(fused, looped, atol=2e-2, rtol=2e-2)
    assert len(fused_grads) == len(looped_grads) == 3
    for mine, theirs in zip(fused_grads, looped_grads):
        torch.testing.assert_close(mine, theirs, atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_packed_bf16_pass_on_a_gpu_goes_through_the_varlen_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    import flowrl.backends.packed_attention as packed_attention
    import flowrl.roles.forward as forward

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("the row loop ran on a GPU pass")

    rollout = _uneven_rollout()
    mask = rollout.completion_mask.float().cuda()  # type: ignore[attr-defined]
    monkeypatch.setattr(packed_attention, "_looped_attention", refused)
    results = []
    for pack_below in (0.0, 1.01):  # never packed, always packed
        monkeypatch.setattr(forward, "PACK_BELOW", pack_below)
        model = tiny_policy(seed=4).cuda().to(torch.bfloat16)
        logprobs = completion_logprobs(model, rollout, torch.device("cuda"))  # type: ignore[arg-type]
        (logprobs * mask).sum().backward()
        results.append((logprobs.detach() * mask, [p.grad.float() for p in model.parameters() if p.grad is not None]))
    (padded, padded_grads), (packed, packed_grads) = results
    torch.testing.assert_close(packed, padded, atol=5e-2, rtol=0)
    for mine, theirs in zip(packed_grads, padded_grads):
        torch.testing.assert_close(mine, theirs, atol=5e-2, rtol=5e-2)
