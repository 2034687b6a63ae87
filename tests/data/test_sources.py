"""PromptSource: built-in tasks, data files, saved datasets, chats, prompt lengths, deterministic batches, and every DataError."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

import datasets

from flowrl.backends.tokenizer import build_char_tokenizer
from flowrl.data import BUILTIN_TASKS, PromptExample, PromptFormatter, PromptSource
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
        assert example.meta == {"task": "digits"} and example.columns == {"prompt": example.prompt}


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
    expected = r"unknown built-in data 'digit' \(did you mean 'builtin:digits'\?\)"
    with pytest.raises(DataError, match=expected):
        PromptSource("builtin:digit", 4, seed=0, base_dir=tmp_path)


def test_builtin_name_without_prefix(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="did you mean the built-in task 'builtin:digits'"):
        PromptSource("digits", 4, seed=0, base_dir=tmp_path)


# --- data files ----------------------------------------------------------------------------


def test_jsonl_answers_and_columns(tmp_path: Path) -> None:
    _write_jsonl(
        tmp_path / "data.jsonl",
        [
            {"prompt": "2+2=", "answer": "4", "id": 7},
            {"prompt": "3+3=", "answer": "6"},
            {"prompt": "say hi"},
            {"prompt": "nothing", "answer": None},
        ],
    )
    source = PromptSource("data.jsonl", 4, seed=0, base_dir=tmp_path, shuffle=False)
    batch = source.next_batch(0)
    assert _prompts(batch) == ["2+2=", "3+3=", "say hi", "nothing"]
    assert [example.answer for example in batch] == ["4", "6", None, None]
    # every column by name (a column some rows lack is None there); the answer also as 'answer'
    assert batch[0].columns == {"prompt": "2+2=", "answer": "4", "id": 7}
    assert batch[1].columns["id"] is None
    assert batch[0].meta == {"source": "data.jsonl", "row": 1, "truncated": False}
    assert source.num_examples == 4


def test_custom_keys_pass_the_answer_under_both_names(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "q.jsonl", [{"question": "why?", "solution": "because"}])
    source = PromptSource("q.jsonl", 1, 0, tmp_path, prompt_key="question", answer_key="solution")
    (example,) = source.next_batch(0)
    assert (example.prompt, example.answer) == ("why?", "because")
    assert example.columns == {"question": "why?", "solution": "because", "answer": "because"}


def test_parquet_csv_and_json_files_read_alike(tmp_path: Path) -> None:
    rows = {"prompt": ["1+1=", "2+3="], "answer": ["2", "5"]}
    datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / "d.parquet"))
    (tmp_path / "d.csv").write_text("prompt,answer\n1+1=,2\n2+3=,5\n")
    (tmp_path / "d.json").write_text(json.dumps([{"prompt": p, "answer": a} for p, a in zip(*rows.values())]))
    for name in ("d.parquet", "d.csv", "d.json"):
        batch = PromptSource(name, 2, seed=0, base_dir=tmp_path, shuffle=False).next_batch(0)
        assert [(e.prompt, e.answer) for e in batch] == [("1+1=", "2"), ("2+3=", "5")], name


def test_save_to_disk_folders_and_splits(tmp_path: Path) -> None:
    splits = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"prompt": ["a", "b", "c"], "answer": ["1", "2", "3"]}),
        "test": datasets.Dataset.from_dict({"prompt": ["z"], "answer": ["9"]}),
    })
    splits.save_to_disk(str(tmp_path / "saved"))
    train = PromptSource("saved", 3, 0, tmp_path, shuffle=False)
    assert _prompts(train.next_batch(0)) == ["a", "b", "c"]
    test = PromptSource("saved", 1, 0, tmp_path, split="test")
    assert _prompts(test.next_batch(0)) == ["z"]
    with pytest.raises(DataError, match=r"saved has no split 'validation'; its splits are: train, test"):
        PromptSource("saved", 1, 0, tmp_path, split="validation")
    # a single saved Dataset is the split 'train'
    splits["test"].save_to_disk(str(tmp_path / "one"))
    assert _prompts(PromptSource("one", 1, 0, tmp_path).next_batch(0)) == ["z"]
    # a folder of data files named by split
    (tmp_path / "files").mkdir()
    splits["train"].to_parquet(str(tmp_path / "files" / "train.parquet"))
    splits["test"].to_parquet(str(tmp_path / "files" / "test.parquet"))
    assert _prompts(PromptSource("files", 1, 0, tmp_path, split="test").next_batch(0)) == ["z"]


def test_a_single_file_is_the_train_split(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}])
    with pytest.raises(DataError, match=r"d\.jsonl is a single data file, which is the split 'train'; asked for split 'test'") as caught:
        PromptSource("d.jsonl", 1, 0, tmp_path, split="test")
    assert caught.value.field == "data.split"  # placed at the split's line, not the source's


def test_hub_names_without_network_say_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataError) as caught:
        PromptSource("someone/no-such-dataset", 1, 0, tmp_path)
    assert "dataset 'someone/no-such-dataset' is not a local file or folder and the hub cannot be reached" in str(caught.value)
    assert "save_to_disk" in str(caught.value)


def test_reserved_column_names_are_refused(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completions": "x"}])
    with pytest.raises(DataError, match="column 'completions', which reward functions receive from flowrl"):
        PromptSource("d.jsonl", 1, 0, tmp_path)
    _write_jsonl(tmp_path / "e.jsonl", [{"prompt": "a", "answer": "x", "solution": "y"}])
    with pytest.raises(DataError, match="'answer'"):
        PromptSource("e.jsonl", 1, 0, tmp_path, answer_key="solution")


# --- chats and prompt lengths --------------------------------------------------------------


def _chat_tokenizer() -> object:
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def test_chat_messages_are_rendered_with_the_template(tmp_path: Path) -> None:
    chats = [
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2"}],
        [{"role": "user", "content": "3+3"}],
    ]
    _write_jsonl(tmp_path / "c.jsonl", [{"messages": chat, "answer": a} for chat, a in zip(chats, ["4", "6"])])
    formatter = PromptFormatter(_chat_tokenizer())
    source = PromptSource("c.jsonl", 2, 0, tmp_path, shuffle=False, prompt_key="messages", formatter=formatter)
    first, second = source.next_batch(0)
    assert first.prompt == "system: be brief user: 2+2 assistant: "
    assert second.prompt == "user: 3+3 assistant: "
    # reward functions get the messages themselves as the prompt
    assert first.chat and first.reward_prompt == chats[0] and first.answer == "4"
    assert source.counts.num_chat == 2


def test_chat_data_without_a_template_fails_before_training(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "c.jsonl", [{"prompt": [{"role": "user", "content": "hi"}]}])
    formatter = PromptFormatter(build_char_tokenizer(), tokenizer_name="model 'actor'")
    with pytest.raises(DataError, match="chat messages, but the tokenizer of model 'actor' has no chat template"):
        PromptSource("c.jsonl", 1, 0, tmp_path, formatter=formatter)


def test_malformed_chats_are_listed(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "c.jsonl", [{"prompt": [{"role": "user"}]}, {"prompt": []}])
    with pytest.raises(DataError) as caught:
        PromptSource("c.jsonl", 1, 0, tmp_path, formatter=PromptFormatter(_chat_tokenizer()))
    text = str(caught.value)
    assert "c.jsonl: row 1: 'prompt' is a list but message 0 is not {role: str, content: str}" in text
    assert "c.jsonl: row 2: 'prompt' is a list but it is empty" in text


def _lengths_file(tmp_path: Path) -> None:
    # character tokenizer: one token per character -> lengths 3, 6 and 10
    _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "abc"}, {"prompt": "abcdef"}, {"prompt": "0123456789"}])


def test_overlong_prompts_error_by_default(tmp_path: Path) -> None:
    _lengths_file(tmp_path)
    formatter = PromptFormatter(build_char_tokenizer(), max_prompt_tokens=5)
    with pytest.raises(DataError) as caught:
        PromptSource("d.jsonl", 1, 0, tmp_path, formatter=formatter)
    text = str(caught.value)
    assert text.startswith("2 bad rows in d.jsonl (longer than data.max_prompt_tokens = 5 tokens")
    assert "d.jsonl: row 2: 6 tokens" in text and "d.jsonl: row 3: 10 tokens" in text
    assert "overlong_prompts to truncate_left or skip" in text


def test_overlong_prompts_truncated_on_the_left(tmp_path: Path) -> None:
    _lengths_file(tmp_path)
    formatter = PromptFormatter(build_char_tokenizer(), max_prompt_tokens=5, overlong="truncate_left")
    source = PromptSource("d.jsonl", 3, 0, tmp_path, shuffle=False, formatter=formatter)
    batch = source.next_batch(0)
    # the last 5 tokens are kept: "bcdef", "56789"; ids 4.. are a-z, 56.. are 0-9
    assert _prompts(batch) == ["abc", "bcdef", "56789"]
    assert batch[0].prompt_ids is None
    assert batch[1].prompt_ids == (5, 6, 7, 8, 9) and batch[2].prompt_ids == (61, 62, 63, 64, 65)
    assert batch[2].columns["prompt"] == "0123456789" and batch[2].meta["truncated"]
    assert source.counts.num_truncated == 2
    assert "2 truncated on the left" in source.describe()


def test_overlong_prompts_skipped(tmp_path: Path) -> None:
    _lengths_file(tmp_path)
    formatter = PromptFormatter(build_char_tokenizer(), max_prompt_tokens=6, overlong="skip")
    source = PromptSource("d.jsonl", 2, 0, tmp_path, shuffle=False, formatter=formatter)
    assert source.num_examples == 2 and _prompts(source.next_batch(0)) == ["abc", "abcdef"]
    assert source.counts.num_skipped == 1
    everything = PromptFormatter(build_char_tokenizer(), max_prompt_tokens=2, overlong="skip")
    with pytest.raises(DataError, match="holds no usable prompt"):
        PromptSource("d.jsonl", 1, 0, tmp_path, formatter=everything)


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
    assert _prompts(relative.next_batch(0)) == _prompts(absolute.next_batch(0)) == ["x"]


def test_a_bad_line_in_a_folder_of_split_files_is_named_by_file_and_line(tmp_path: Path) -> None:
    """datasets said only "JSON parse error: Column(/answer) changed from string to number"."""
    (tmp_path / "data").mkdir()
    _write_jsonl(tmp_path / "data" / "train.jsonl", [{"prompt": "a", "answer": "1"}])
    (tmp_path / "data" / "test.jsonl").write_text('{"prompt": "b", "answer": "2"}\n{"prompt": "c", "answer": 3\n')
    with pytest.raises(DataError) as caught:
        PromptSource("data", 1, 0, base_dir=tmp_path, split="train")
    lines = str(caught.value).splitlines()
    assert lines[0].startswith("1 bad line in data/test.jsonl (one JSON object per line")
    assert lines[1].startswith("  data/test.jsonl:2: expected a JSON object, found invalid JSON")


def test_every_bad_line_and_row_is_reported(tmp_path: Path) -> None:
    (tmp_path / "data.jsonl").write_text(
        "\n".join(['{"prompt": "fine"}', '{"prompt": "unterminated', "[1, 2]"])
    )
    with pytest.raises(DataError) as caught:
        PromptSource("data.jsonl", 1, 0, base_dir=tmp_path)
    lines = str(caught.value).splitlines()
    assert lines[0].startswith("2 bad lines in data.jsonl (one JSON object per line")
    assert lines[1].startswith("  data.jsonl:2: expected a JSON object, found invalid JSON (Unterminated string")
    assert lines[2] == "  data.jsonl:3: expected a JSON object, found an array: [1, 2]"
    (tmp_path / "rows.jsonl").write_text(
        "\n".join(['{"prompt": "fine"}', '{"question": "q"}', '{"prompt": 12}', '{"prompt": ""}', '{"prompt": " \\n "}'])
    )
    with pytest.raises(DataError) as caught:
        PromptSource("rows.jsonl", 1, 0, base_dir=tmp_path)
    lines = str(caught.value).splitlines()
    assert lines[0] == "4 bad rows in rows.jsonl (each row needs a non-empty string or a list of chat messages in 'prompt'):"
    assert lines[1:] == [
        "  rows.jsonl: row 2: 'prompt' is null (missing in this row, or an empty CSV cell)",
        "  rows.jsonl: row 3: 'prompt' is int 12",
        "  rows.jsonl: row 4: an empty 'prompt'",
        "  rows.jsonl: row 5: only white space in 'prompt'",
    ]
    _write_jsonl(tmp_path / "q.jsonl", [{"question": "q"}])
    with pytest.raises(DataError, match=r"q\.jsonl has no column 'prompt' \(columns: question\); set data.prompt_key"):
        PromptSource("q.jsonl", 1, 0, base_dir=tmp_path)


def test_at_most_twenty_bad_lines_are_listed(tmp_path: Path) -> None:
    (tmp_path / "bad.jsonl").write_text("nope\n" * 25)
    with pytest.raises(DataError) as caught:
        PromptSource("bad.jsonl", 1, 0, base_dir=tmp_path)
    lines = str(caught.value).splitlines()
    assert lines[0].startswith("25 bad lines in bad.jsonl")
    assert len(lines) == 1 + 20 + 1 and lines[-1] == "  ... and 5 more"
    assert lines[20].startswith("  bad.jsonl:20:")


def test_missing_empty_and_odd_sources(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"data source 'train\.jsonl' not found .*builtin:digits"):
        PromptSource("train.jsonl", 1, 0, base_dir=tmp_path)
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    with pytest.raises(DataError, match=r"data file empty\.jsonl is empty"):
        PromptSource("empty.jsonl", 1, 0, base_dir=tmp_path)
    # a CSV file with its header alone, a Parquet file of no rows: named as empty too
    (tmp_path / "header.csv").write_text("prompt,answer\n")
    with pytest.raises(DataError, match=r"data file header\.csv is empty \(it has no rows\)"):
        PromptSource("header.csv", 1, 0, base_dir=tmp_path)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "none.parquet")
    with pytest.raises(DataError, match=r"data file none\.parquet is empty \(it has no rows\)"):
        PromptSource("none.parquet", 1, 0, base_dir=tmp_path)
    (tmp_path / "folder").mkdir()
    with pytest.raises(DataError, match="holds neither a dataset written by save_to_disk nor data files"):
        PromptSource("folder", 1, 0, base_dir=tmp_path)
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(DataError, match=r"has suffix '\.txt'; expected one of \.parquet, \.jsonl, \.json, \.csv"):
        PromptSource("d.txt", 1, 0, base_dir=tmp_path)
    # a folder with an empty split file: named, whichever split is read
    (tmp_path / "splits").mkdir()
    _write_jsonl(tmp_path / "splits" / "train.jsonl", [{"prompt": "p"}])
    (tmp_path / "splits" / "test.jsonl").write_text("")
    with pytest.raises(DataError, match=r"folder splits has empty data file test\.jsonl \(split 'train' is read"):
        PromptSource("splits", 1, 0, base_dir=tmp_path)


def test_batch_size_and_step_checks(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="batch_size must be >= 1"):
        PromptSource("builtin:digits", 0, 0, base_dir=tmp_path)
    with pytest.raises(ValueError, match="step must be >= 0"):
        PromptSource("builtin:digits", 1, 0, base_dir=tmp_path).next_batch(-1)


def test_from_spec_and_describe(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}"} for i in range(6)])
    spec = SimpleNamespace(
        source="d.jsonl", batch_size=4, shuffle=True, prompt_key="prompt", answer_key="answer", split="train", subset=None
    )
    source = PromptSource.from_spec(spec, seed=2, base_dir=tmp_path)
    assert source.describe() == (
        "d.jsonl: 6 prompts, shuffled each epoch (seed 2), 4 per step (1.5 steps per epoch)"
    )
    builtin = PromptSource("builtin:first_letter", 8, seed=0, base_dir=tmp_path)
    assert builtin.describe().startswith("builtin:first_letter: 8 random letters + '='")
    assert builtin.num_examples is None
    # the task's own reward is named only where a score node uses it (not under a reward model)
    assert builtin.describe({"first_letter"}) == (
        "builtin:first_letter: 8 random letters + '='; reward: repeat the prompt's first letter; "
        "8 random prompts per step (seed 0)"
    )
    assert builtin.describe(set()) == "builtin:first_letter: 8 random letters + '='; 8 random prompts per step (seed 0)"


def test_an_unreachable_hub_is_asked_once_and_datasets_reads_its_cache_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without network datasets would retry for half a minute; offline it answers from its
    cache at once. The process's own setting comes back afterwards."""
    import datasets
    import datasets.config
    import huggingface_hub.constants

    from flowrl.data import files

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    probes: list[float] = []
    monkeypatch.setattr(files, "hub_reachable", lambda timeout_s: probes.append(timeout_s) or False)
    seen: list[tuple[bool, bool]] = []
    load = datasets.load_dataset

    def recording_load(*args: object, **kwargs: object) -> object:
        seen.append((datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE))
        return load(*args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", recording_load)
    with pytest.raises(DataError, match="the hub cannot be reached"):
        PromptSource("someone/no-such-dataset", 1, 0, tmp_path)
    assert len(probes) == 1 and seen == [(True, True)]
    assert datasets.config.HF_HUB_OFFLINE is False and huggingface_hub.constants.HF_HUB_OFFLINE is False


def test_a_batch_larger_than_the_data_is_named(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}"} for i in range(4)])
    assert PromptSource("d.jsonl", 4, 0, tmp_path).batch_warning() is None
    assert PromptSource("d.jsonl", 10, 0, tmp_path).batch_warning() == (
        "data.batch_size 10 is larger than the 4 prompts of d.jsonl: every step repeats prompts (2.5 epochs per "
        "step); lower data.batch_size or add prompts")
    assert PromptSource("builtin:digits", 400, 0, tmp_path).batch_warning() is None  # fresh prompts each step


def test_an_answer_key_the_data_lacks_beside_an_answer_column_is_named(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    with pytest.raises(DataError, match=r"d\.jsonl has no column 'solution' \(data\.answer_key; its columns: 'prompt', "
                                        r"'answer'\); set data\.answer_key: answer"):
        PromptSource("d.jsonl", 1, 0, base_dir=tmp_path, answer_key="solution")



def test_an_answer_key_named_on_purpose_that_the_data_lacks_is_refused(tmp_path: Path) -> None:
    # a typo'd answer_key would leave every reward without its reference answers, silently
    # when no reward needs one; the default 'answer' may be absent (not every task has one)
    _write_jsonl(tmp_path / "d.jsonl", [{"question": "1+1=", "solution": "2"}])
    with pytest.raises(DataError) as caught:
        PromptSource("d.jsonl", 1, 0, base_dir=tmp_path, prompt_key="question", answer_key="soluton")
    assert str(caught.value) == (
        "d.jsonl has no column 'soluton' (data.answer_key; its columns: 'question', 'solution'); set "
        "data.answer_key to the column that holds the reference answers (did you mean 'solution'?), or leave it "
        "out when there are none")
    assert caught.value.field == "data.answer_key"
    assert PromptSource("d.jsonl", 1, 0, base_dir=tmp_path, prompt_key="question").num_examples == 1


def test_held_out_data_that_inherits_the_answer_key_may_lack_the_column(tmp_path: Path) -> None:
    from flowrl.data.source import read_examples

    _write_jsonl(tmp_path / "held.jsonl", [{"prompt": "1+1="}])
    examples, _ = read_examples("held.jsonl", "train", None, tmp_path, answer_key="solution", section="eval",
                                answer_key_named=False)  # data.answer_key, not eval's own
    assert len(examples) == 1
    with pytest.raises(DataError, match=r"no column 'solution' \(eval\.answer_key"):
        read_examples("held.jsonl", "train", None, tmp_path, answer_key="solution", section="eval")


def test_without_max_prompt_tokens_truncate_left_and_skip_cut_at_the_room_the_model_leaves(tmp_path: Path) -> None:
    _lengths_file(tmp_path)
    why = "model 'actor' takes at most 21 tokens and nodes.rollout.max_new_tokens is 16"
    error = PromptFormatter(build_char_tokenizer(), room=5, room_why=why)
    with pytest.raises(DataError) as caught:
        PromptSource("d.jsonl", 1, 0, tmp_path, formatter=error)
    assert "longer than the 5 tokens" in str(caught.value) and "set data.overlong_prompts: truncate_left or skip" \
        in str(caught.value)
    cut = PromptFormatter(build_char_tokenizer(), overlong="truncate_left", room=5, room_why=why)
    source = PromptSource("d.jsonl", 3, 0, tmp_path, shuffle=False, formatter=cut)
    batch = source.next_batch(0)
    assert _prompts(batch) == ["abc", "bcdef", "56789"] and source.counts.num_truncated == 2
    # counted in the step's metrics as with max_prompt_tokens, and named by the room
    assert source.length_metrics(batch) == {"data/prompts_truncated": 2.0, "data/prompts_skipped": 0.0}
    assert "2 truncated on the left to the 5 tokens a prompt has room for" in source.describe()
    left_out = PromptFormatter(build_char_tokenizer(), overlong="skip", room=6, room_why=why)
    source = PromptSource("d.jsonl", 2, 0, tmp_path, shuffle=False, formatter=left_out)
    batch = source.next_batch(0)
    assert _prompts(batch) == ["abc", "abcdef"] and source.counts.num_skipped == 1
    assert source.length_metrics(batch) == {"data/prompts_truncated": 0.0, "data/prompts_skipped": 1.0}
    assert "1 longer than the 6 tokens a prompt has room for skipped" in source.describe()
    # no bound at all: no such metrics
    plain = PromptSource("d.jsonl", 2, 0, tmp_path, shuffle=False, formatter=PromptFormatter(build_char_tokenizer()))
    assert plain.length_metrics(plain.next_batch(0)) == {}


def test_a_built_in_task_s_prompts_meet_the_room_the_model_leaves(tmp_path: Path) -> None:
    """A GPT-2 of 16 positions with 12 new tokens: the digits task's 9-token prompts ran past
    its position table (IndexError mid-run), where a data file's were refused up front."""
    why = "model 'actor' takes at most 16 tokens per sequence and nodes.rollout.max_new_tokens is 12"
    with pytest.raises(DataError, match=r"longer than the 4 tokens .* a prompt has room for: .*; set "
                                        r"data.overlong_prompts: truncate_left \(at that room"):  # not skip
        PromptSource("builtin:digits", 2, 0, None, formatter=PromptFormatter(build_char_tokenizer(), room=4, room_why=why))
    skip = PromptFormatter(build_char_tokenizer(), overlong="skip", room=4, room_why=why)
    with pytest.raises(DataError, match="a built-in task cannot skip them; set overlong_prompts: truncate_left, or "
                                        "ask for fewer new tokens"):
        PromptSource("builtin:digits", 2, 0, None, formatter=skip)
    cut = PromptFormatter(build_char_tokenizer(), overlong="truncate_left", room=4, room_why=why)
    batch = PromptSource("builtin:digits", 2, 0, None, formatter=cut).next_batch(3)
    assert all(len(example.prompt_ids or ()) == 4 and example.prompt.endswith("=") for example in batch)
    roomy = PromptFormatter(build_char_tokenizer(), room=9, room_why=why)  # 9 tokens fit
    assert len(PromptSource("builtin:digits", 2, 0, None, formatter=roomy).next_batch(0)) == 2


def test_a_built_in_task_s_prompts_of_varying_subword_lengths_are_checked_over_the_first_steps() -> None:
    """With a subword tokenizer the random prompts' lengths vary: one checked at step 0 passed
    construction and stopped the run at a later step."""
    import string

    from tokenizers import Tokenizer, models, trainers
    from transformers import PreTrainedTokenizerFast

    from flowrl.data.source import TASK_STEPS_CHECKED

    made = PromptSource("builtin:digits", 4, 0, None)
    corpus = [example.prompt for step in range(100, 400) for example in made.next_batch(step)]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<pad>", "<eos>"],
                                                        initial_alphabet=list(string.ascii_lowercase + "=")))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    one = PromptSource("builtin:digits", 1, 0, None)
    lengths = [len(tokenizer(one.next_batch(step)[0].prompt, add_special_tokens=False)["input_ids"])
               for step in range(TASK_STEPS_CHECKED)]
    assert lengths[0] < max(lengths)  # step 0's prompt fits a room its later ones do not
    room = max(lengths) - 1
    with pytest.raises(DataError, match=f"longer than the {room} tokens"):
        PromptSource("builtin:digits", 1, 0, None, formatter=PromptFormatter(tokenizer, room=room, room_why="x"))


