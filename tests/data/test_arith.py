"""builtin:arith: every problem right, splits disjoint and fixed, readable as a dataset."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.backends.arith_model import ArithData, ArithProblem, all_problems, arith_problems, final_number
from flowrl.data import PromptSource
from flowrl.rewards import math_answer


def test_every_problem_and_its_answer() -> None:
    problems = all_problems()
    # a, b in 0..99, + and -: 100 * 100 * 2
    assert len(problems) == 20_000 and len({p.prompt for p in problems}) == 20_000
    by_prompt = {p.prompt: p.answer for p in problems}
    assert by_prompt["37+45="] == "82" and by_prompt["23-45="] == "-22" and by_prompt["0-0="] == "0"
    assert by_prompt["99+99="] == "198" and by_prompt["7-70="] == "-63"
    for prompt, answer in by_prompt.items():
        left, op, right = (prompt[:-1].partition("+") if "+" in prompt else prompt[:-1].partition("-"))
        assert int(answer) == (int(left) + int(right) if op == "+" else int(left) - int(right))


def test_worked_completion_ends_in_the_answer() -> None:
    # the digits of |result| from the lowest up, ';', the result
    assert ArithProblem("37+45=", "82").worked == "28;82"
    assert ArithProblem("23-45=", "-22").worked == "22;-22"
    assert ArithProblem("99+99=", "198").worked == "891;198"
    assert ArithProblem("5-5=", "0").worked == "0;0"
    assert final_number("28;82") == "82" and final_number("82") == "82"
    # math_answer reads the last number: the worked form scores, a wrong result does not
    assert math_answer(completions=["28;82", "28;83", "22;-22"], answer=["82", "82", "-22"]) == [1.0, 0.0, 1.0]


def test_splits_are_disjoint_fixed_and_seeded() -> None:
    splits = arith_problems()
    train, test = splits["train"], splits["test"]
    assert (len(train), len(test)) == (19_500, 500)
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    assert arith_problems() == splits
    assert arith_problems(ArithData(seed=1))["test"] != test


def test_the_dataset_reads_through_datasets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path))
    test = PromptSource("builtin:arith", 500, seed=0, base_dir=None, split="test", shuffle=False)
    assert [(e.prompt, e.answer) for e in test.next_batch(0)] == [(p.prompt, p.answer) for p in arith_problems()["test"]]
    train = PromptSource("builtin:arith", 16, seed=0, base_dir=None)
    assert train.num_examples == 19_500
    assert (tmp_path / "data" / "arith-500-s0-v1" / "train.parquet").is_file()
