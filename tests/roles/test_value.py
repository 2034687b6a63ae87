"""The value role: which position's scalar becomes the value of each completion token."""

from __future__ import annotations

import torch

from flowrl.backends.tokenizer import build_char_tokenizer
from flowrl.roles.batch import Rollout
from flowrl.roles.value import completion_values, run_value
from tests.tiny_models import model_state, tiny_scalar_model


class ProbeModel(torch.nn.Module):
    """Scalar at each position = the token id there, so alignment is readable by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = torch.nn.Parameter(torch.zeros(1))

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        return input_ids.float()


def _rollout(prompts: list[str], completions: list[str], eos_rows: tuple[int, ...] = ()) -> Rollout:
    tokenizer = build_char_tokenizer()
    encoded = tokenizer(
        prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False
    )
    rows = [
        tokenizer.convert_tokens_to_ids(list(text))
        + ([tokenizer.eos_token_id] if i in eos_rows else [])
        for i, text in enumerate(completions)
    ]
    width = max(len(row) for row in rows)
    completion_ids = torch.zeros((len(rows), width), dtype=torch.long)
    completion_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        completion_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        completion_mask[i, : len(row)] = 1
    return Rollout(
        prompt_ids=encoded["input_ids"],
        prompt_mask=encoded["attention_mask"],
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        group_size=1,
        prompts=prompts,
        completions=completions,
        answers=[None] * len(prompts),
        max_new_tokens=4,
        temperature=1.0,
    )


def test_value_of_each_completion_token_is_read_at_the_position_that_predicts_it() -> None:
    tokenizer = build_char_tokenizer()
    rollout = _rollout(["ab=", "c="], ["12", "x"], eos_rows=(1,))
    output = run_value(model_state("critic", ProbeModel()), rollout)
    ids = tokenizer.convert_tokens_to_ids
    # Row 0: joined "ab=" + "12"; completion token "1" is predicted at "=", "2" at "1".
    # Row 1: joined <pad> "c=" + "x" <eos>; "x" predicted at "=", <eos> at "x".
    expected = torch.tensor([[ids("="), ids("1")], [ids("="), ids("x")]], dtype=torch.float32)
    assert output.value.dtype == torch.float32
    assert torch.equal(output.value, expected)


def test_padding_is_zero_and_all_padding_columns_are_not_computed() -> None:
    tokenizer = build_char_tokenizer()
    rollout = _rollout(["ab=", "ab="], ["123", "4"])
    # Two trailing padding columns in every row (as when all samples stopped early).
    rollout.completion_ids = torch.nn.functional.pad(rollout.completion_ids, (0, 2))
    rollout.completion_mask = torch.nn.functional.pad(rollout.completion_mask, (0, 2))
    values = run_value(model_state("critic", ProbeModel()), rollout).value
    ids = tokenizer.convert_tokens_to_ids
    assert values.shape == (2, 5)
    assert values[0].tolist() == [ids("="), ids("1"), ids("2"), 0, 0]
    assert values[1].tolist() == [ids("="), 0, 0, 0, 0]


def test_real_model_values_match_the_full_forward_and_micro_batches() -> None:
    model = tiny_scalar_model()
    torch.nn.init.normal_(model.head.weight, std=0.3)
    rollout = _rollout(["abc=", "d=", "ef="], ["12", "xyz", "7"], eos_rows=(0,))
    output = run_value(model_state("critic", model), rollout)
    input_ids, attention_mask, position_ids = rollout.joined()
    with torch.no_grad():
        full = model(input_ids, attention_mask, position_ids)
    prompt_width = rollout.prompt_ids.shape[1]
    expected = full[:, prompt_width - 1 : prompt_width - 1 + rollout.completion_ids.shape[1]]
    expected = expected * rollout.completion_mask
    torch.testing.assert_close(output.value, expected, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        chunked = completion_values(model, rollout, torch.device("cpu"), micro_batch_tokens=1)
    torch.testing.assert_close(chunked * rollout.completion_mask, expected, atol=1e-5, rtol=1e-5)
    assert "critic/values/mean" in output.metrics