def test_a_folder_as_a_hub_dataset_download_lays_it_out_reads_its_splits(tmp_path: Path) -> None:
    """data/train-00000-of-00002.parquet ...: the files sit a folder below, their names give the splits."""
    shards = tmp_path / "gsm" / "data"
    shards.mkdir(parents=True)
    rows = [{"question": f"{a}+{a}=", "answer": str(2 * a)} for a in range(6)]
    datasets.Dataset.from_list(rows[:2]).to_parquet(str(shards / "train-00000-of-00002.parquet"))
    datasets.Dataset.from_list(rows[2:4]).to_parquet(str(shards / "train-00001-of-00002.parquet"))
    datasets.Dataset.from_list(rows[4:]).to_parquet(str(shards / "test-00000-of-00001.parquet"))
    (tmp_path / "gsm" / ".cache").mkdir()  # what a download leaves beside the data: not read
    (tmp_path / "gsm" / ".cache" / "stale.jsonl").write_text("not json\n")
    train = PromptSource("gsm", 4, 0, base_dir=tmp_path, prompt_key="question", shuffle=False)
    assert sorted(_prompts(train.next_batch(0))) == ["0+0=", "1+1=", "2+2=", "3+3="]
    test = PromptSource("gsm", 2, 0, base_dir=tmp_path, prompt_key="question", split="test", shuffle=False)
    assert sorted(_prompts(test.next_batch(0))) == ["4+4=", "5+5="]


