"""Reward functions on hand-scored completions; resolving names; failing functions."""

from __future__ import annotations

import json
import math
import sys
import textwrap
from pathlib import Path

import pytest

from flowrl.errors import RewardError
from flowrl.rewards import (
    REWARD_FUNCTIONS,
    digit_match,
    exact_match,
    first_letter_match,
    resolve_reward,
    score_safely,
)

# --- built-in rewards ----------------------------------------------------------------------


def test_digits_hand_scores() -> None:
    # max_new_tokens 8: "a1b2c3" has 3 digits -> 3/8; 11 digits -> 11/8 clamped to 1; "" -> 0
    completions = ["a1b2c3", "12345678901", "", "no digits"]
    scores = digit_match(["x="] * 4, completions, [None] * 4, max_new_tokens=8)
    assert scores == [0.375, 1.0, 0.0, 0.0]


def test_first_letter_hand_scores() -> None:
    # target "k", max_new_tokens 8; reward = 0.5 * k_count / 8 + 0.5 * leading_k_run / 8
    #   "kkkxk"      : 4 k's, run 3 -> 0.25 + 0.1875 = 0.4375
    #   "kkkkkkkk"   : 8, 8         -> 1.0
    #   "kkkkkkkkkk" : only the first 8 characters count -> 1.0
    #   "xk"         : 1, run 0     -> 0.0625 (partial credit: the letter, not yet in front)
    #   "xyz"        : 0            -> 0.0
    completions = ["kkkxk", "kkkkkkkk", "kkkkkkkkkk", "xk", "xyz"]
    scores = first_letter_match(["kabcdefg="] * 5, completions, ["k"] * 5, max_new_tokens=8)
    assert scores == [0.4375, 1.0, 1.0, 0.0625, 0.0]


def test_first_letter_without_answer_uses_the_prompt() -> None:
    # answer None -> target = "q" (the prompt's first character); "qq" -> 0.5*2/4 + 0.5*2/4
    assert first_letter_match(["qwertyui="], ["qq"], [None], max_new_tokens=4) == [0.5]


def test_exact_match() -> None:
    scores = exact_match(["2+2="] * 3, [" 4 and more", "14", "4"], ["4", "4", " 4 "], 16)
    assert scores == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="prompt 1 has none"):
        exact_match(["a", "b"], ["x", "y"], ["x", None], 16)


# --- resolve_reward ------------------------------------------------------------------------


def test_registry_names() -> None:
    assert resolve_reward("digits") is digit_match
    assert resolve_reward(" first_letter ") is first_letter_match
    assert resolve_reward("exact_match", base_dir=None) is exact_match
    assert set(REWARD_FUNCTIONS) == {"digits", "first_letter", "exact_match"}


def test_unknown_registry_name_suggests_the_nearest() -> None:
    with pytest.raises(RewardError) as caught:
        resolve_reward("digit")
    assert str(caught.value) == (
        "unknown reward function 'digit' (did you mean 'digits'?); use one of digits, "
        "exact_match, first_letter, or 'module:function' for your own function"
    )


def test_installed_module_function() -> None:
    assert resolve_reward("flowrl.rewards:digit_match") is digit_match
    assert resolve_reward("flowrl.rewards.builtin:exact_match", base_dir=None) is exact_match


def _write_module(folder: Path, name: str, source: str) -> None:
    (folder / f"{name}.py").write_text(textwrap.dedent(source))


def test_module_function_from_the_pipeline_folder(tmp_path: Path) -> None:
    _write_module(
        tmp_path,
        "my_rewards",
        """
        from dataclasses import dataclass

        @dataclass
        class Grader:  # a dataclass needs its module in sys.modules while it is defined
            bonus: float = 0.5

        def length_reward(prompts, completions, answers, max_new_tokens):
            return [len(c) / max_new_tokens for c in completions]

        class Scorer:
            @staticmethod
            def score(prompts, completions, answers, max_new_tokens):
                return [Grader().bonus] * len(completions)
        """,
    )
    fn = resolve_reward("my_rewards:length_reward", base_dir=tmp_path)
    assert fn(["p"], ["abcd"], [None], 8) == [0.5]
    method = resolve_reward("my_rewards:Scorer.score", base_dir=tmp_path)
    assert method(["p"], ["x"], [None], 8) == [0.5]


def test_pipeline_folder_is_searched_first_but_never_put_on_sys_path(tmp_path: Path) -> None:
    # A file named like an installed module wins for this reference only.
    _write_module(tmp_path, "json", "def reward(p, c, a, m):\n    return [1.0] * len(c)\n")
    fn = resolve_reward("json:reward", base_dir=tmp_path)
    assert fn([], [], [], 4) == []
    assert sys.modules["json"] is json and str(tmp_path) not in sys.path
    assert json.dumps([1]) == "[1]"


def test_missing_module() -> None:
    with pytest.raises(RewardError) as caught:
        resolve_reward("no_such_rewards_mod:fn", base_dir=Path("/tmp/x"))
    assert str(caught.value) == (
        "module 'no_such_rewards_mod' not found in /tmp/x nor installed; put "
        "no_such_rewards_mod.py next to the pipeline file, or install the package that provides it"
    )


def test_missing_function_suggests_the_nearest(tmp_path: Path) -> None:
    _write_module(tmp_path, "my_rewards", "def length_reward(p, c, a, m):\n    return []\n")
    with pytest.raises(RewardError) as caught:
        resolve_reward("my_rewards:lenght_reward", base_dir=tmp_path)
    assert str(caught.value) == (
        "module 'my_rewards' has no attribute 'lenght_reward' (did you mean 'length_reward'?); "
        "it defines: length_reward"
    )


