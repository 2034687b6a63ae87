"""PromptSource: built-in tasks, JSON Lines files, deterministic batches, and every DataError."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from flowrl.data import BUILTIN_TASKS, PromptExample, PromptSource
from flowrl.errors import DataError


def _write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def _prompts(batch: list[PromptExample]) -> list[str]:
    return [example.prompt for example in batch]


# --- built-in tasks ------------------------------------------------------------------------


def test_builtin_digits_prompts(tmp_path: Path) -> None:
    batch = PromptSource("builtin:digits", batch_size=5, seed=0, base_dir=tmp_path).next_batch(0)
    assert len(batch) == 5
    for example in batch:
        assert re.fullmatch(r"[a-z]{8}=", example.prompt)
        assert example.answer is None
        assert example.meta == {"task": "digits"}


def test_builtin_first_letter_answer_is_the_first_letter(tmp_path: Path) -> None:
    batch = PromptSource("builtin:first_letter", 4, seed=1, base_dir=tmp_path).next_batch(3)
    for example in batch:
        assert re.fullmatch(r"[a-z]{8}=", example.prompt)
        assert example.answer == example.prompt[0]
    assert BUILTIN_TASKS["first_letter"].reward == "first_letter"


def test_builtin_batches_are_a_function_of_seed_and_step(tmp_path: Path) -> None:
    first = PromptSource("builtin:digits", 4, seed=7, base_dir=tmp_path)
    again = PromptSource("builtin:digits", 4, seed=7, base_dir=tmp_path)
    # Asking for step 5 first (a resumed run) gives what a run from step 0 sees at step 5.
    resumed = again.next_batch(5)
    for step in range(5):
        first.next_batch(step)
    assert first.next_batch(5) == resumed
    assert _prompts(first.next_batch(5)) != _prompts(first.next_batch(6))
    other_seed = PromptSource("builtin:digits", 4, seed=8, base_dir=tmp_path)
    assert _prompts(other_seed.next_batch(5)) != _prompts(resumed)


def test_unknown_builtin_suggests_the_nearest(tmp_path: Path) -> None:
    expected = r"unknown built-in task 'digit' \(did you mean 'builtin:digits'\?\)"
    with pytest.raises(DataError, match=expected):
        PromptSource("builtin:digit", 4, seed=0, base_dir=tmp_path)


def test_builtin_name_without_prefix(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="did you mean the built-in task 'builtin:digits'"):
        PromptSource("digits", 4, seed=0, base_dir=tmp_path)


# --- JSON Lines ----------------------------------------------------------------------------


def test_jsonl_fields_answers_and_meta(tmp_path: Path) -> None:
    _write_jsonl(
        tmp_path / "data.jsonl",
        [
            {"prompt": "2+2=", "answer": "4", "id": 7},
            {"prompt": "3+3=", "answer": 6},
            {"prompt": "say hi"},
            {"prompt": "nothing", "answer": None},
        ],
    )
    source = PromptSource("data.jsonl", 4, seed=0, base_dir=tmp_path, shuffle=False)
    batch = source.next_batch(0)
    assert _prompts(batch) == ["2+2=", "3+3=", "say hi", "nothing"]
    assert [example.answer for example in batch] == ["4", "6", None, None]
    assert batch[0].meta == {"line": 1, "fields": {"id": 7}}
    assert source.num_examples == 4


def test_blank_lines_are_skipped_and_line_numbers_kept(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").write_text('\n{"prompt": "a"}\n   \n{"prompt": "b"}\n')
    batch = PromptSource("d.jsonl", 2, seed=0, base_dir=tmp_path, shuffle=False).next_batch(0)
    assert [example.meta["line"] for example in batch] == [2, 4]


def test_custom_field_names(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "q.jsonl", [{"question": "why?", "solution": "because"}])
    source = PromptSource(
        "q.jsonl", 1, 0, tmp_path, prompt_field="question", answer_field="solution"
    )
    assert source.next_batch(0) == [
        PromptExample("why?", "because", {"line": 1, "fields": {}})
    ]


def test_unshuffled_order_wraps_across_the_epoch_boundary(tmp_path: Path) -> None:
    # 5 examples, batch 2: step 0 = [0, 1], step 1 = [2, 3], step 2 = [4, 0] (crosses into
    # epoch 1 without skipping example 4), step 3 = [1, 2].
    _write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}"} for i in range(5)])
    source = PromptSource("d.jsonl", 2, seed=0, base_dir=tmp_path, shuffle=False)
    assert [_prompts(source.next_batch(step)) for step in range(4)] == [
        ["p0", "p1"], ["p2", "p3"], ["p4", "p0"], ["p1", "p2"]
    ]
    assert source.epoch_of(2) == 0 and source.epoch_of(3) == 1


def test_shuffled_epochs_are_permutations_and_resume_is_exact(tmp_path: Path) -> None:
    # 5 examples, batch 2, steps 0..4 = 10 stream positions = exactly 2 epochs: each half of
    # the stream must hold every example once, whatever the permutation.
    _write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}"} for i in range(5)])
    source = PromptSource("d.jsonl", 2, seed=3, base_dir=tmp_path)
    stream = [prompt for step in range(5) for prompt in _prompts(source.next_batch(step))]
    expected = {f"p{i}" for i in range(5)}
    assert sorted(stream[:5]) == sorted(expected) and sorted(stream[5:]) == sorted(expected)
    # A fresh source (a resumed run) asked for step 3 directly gives the same batch.
    resumed = PromptSource("d.jsonl", 2, seed=3, base_dir=tmp_path)
    assert _prompts(resumed.next_batch(3)) == stream[6:8]


def test_epochs_get_different_permutations(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}"} for i in range(20)])
    source = PromptSource("d.jsonl", 20, seed=0, base_dir=tmp_path)
    epoch0, epoch1 = _prompts(source.next_batch(0)), _prompts(source.next_batch(1))
    assert sorted(epoch0) == sorted(epoch1) and epoch0 != epoch1
    other_seed = PromptSource("d.jsonl", 20, seed=1, base_dir=tmp_path)
    assert _prompts(other_seed.next_batch(0)) != epoch0


def test_batch_larger_than_the_dataset(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    source = PromptSource("d.jsonl", 5, seed=0, base_dir=tmp_path, shuffle=False)
    assert _prompts(source.next_batch(0)) == ["a", "b", "a", "b", "a"]


def test_relative_and_absolute_paths(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    path = _write_jsonl(tmp_path / "sub" / "d.jsonl", [{"prompt": "x"}])
    relative = PromptSource("sub/d.jsonl", 1, 0, base_dir=tmp_path)
    absolute = PromptSource(str(path), 1, 0, base_dir=Path("/nonexistent"))
    assert relative.next_batch(0) == absolute.next_batch(0)


def test_every_bad_line_is_reported(tmp_path: Path) -> None:
    (tmp_path / "data.jsonl").write_text(
        "\n".join(
            [
                '{"prompt": "fine"}',
                '{"prompt": "unterminated',
                "[1, 2]",
                '{"question": "q", "answer": "a"}',
                '{"prompt": 12}',
                '{"prompt": ""}',
                '{"prompt": "ok", "answer": [1]}',
            ]
        )
    )
    with pytest.raises(DataError) as caught:
        PromptSource("data.jsonl", 1, 0, base_dir=tmp_path)
    lines = str(caught.value).splitlines()
    expect = "expected a JSON object with a string field 'prompt', found"
    assert lines[0] == "6 bad lines in data.jsonl:"
    assert lines[1].startswith(f"  data.jsonl:2: {expect} invalid JSON (Unterminated string")
    assert lines[2] == f"  data.jsonl:3: {expect} an array: [1, 2]"
    assert lines[3] == (
        f"  data.jsonl:4: {expect} an object without it (fields: 'question', 'answer'; "
        "set data.prompt_field if the prompt is under another name)"
    )
    assert lines[4] == f"  data.jsonl:5: {expect} 'prompt': 12 (a number)"
    assert lines[5] == f"  data.jsonl:6: {expect} an empty 'prompt'"
    assert lines[6] == (
        f"  data.jsonl:7: {expect} 'answer': [1] (the answer must be a string, a number or null)"
    )


def test_at_most_twenty_bad_lines_are_listed(tmp_path: Path) -> None:
    (tmp_path / "bad.jsonl").write_text("nope\n" * 25)
    with pytest.raises(DataError) as caught:
        PromptSource("bad.jsonl", 1, 0, base_dir=tmp_path)
    lines = str(caught.value).splitlines()
    assert lines[0] == "25 bad lines in bad.jsonl:"
    assert len(lines) == 1 + 20 + 1 and lines[-1] == "  ... and 5 more"
    assert lines[20].startswith("  bad.jsonl:20:")


def test_missing_empty_and_directory_sources(tmp_path: Path) -> None:
    expected = r"data file train\.jsonl not found \(looked at .*train\.jsonl\).*builtin:digits"
    with pytest.raises(DataError, match=expected):
        PromptSource("train.jsonl", 1, 0, base_dir=tmp_path)
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    with pytest.raises(DataError, match=r"empty\.jsonl is empty; write one JSON object per line"):
        PromptSource("empty.jsonl", 1, 0, base_dir=tmp_path)
    (tmp_path / "folder").mkdir()
    with pytest.raises(DataError, match="is a directory"):
        PromptSource("folder", 1, 0, base_dir=tmp_path)


def test_batch_size_and_step_checks(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="batch_size must be >= 1"):
        PromptSource("builtin:digits", 0, 0, base_dir=tmp_path)
    with pytest.raises(ValueError, match="step must be >= 0"):
        PromptSource("builtin:digits", 1, 0, base_dir=tmp_path).next_batch(-1)


def test_from_spec_and_describe(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}"} for i in range(6)])
    spec = SimpleNamespace(
        source="d.jsonl", batch_size=4, shuffle=True, prompt_field="prompt", answer_field="answer"
    )
    source = PromptSource.from_spec(spec, seed=2, base_dir=tmp_path)
    assert source.describe() == (
        "d.jsonl: 6 prompts, shuffled each epoch (seed 2), 4 per step (1.5 steps per epoch)"
    )
    builtin = PromptSource("builtin:first_letter", 8, seed=0, base_dir=tmp_path)
    assert builtin.describe().startswith("builtin:first_letter: 8 random letters + '='")
    assert builtin.num_examples is None
