"""The reward-model score role: the scalar at the last real token, whatever the padding."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from flowrl.backends.tokenizer import build_char_tokenizer
from flowrl.roles.batch import Rollout, Scores
from flowrl.roles.reward_model import last_token_index, reward_texts, run_reward_model
from tests.tiny_models import model_state, ordered_char_tokenizer, tiny_scalar_model


class ProbeModel(torch.nn.Module):
    """Scalar at each position = the token id there."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = torch.nn.Parameter(torch.zeros(1))

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        return input_ids.float()


def _rollout(prompts: list[str], completions: list[list[int]]) -> Rollout:
    tokenizer = build_char_tokenizer()
    encoded = tokenizer(
        prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False
    )
    width = max(max(len(row) for row in completions), 1)
    completion_ids = torch.zeros((len(completions), width), dtype=torch.long)
    completion_mask = torch.zeros((len(completions), width), dtype=torch.long)
    for i, row in enumerate(completions):
        completion_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        completion_mask[i, : len(row)] = 1
    return Rollout(
        prompt_ids=encoded["input_ids"],
        prompt_mask=encoded["attention_mask"],
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        group_size=1,
        prompts=prompts,
        completions=[tokenizer.decode(row, skip_special_tokens=True) for row in completions],
        answers=[None] * len(prompts),
        max_new_tokens=width,
        temperature=1.0,
    )


def test_last_token_index_of_left_and_right_padded_rows() -> None:
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 1, 0, 0]])
    assert last_token_index(mask).tolist() == [3, 4, 2]


def test_score_is_read_at_the_last_real_token_of_prompt_plus_completion() -> None:
    tokenizer = build_char_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    eos = tokenizer.eos_token_id
    rollout = _rollout(
        ["abcd=", "a=", "ab="],
        [
            [ids("1"), ids("2"), ids("3")],  # full width: last token "3"
            [ids("x"), eos],  # stopped: last token <eos>
            [],
        ],  # empty completion: last token is the prompt's "="
    )
    output = run_reward_model(model_state("reward", ProbeModel()), rollout, weight=1.0)
    assert isinstance(output.value, Scores)
    assert output.value.values.tolist() == [float(ids("3")), float(eos), float(ids("="))]
    weighted = run_reward_model(model_state("reward", ProbeModel()), rollout, weight=0.5).value.values
    assert weighted.tolist() == [0.5 * ids("3"), 0.5 * eos, 0.5 * ids("=")]


def test_padding_does_not_change_a_real_models_score() -> None:
    tokenizer = build_char_tokenizer()
    model = tiny_scalar_model()
    torch.nn.init.normal_(model.head.weight, std=0.3)
    ids = tokenizer.convert_tokens_to_ids
    prompts = ["abcdef=", "q=", "xyz="]
    completions = [
        [ids("5")],
        [ids("1"), ids("2"), ids("3"), tokenizer.eos_token_id],
        [ids("k"), ids("9")],
    ]
    batched = run_reward_model(
        model_state("reward", model), _rollout(prompts, completions), weight=1.0
    ).value.values
    # Each row alone has neither left nor right padding.
    alone = torch.cat(
        [
            run_reward_model(model_state("reward", model), _rollout([p], [c]), weight=1.0).value.values
            for p, c in zip(prompts, completions)
        ]
    )
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-5)
    assert batched.dtype == torch.float32 and batched.shape == (3,)


def test_a_token_budget_splits_the_forward_and_keeps_each_rows_score() -> None:
    tokenizer = build_char_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    model = tiny_scalar_model()
    torch.nn.init.normal_(model.head.weight, std=0.3)
    prompts = ["abcdef=", "q=", "xyz=", "ab="]
    completions = [[ids("5")], [ids("1"), ids("2"), ids("3"), tokenizer.eos_token_id], [ids("k"), ids("9")], []]
    rollout = _rollout(prompts, completions)
    tokens: list[int] = []
    handle = model.backbone.get_input_embeddings().register_forward_hook(
        lambda module, inputs, output: tokens.append(inputs[0].numel()))
    whole = run_reward_model(model_state("reward", model), rollout, weight=1.0).value.values
    # the whole batch: 4 rows x (7 prompt columns + 4 completion columns)
    # real lengths 8, 6, 6, 3 (an empty completion counts 1): with a budget of 12 no two rows
    # share a pass (2 x (3 + 4), 2 x (4 + 4), 2 x (7 + 2) are all above 12), each pass cut to
    # its own columns: 3, 6, 6 and 8 tokens, shortest first
    split = run_reward_model(model_state("reward", model), rollout, weight=1.0, micro_batch_tokens=12).value.values
    handle.remove()
    assert tokens == [44, 3, 6, 6, 8]
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)  # the rows back in their order
    # the probe model's scores are exact: the same ids as without a budget, row by row
    probe = run_reward_model(model_state("reward", ProbeModel()), rollout, weight=1.0, micro_batch_tokens=12)
    assert probe.value.values.tolist() == [float(ids("5")), float(tokenizer.eos_token_id), float(ids("9")), float(ids("="))]