def test_not_callable(tmp_path: Path) -> None:
    _write_module(tmp_path, "my_rewards", "THRESHOLD = 3\n")
    with pytest.raises(RewardError, match=r"'THRESHOLD' in module 'my_rewards' is not callable"):
        resolve_reward("my_rewards:THRESHOLD", base_dir=tmp_path)


def test_module_that_fails_to_import(tmp_path: Path) -> None:
    _write_module(tmp_path, "broken", "import no_such_dependency_xyz\n")
    expected = r"importing reward module .*broken\.py failed: ModuleNotFoundError"
    with pytest.raises(RewardError, match=expected):
        resolve_reward("broken:fn", base_dir=tmp_path)
    _write_module(tmp_path, "syntax", "def f(:\n")
    with pytest.raises(RewardError, match="SyntaxError"):
        resolve_reward("syntax:f", base_dir=tmp_path)


def test_malformed_references() -> None:
    for ref in ("mod:", ":fn", "a:b:c"):
        with pytest.raises(RewardError, match="not of the form 'module:function'"):
            resolve_reward(ref)


# --- score_safely --------------------------------------------------------------------------


def _lengths(
    prompts: list[str], completions: list[str], answers: list[str | None], m: int
) -> list[float]:
    if any("boom" in completion for completion in completions):
        raise RuntimeError("cannot grade boom")
    return [float(len(completion)) for completion in completions]


def _call(fn: object, completions: list[str], on_error: str = "zero") -> tuple[list[float], int]:
    count = len(completions)
    prompts, answers = ["p="] * count, [None] * count
    return score_safely(
        fn, prompts, completions, answers, 8, on_error, name="lengths"  # type: ignore[arg-type]
    )


def test_good_function() -> None:
    assert _call(_lengths, ["ab", "abc"]) == ([2.0, 3.0], 0)


def test_a_raising_sample_scores_zero_and_the_others_keep_their_score() -> None:
    # The batch call raises; each sample is retried alone, so only "boom" is lost.
    assert _call(_lengths, ["ab", "xboom", "abcd"]) == ([2.0, 0.0, 4.0], 1)


def test_strict_names_the_function_and_the_first_failing_sample() -> None:
    with pytest.raises(RewardError) as caught:
        _call(_lengths, ["ab", "xboom", "boom"], on_error="strict")
    assert str(caught.value) == (
        "reward function 'lengths' failed on sample 1 (prompt 'p=', completion 'xboom'): "
        "raised RuntimeError: cannot grade boom; 2 of 3 samples failed; fix the function, or "
        "set on_error: zero on the score node to score such samples 0 and count them in the "
        "metrics"
    )
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_none_nan_and_non_numbers_are_failures() -> None:
    def odd(p: list[str], c: list[str], a: list[str | None], m: int) -> list[object]:
        return [1, None, math.nan, "high", True, math.inf]

    assert _call(odd, ["c"] * 6) == ([1.0, 0.0, 0.0, 0.0, 1.0, 0.0], 4)
    with pytest.raises(RewardError, match="failed on sample 1 .*: returned None"):
        _call(odd, ["c"] * 6, on_error="strict")


def test_wrong_length_fails_every_sample() -> None:
    def short(p: list[str], c: list[str], a: list[str | None], m: int) -> list[float]:
        return [1.0]

    assert _call(short, ["a", "b", "c"]) == ([0.0, 0.0, 0.0], 3)
    with pytest.raises(RewardError, match="returned 1 scores for 3 completions"):
        _call(short, ["a", "b", "c"], on_error="strict")
    assert _call(lambda p, c, a, m: 0.5, ["a"]) == ([0.0], 1)


def test_batch_failure_that_no_single_sample_reproduces() -> None:
    def batch_of_one_only(p: list[str], c: list[str], a: list[str | None], m: int) -> list[float]:
        if len(c) > 1:
            raise MemoryError("too many at once")
        return [1.0]

    assert _call(batch_of_one_only, ["a", "b"]) == ([1.0, 1.0], 0)
    expected = "raised MemoryError: too many at once on the batch of 2, though no single sample"
    with pytest.raises(RewardError, match=expected):
        _call(batch_of_one_only, ["a", "b"], on_error="strict")


def test_default_name_and_argument_checks() -> None:
    with pytest.raises(RewardError, match=r"reward function '[\w.]*test_rewards:_lengths'"):
        score_safely(_lengths, ["p"], ["boom"], [None], 8, "strict")
    with pytest.raises(ValueError, match="one entry per completion"):
        score_safely(_lengths, ["p"], ["a", "b"], [None], 8)
    with pytest.raises(ValueError, match="on_error"):
        score_safely(_lengths, ["p"], ["a"], [None], 8, "ignore")  # type: ignore[arg-type]


def test_a_module_in_the_working_directory_is_not_imported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the pipeline's folder and installed packages provide reward functions."""
    (tmp_path / "stray_rewards.py").write_text("def score(*args):\n    return [1.0]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend("")
    with pytest.raises(RewardError, match="module 'stray_rewards' not found"):
        resolve_reward("stray_rewards:score", base_dir=None)
    assert resolve_reward("stray_rewards:score", base_dir=tmp_path)([], [], [], 1) == [1.0]
