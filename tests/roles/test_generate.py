"""The generate role lays out rollouts as GRPO expects them."""

from __future__ import annotations

import pickle

import pytest
import torch

from flowrl.data import PromptExample
from flowrl.roles.generate import rollout_metrics, run_generate, truncated_rows
from flowrl.roles.state import ModelState
from flowrl.roles.texts import LaterTexts, decode_rows
from flowrl.spec.schema import GenerateNode
from tests.tiny_models import model_state, tiny_policy


def test_rollout_is_grouped_by_prompt_and_decodes_its_own_tokens() -> None:
    state = model_state("actor", tiny_policy(0))
    tokenizer = state.tokenizer
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
    assert output.tokens_in == int(rollout.prompt_mask.sum())
    assert output.tokens_out == int(rollout.completion_mask.sum())
    # tensors leave inference mode, so a training step on the same worker can use them
    assert not rollout.completion_ids.is_inference()


def test_a_row_is_truncated_when_it_ran_to_the_limit_without_a_stop_token() -> None:
    # limit 3, stop ids 9 and 8: cut; stopped early; stopped on the last token; an empty row
    ids = torch.tensor([[1, 2, 3], [1, 9, 0], [1, 2, 8], [0, 0, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [0, 0, 0]])
    assert truncated_rows(ids, mask, 3, (9, 8)).tolist() == [True, False, False, False]
    assert truncated_rows(ids, mask, 3, ()).tolist() == [True, False, True, False]


def test_a_rollout_knows_its_truncated_rows_and_reports_their_share() -> None:
    state = model_state("actor", tiny_policy(0))
    prompts = [PromptExample("ab=", "a"), PromptExample("xyzw=", "x")]
    node = GenerateNode(model="actor", inputs=["prompts"], n=4, max_new_tokens=3)
    output = run_generate(state, prompts, node)
    rollout = output.value
    eos = state.tokenizer.eos_token_id
    lengths = rollout.completion_mask.sum(dim=1)
    expected = [int(length) == 3 and int(rollout.completion_ids[row, 2]) != eos for row, length in enumerate(lengths)]
    assert rollout.truncated is not None and rollout.truncated.tolist() == expected
    assert output.metrics["response_length/clip_ratio"] == sum(expected) / 8
    assert rollout.select(torch.tensor([1, 0])).truncated.tolist() == expected[1::-1]
    # a row that stopped on its last token finished: not counted as cut
    finished = rollout.select(torch.arange(8))
    finished.truncated = torch.zeros(8, dtype=torch.bool)
    assert rollout_metrics(finished)["response_length/clip_ratio"] == 0.0


def test_completion_texts_equal_batch_decode_with_padding_special_tokens_and_clean_up() -> None:
    import torch

    from flowrl.backends.tokenizer import build_char_tokenizer
    from flowrl.roles.texts import decode_rows as _decode

    tokenizer = build_char_tokenizer()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    rows = [tokenizer("ab ,c", add_special_tokens=False)["input_ids"] + [eos],
            tokenizer("x y", add_special_tokens=False)["input_ids"], []]
    width = max(len(row) for row in rows) + 2
    ids = torch.tensor([row + [pad] * (width - len(row)) for row in rows])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    expected = tokenizer.batch_decode(rows, skip_special_tokens=True)
    assert _decode(tokenizer, ids, mask) == expected == ["ab ,c", "x y", ""]
    # a mask with holes keeps only the marked tokens
    holes = mask.clone()
    holes[0, 1] = 0
    assert _decode(tokenizer, ids, holes)[0] == "a ,c"
    # the tokenizer's clean-up of spaces before punctuation is kept
    tokenizer.clean_up_tokenization_spaces = True
    assert _decode(tokenizer, ids, mask)[0] == tokenizer.batch_decode(rows, skip_special_tokens=True)[0] == "ab,c"


def test_auto_engine_decodes_llama_models_with_the_static_decoder_on_cpu_too() -> None:
    import torch

    from flowrl.roles.generate import _engine

    state = model_state("actor", tiny_policy(0))
    auto = _engine(state, GenerateNode(model="actor", inputs=["prompts"], n=2, max_new_tokens=4))
    loop = _engine(state, GenerateNode(model="actor", inputs=["prompts"], n=2, max_new_tokens=4, engine="loop"))
    assert getattr(auto, "__self__", None).__class__.__name__ == "StaticDecoder"
    assert getattr(loop, "__self__", None) is None  # transformers' forward, one per token
    # the same tokens and log-probabilities from the same noise
    ids = torch.tensor([[5, 6, 7], [0, 8, 9]])
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    settings = dict(max_new_tokens=6, eos_token_id=state.tokenizer.eos_token_id,
                    pad_token_id=state.tokenizer.pad_token_id)
    a = auto(ids, mask, generator=torch.Generator().manual_seed(3), **settings)
    b = loop(ids, mask, generator=torch.Generator().manual_seed(3), **settings)
    assert torch.equal(a.completion_ids, b.completion_ids)
    torch.testing.assert_close(a.sampled_logprobs, b.sampled_logprobs, atol=1e-5, rtol=0)


def test_on_a_cpu_slot_the_texts_are_decoded_within_the_node() -> None:
    state = model_state("actor", tiny_policy(0))
    node = GenerateNode(model="actor", inputs=["prompts"], n=2, max_new_tokens=4)
    rollout = run_generate(state, [PromptExample("ab=", "a")], node).value
    assert type(rollout.completions) is list
    assert rollout.texts_pending() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_texts_decode_beside_the_next_node_and_travel_as_a_list() -> None:
    cpu = model_state("actor", tiny_policy(0))
    state = ModelState("actor", cpu.module.cuda(), cpu.tokenizer, torch.device("cuda"),
                       torch.Generator(device="cuda").manual_seed(0))
    node = GenerateNode(model="actor", inputs=["prompts"], n=3, max_new_tokens=6)
    rollout = run_generate(state, [PromptExample("ab=", "a"), PromptExample("xyz=", "x")], node).value
    assert isinstance(rollout.completions, LaterTexts)
    expected = decode_rows(state.tokenizer, rollout.completion_ids, rollout.completion_mask)
    assert list(rollout.completions) == expected
    travelled = pickle.loads(pickle.dumps(rollout))
    assert type(travelled.completions) is list and travelled.completions == expected
