"""The KV-cache decode loop against model.generate and against a full forward pass."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flowrl.backends.generation import filter_top_k_top_p, generate_tokens, sample_next_token

PAD_ID = 0
VOCAB_SIZE = 48
MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
        pad_token_id=PAD_ID, tie_word_embeddings=False,
    )
    with torch.random.fork_rng():
        torch.manual_seed(7)
        # A wider init than the default 0.02 gives peaked, input-dependent distributions,
        # so rows differ and greedy choices are not near-ties.
        config.initializer_range = 0.5
        built = LlamaForCausalLM(config)
    return built.eval()


@pytest.fixture(scope="module")
def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Four left-padded prompts of lengths 5, 2, 4 and 3."""
    lengths = [5, 2, 4, 3]
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.full((4, 5), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros(4, 5, dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, 5 - length:] = torch.randint(3, VOCAB_SIZE, (length,), generator=generator)
        attention_mask[row, 5 - length:] = 1
    return input_ids, attention_mask


def reference_greedy(model: LlamaForCausalLM, input_ids: torch.Tensor,
                     attention_mask: torch.Tensor, eos_id: int) -> torch.Tensor:
    output = model.generate(
        input_ids, attention_mask=attention_mask, max_new_tokens=MAX_NEW_TOKENS,
        do_sample=False, eos_token_id=eos_id, pad_token_id=PAD_ID,
    )
    return output[:, input_ids.shape[1]:]


def pick_eos(model: LlamaForCausalLM, input_ids: torch.Tensor,
             attention_mask: torch.Tensor) -> int:
    """A token that greedy decoding emits mid-way in some rows, so those rows stop early."""
    free_run = reference_greedy(model, input_ids, attention_mask, eos_id=VOCAB_SIZE + 1)
    for token in free_run[:, 3].tolist():
        if token != PAD_ID:
            return int(token)
    raise AssertionError("no usable eos token")


def test_greedy_matches_model_generate(model: LlamaForCausalLM,
                                       prompts: tuple[torch.Tensor, torch.Tensor]) -> None:
    input_ids, attention_mask = prompts
    eos_id = pick_eos(model, input_ids, attention_mask)
    expected = reference_greedy(model, input_ids, attention_mask, eos_id)
    output = generate_tokens(model, input_ids, attention_mask, MAX_NEW_TOKENS,
                             eos_token_id=eos_id, pad_token_id=PAD_ID, greedy=True)
    assert (expected == eos_id).any(), "the test needs a row that stops at eos"
    assert torch.equal(output.completion_ids, expected)
    assert output.num_decode_steps == expected.shape[1]


def test_rows_stop_at_eos_and_are_padded_after(
    model: LlamaForCausalLM, prompts: tuple[torch.Tensor, torch.Tensor]
) -> None:
    input_ids, attention_mask = prompts
    eos_id = pick_eos(model, input_ids, attention_mask)
    output = generate_tokens(model, input_ids, attention_mask, MAX_NEW_TOKENS,
                             eos_token_id=eos_id, pad_token_id=PAD_ID, greedy=True)
    stopped_rows = 0
    for ids, mask, logprobs in zip(output.completion_ids, output.completion_mask,
                                   output.sampled_logprobs):
        eos_positions = (ids == eos_id).nonzero().flatten().tolist()
        length = eos_positions[0] + 1 if eos_positions else output.num_decode_steps
        stopped_rows += bool(eos_positions)
        assert mask.tolist() == [1] * length + [0] * (output.num_decode_steps - length)
        assert (ids[length:] == PAD_ID).all()
        assert (logprobs[length:] == 0).all()
    assert stopped_rows >= 1


def test_logprobs_match_a_full_forward(model: LlamaForCausalLM,
                                       prompts: tuple[torch.Tensor, torch.Tensor]) -> None:
    """The cached loop must see the same positions and masks as one forward over everything."""
    input_ids, attention_mask = prompts
    temperature = 0.7
    output = generate_tokens(model, input_ids, attention_mask, MAX_NEW_TOKENS,
                             eos_token_id=VOCAB_SIZE + 1, pad_token_id=PAD_ID,
                             temperature=temperature, generator=torch.Generator().manual_seed(0))
    full_ids = torch.cat([input_ids, output.completion_ids], dim=1)
    full_mask = torch.cat([attention_mask, output.completion_mask], dim=1)
    position_ids = (full_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(full_ids, attention_mask=full_mask, position_ids=position_ids).logits
    prompt_length = input_ids.shape[1]
    # Logits at position i predict token i + 1: completion token j comes from P - 1 + j.
    completion_logits = logits[:, prompt_length - 1:-1].float() / temperature
    expected = torch.log_softmax(completion_logits, -1).gather(
        -1, output.completion_ids[..., None]).squeeze(-1)
    assert output.sampled_logprobs.dtype == torch.float32
    torch.testing.assert_close(output.sampled_logprobs, expected, atol=1e-4, rtol=1e-4)


def test_sampling_is_reproducible_with_a_seeded_generator(
    model: LlamaForCausalLM, prompts: tuple[torch.Tensor, torch.Tensor]
) -> None:
    input_ids, attention_mask = prompts

    def sample(seed: int) -> torch.Tensor:
        return generate_tokens(model, input_ids, attention_mask, MAX_NEW_TOKENS,
                               eos_token_id=VOCAB_SIZE + 1, pad_token_id=PAD_ID,
                               temperature=1.5, top_k=20, top_p=0.95,
                               generator=torch.Generator().manual_seed(seed)).completion_ids

    assert torch.equal(sample(11), sample(11))
    assert not torch.equal(sample(11), sample(12))


def test_tiny_top_p_is_greedy(model: LlamaForCausalLM,
                              prompts: tuple[torch.Tensor, torch.Tensor]) -> None:
    input_ids, attention_mask = prompts
    common = dict(max_new_tokens=MAX_NEW_TOKENS, eos_token_id=VOCAB_SIZE + 1,
                  pad_token_id=PAD_ID)
    greedy = generate_tokens(model, input_ids, attention_mask, greedy=True, **common)
    nucleus = generate_tokens(model, input_ids, attention_mask, top_p=1e-6,
                              generator=torch.Generator().manual_seed(5), **common)
    assert torch.equal(greedy.completion_ids, nucleus.completion_ids)


def test_model_mode_is_restored(model: LlamaForCausalLM,
                                prompts: tuple[torch.Tensor, torch.Tensor]) -> None:
    input_ids, attention_mask = prompts
    model.train()
    try:
        generate_tokens(model, input_ids, attention_mask, 2, eos_token_id=1, pad_token_id=PAD_ID)
        assert model.training
    finally:
        model.eval()


def test_filter_top_k_and_top_p_by_hand() -> None:
    logprobs = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    # top_p 0.7: mass before each token is 0, 0.5, 0.8, 0.95; tokens whose mass before
    # already reaches 0.7 are dropped, so the first two stay (0.5 + 0.3 >= 0.7).
    kept = filter_top_k_top_p(logprobs, top_k=0, top_p=0.7).isfinite()
    assert kept.tolist() == [[True, True, False, False]]
    kept = filter_top_k_top_p(logprobs, top_k=3, top_p=1.0).isfinite()
    assert kept.tolist() == [[True, True, True, False]]
    # Both: top_k=1 keeps only the most likely token whatever top_p says.
    kept = filter_top_k_top_p(logprobs, top_k=1, top_p=0.99).isfinite()
    assert kept.tolist() == [[True, False, False, False]]


def test_exponential_race_draws_from_the_distribution() -> None:
    probabilities = torch.tensor([0.5, 0.3, 0.2])
    num_draws = 20000
    logits = probabilities.log().expand(num_draws, 3)
    tokens, logprobs = sample_next_token(logits, temperature=1.0, top_p=1.0, top_k=0,
                                         greedy=False, generator=torch.Generator().manual_seed(0))
    frequencies = torch.bincount(tokens, minlength=3).float() / num_draws
    # Standard error of a frequency near 0.5 over 20000 draws is ~0.0035; 0.02 is ~6 of them.
    torch.testing.assert_close(frequencies, probabilities, atol=0.02, rtol=0)
    assert math.isclose(float(logprobs[tokens == 0][0]), math.log(0.5), rel_tol=1e-5)


def test_bad_arguments_are_rejected(model: LlamaForCausalLM,
                                    prompts: tuple[torch.Tensor, torch.Tensor]) -> None:
    input_ids, attention_mask = prompts
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_tokens(model, input_ids, attention_mask, 0, eos_token_id=1, pad_token_id=0)
    with pytest.raises(ValueError, match="attention_mask"):
        generate_tokens(model, input_ids, attention_mask[:, 1:], 2, eos_token_id=1,
                        pad_token_id=0)