def test_a_downloaded_dataset_of_several_configurations_reads_the_one_its_subset_names(tmp_path: Path) -> None:
    """openai/gsm8k's download: main/ and socratic/, each with its splits. Read whole, their rows
    would be mixed into one split."""
    for config in ("main", "socratic"):
        (tmp_path / "gsm" / config).mkdir(parents=True)
        rows = [{"question": f"{config} {a}+{a}=", "answer": str(2 * a)} for a in range(3)]
        datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "gsm" / config / "train-00000-of-00001.parquet"))
    with pytest.raises(DataError, match=r"gsm holds 2 configurations, a folder each \(main, socratic\): set the "
                                        r"subset to the one to read") as caught:
        PromptSource("gsm", 3, 0, base_dir=tmp_path, prompt_key="question")
    assert caught.value.field == "data.subset"
    main = PromptSource("gsm", 3, 0, base_dir=tmp_path, prompt_key="question", subset="main", shuffle=False)
    assert sorted(_prompts(main.next_batch(0))) == ["main 0+0=", "main 1+1=", "main 2+2="]
    with pytest.raises(DataError, match=r"gsm has no configuration 'default'; its configurations \(a folder each\): "
                                        r"main, socratic"):
        PromptSource("gsm", 3, 0, base_dir=tmp_path, prompt_key="question", subset="default")