def _own_tokenizer() -> Any:
    """A character tokenizer with other ids than the policy's (and its own special tokens)."""
    return ordered_char_tokenizer("upe|=9876543210zyxwvtsrqonmlkjihgfdcba")


def test_retokenize_reads_prompt_and_completion_texts_with_the_reward_model_s_tokenizer() -> None:
    policy = build_char_tokenizer()
    ids = policy.convert_tokens_to_ids
    own = _own_tokenizer()
    rollout = _rollout(["ab=", "q="], [[ids("1"), ids("2")], [ids("7"), policy.eos_token_id]])
    state = model_state("reward", ProbeModel())
    # the policy's ids: the last real token of each row, "2" and the end-of-sequence token
    plain = run_reward_model(state, rollout, weight=1.0).value.values.tolist()
    assert plain == [float(ids("2")), float(policy.eos_token_id)]
    # the texts "ab=12" and "q=7" through the reward model's tokenizer: its ids of "2" and "7"
    state.tokenizer = own
    texts = run_reward_model(state, rollout, weight=1.0, retokenize=True).value.values.tolist()
    assert texts == [float(own.convert_tokens_to_ids("2")), float(own.convert_tokens_to_ids("7"))]
    # chats through the reward model's chat template: "ab=|12|" ends with its "|"
    own.chat_template = "{% for message in messages %}{{ message['content'] }}|{% endfor %}"
    chats = replace(rollout, chat=True, data_prompts=[[{"role": "user", "content": "ab="}],
                                                      [{"role": "user", "content": "q="}]])
    assert reward_texts(chats, own) == (["ab=|12|", "q=|7|"], True)
    templated = run_reward_model(state, chats, weight=1.0, retokenize=True).value.values.tolist()
    assert templated == [float(own.convert_tokens_to_ids("|"))] * 2
    # a real model: a token budget splits the passes and keeps each row's score
    model = tiny_scalar_model()
    torch.nn.init.normal_(model.head.weight, std=0.3)
    scalar = model_state("reward", model)
    scalar.tokenizer = own
    whole = run_reward_model(scalar, rollout, weight=1.0, retokenize=True).value.values
    split = run_reward_model(scalar, rollout, weight=1.0, micro_batch_tokens=6, retokenize=True).value.values
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)
    # each row alone, tokenized by hand, scores the same as in the padded batch
    for row, text in enumerate(["ab=12", "q=7"]):
        encoded = own(text, return_tensors="pt")
        with torch.no_grad():
            alone = model(input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"],
                          position_ids=torch.arange(encoded["input_ids"].shape[1]).unsqueeze(0))[0, -1]
        torch.testing.assert_close(whole[row], alone.float(), atol=1e-5, rtol=1e-5)


def test_retokenized_texts_past_the_positions_keep_their_end_and_mixed_batches_read_plain() -> None:
    policy = build_char_tokenizer()
    ids = policy.convert_tokens_to_ids
    own = _own_tokenizer()
    own.chat_template = "{% for message in messages %}{{ message['content'] }}|{% endfor %}"
    rollout = _rollout(["ab=", "q="], [[ids("1"), ids("2")], [ids("7")]])
    # one chat row and one plain prompt: every row read as prompt text + completion
    mixed = replace(rollout, chat=True, data_prompts=[[{"role": "user", "content": "ab="}], "q="])
    assert reward_texts(mixed, own) == (["ab=12", "q=7"], False)
    # 72 characters through a model of 64 positions: the last 64 tokens, where the score is read
    model = tiny_scalar_model()
    torch.nn.init.normal_(model.head.weight, std=0.3)
    state = model_state("reward", model)
    state.tokenizer = own
    long = _rollout(["a" * 70 + "="], [[ids("5")]])
    score = run_reward_model(state, long, weight=1.0, retokenize=True).value.values
    end = own("a" * 70 + "=5", return_tensors="pt")["input_ids"][:, -64:]
    with torch.no_grad():
        alone = model(input_ids=end, attention_mask=torch.ones_like(end), position_ids=torch.arange(64).unsqueeze(0))
    torch.testing.assert_close(score[0], alone[0, -1].float(), atol=1e-5, rtol=1e-5)
    assert own.truncation_side == "right"  # the tokenizer's own setting is left as it was
