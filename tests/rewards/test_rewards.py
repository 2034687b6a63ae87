"""Reward functions on hand-scored completions; resolving names; failing functions."""

from __future__ import annotations

import json
import math
import os
import sys
import textwrap
from fractions import Fraction
from pathlib import Path
from typing import Iterator

import pytest

from flowrl.errors import RewardError
from flowrl.rewards import (
    REWARD_FUNCTIONS,
    RewardInputs,
    digit_match,
    exact_match,
    extract_answer,
    first_letter_match,
    length_penalty,
    math_answer,
    normalize_answer,
    regex_format,
    resolve_reward,
    score_safely,
)

# --- built-in rewards ----------------------------------------------------------------------


def test_digits_hand_scores() -> None:
    # max_new_tokens 8: "a1b2c3" has 3 digits -> 3/8; 11 digits -> 11/8 clamped to 1; "" -> 0
    completions = ["a1b2c3", "12345678901", "", "no digits"]
    scores = digit_match(prompts=["x="] * 4, completions=completions, max_new_tokens=8)
    assert scores == [0.375, 1.0, 0.0, 0.0]


def test_first_letter_hand_scores() -> None:
    # target "k", max_new_tokens 8; reward = 0.5 * k_count / 8 + 0.5 * leading_k_run / 8
    #   "kkkxk"      : 4 k's, run 3 -> 0.25 + 0.1875 = 0.4375
    #   "kkkkkkkk"   : 8, 8         -> 1.0
    #   "kkkkkkkkkk" : only the first 8 characters count -> 1.0
    #   "xk"         : 1, run 0     -> 0.0625 (partial credit: the letter, not yet in front)
    #   "xyz"        : 0            -> 0.0
    completions = ["kkkxk", "kkkkkkkk", "kkkkkkkkkk", "xk", "xyz"]
    scores = first_letter_match(prompts=["kabcdefg="] * 5, completions=completions, answer=["k"] * 5, max_new_tokens=8)
    assert scores == [0.4375, 1.0, 1.0, 0.0625, 0.0]


def test_first_letter_without_answer_uses_the_prompt() -> None:
    # no answer column -> target = "q" (the prompt's first character); "qq" -> 0.5*2/4 + 0.5*2/4
    assert first_letter_match(prompts=["qwertyui="], completions=["qq"], max_new_tokens=4) == [0.5]


def test_exact_match() -> None:
    scores = exact_match(completions=[" 4 and more", "14", "4"], answer=["4", "4", " 4 "])
    assert scores == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="no reference answer"):
        exact_match(completions=["x", "y"], answer=["x", None])


def test_extract_answer_forms() -> None:
    assert extract_answer(r"so \boxed{\frac{1}{2}} is it") == r"\frac{1}{2}"
    assert extract_answer(r"\boxed{3} then \boxed{4}") == "4"  # the last box
    assert extract_answer("She pays 5 + 7 = 12 dollars.\n#### 12") == "12"
    assert extract_answer("37+45 is 82, I think 83") == "83"  # the last number
    assert extract_answer("-433") == "-433"
    assert extract_answer("no number") is None


def test_normalize_answer() -> None:
    # numbers compare exactly: 1,000 = 1000.0 = $1000; 0.5 = 1/2
    assert normalize_answer("1,000") == normalize_answer("1000.0") == normalize_answer("$1000") == Fraction(1000)
    assert normalize_answer("0.5") == normalize_answer("1/2")
    assert normalize_answer(" Paris. ") == "paris"


def test_math_answer_hand_scores() -> None:
    completions = ["82", "The sum is 82.", r"\boxed{82}", "81", "", "-433", "#### 1,200"]
    answers = ["82", "82", "82", "82", "82", "-433", "1200"]
    assert math_answer(completions=completions, answer=answers) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    # a GSM8K reference (a full solution ending in #### 72) is reduced to its answer
    assert math_answer(completions=["72"], answer=["48/2 = 24\n48+24 = 72\n#### 72"]) == [1.0]
    # an int column works like its text
    assert math_answer(completions=["12"], answer=[12]) == [1.0]
    # chat completions are read from the assistant message
    assert math_answer(completions=[[{"role": "assistant", "content": "12"}]], answer=["12"]) == [1.0]
    with pytest.raises(ValueError, match="no reference answer"):
        math_answer(completions=["1"], answer=[None])


def test_regex_format() -> None:
    good = "<think>add</think> <answer>4</answer>"
    assert regex_format(completions=[good, "4", "<think>x</think>"]) == [1.0, 0.0, 0.0]
    assert regex_format(completions=["A: 4", "4"], pattern=r"A: \d+") == [1.0, 0.0]


def test_length_penalty_hand_scores() -> None:
    # L = 8, buffer B = 2 (8 // 4): n <= 6 -> 0; n = 7 -> (6 - 7) / 2 = -0.5; n = 8 -> -1; n > 8 -> -1
    ids = [[1] * 3, [1] * 6, [1] * 7, [1] * 8, [1] * 9]
    assert length_penalty(completion_ids=ids, max_new_tokens=8) == [0.0, 0.0, -0.5, -1.0, -1.0]
    # explicit max_length 10 and buffer 4: n = 7 -> (6 - 7) / 4 = -0.25
    assert length_penalty(completion_ids=[[1] * 7], max_new_tokens=99, max_length=10, buffer=4) == [-0.25]


# --- resolve_reward ------------------------------------------------------------------------


def test_registry_names() -> None:
    assert resolve_reward("digits") is digit_match
    assert resolve_reward(" first_letter ") is first_letter_match
    assert resolve_reward("exact_match", base_dir=None) is exact_match
    assert resolve_reward("math_answer") is math_answer
    assert set(REWARD_FUNCTIONS) == {"digits", "first_letter", "exact_match", "math_answer", "regex_format", "length_penalty"}


def test_unknown_registry_name_suggests_the_nearest() -> None:
    with pytest.raises(RewardError) as caught:
        resolve_reward("digit")
    assert str(caught.value) == (
        "unknown reward function 'digit' (did you mean 'digits'?); use one of digits, "
        "exact_match, first_letter, length_penalty, math_answer, regex_format, or "
        "'module:function' for your own function"
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

        def length_reward(completions, max_new_tokens, **kwargs):
            return [len(c) / max_new_tokens for c in completions]

        class Scorer:
            @staticmethod
            def score(completions, **kwargs):
                return [Grader().bonus] * len(completions)
        """,
    )
    fn = resolve_reward("my_rewards:length_reward", base_dir=tmp_path)
    assert fn(completions=["abcd"], max_new_tokens=8) == [0.5]
    method = resolve_reward("my_rewards:Scorer.score", base_dir=tmp_path)
    assert method(completions=["x"]) == [0.5]


def test_pipeline_folder_is_searched_first_but_shadows_no_installed_module(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A file named like an installed module wins for this reference only: the folder goes on
    # sys.path after everything installed.
    monkeypatch.setattr(sys, "path", list(sys.path))
    _write_module(tmp_path, "json", "def reward(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    fn = resolve_reward("json:reward", base_dir=tmp_path)
    assert fn(completions=[]) == []
    assert sys.modules["json"] is json and sys.path[-1] == str(tmp_path.resolve())
    assert json.dumps([1]) == "[1]"


def test_a_reward_module_imports_its_helpers_and_packages_beside_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("flowrl_test_helpers", "flowrl_test_later", "flowrl_test_pkg", "flowrl_test_pkg.core",
                 "flowrl_test_pkg.helpers"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    _write_module(tmp_path, "flowrl_test_helpers", "def normalize(text):\n    return text.strip()\n")
    _write_module(tmp_path, "flowrl_test_later", "BONUS = 0.5\n")
    _write_module(
        tmp_path,
        "rw",
        """
        from flowrl_test_helpers import normalize

        def score(completions, **kwargs):
            import flowrl_test_later  # imported when the function runs, as on a worker
            return [float(normalize(c) == "42") + flowrl_test_later.BONUS for c in completions]
        """,
    )
    fn = resolve_reward("rw:score", base_dir=tmp_path)
    assert fn(completions=[" 42 ", "7"]) == [1.5, 0.5]
    package = tmp_path / "flowrl_test_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "helpers.py").write_text("def double(x):\n    return 2 * x\n")
    (package / "core.py").write_text(
        "from .helpers import double\n\ndef score(completions, **kwargs):\n    return [double(1.0)] * len(completions)\n"
    )
    assert resolve_reward("flowrl_test_pkg.core:score", base_dir=tmp_path)(completions=["a"]) == [2.0]
    # by its file, a package's module cannot import relatively: the message names the dotted form
    with pytest.raises(RewardError, match=r"no known parent package; .*fn: flowrl_test_pkg\.core:FUNCTION"):
        resolve_reward("flowrl_test_pkg/core.py:score", base_dir=tmp_path)
    (package / "sub").mkdir()
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "deep.py").write_text("from .. import helpers\n")
    with pytest.raises(RewardError, match=r"fn: flowrl_test_pkg\.sub\.deep:FUNCTION"):
        resolve_reward("flowrl_test_pkg/sub/deep.py:score", base_dir=tmp_path)
    _write_module(tmp_path, "loose", "from . import flowrl_test_helpers\n")
    with pytest.raises(RewardError, match="not in a package .* imports absolutely"):
        resolve_reward("loose:score", base_dir=tmp_path)


@pytest.fixture(autouse=True)
def fresh_imports(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """sys.path and the record of pipeline folders as they were, afterwards; the modules a
    test imported forgotten."""
    from flowrl.rewards import resolve

    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("_APPENDED", "_IMPORTED_BEFORE", "_SEEN"):
        monkeypatch.setattr(resolve, name, type(getattr(resolve, name))())
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith(("flowrl_test", "flowrl_pipeline_", "rw", "my_rewards", "loose", "json.")):
            sys.modules.pop(name, None)


def test_pipelines_loaded_one_after_another_each_get_their_own_helpers(tmp_path: Path) -> None:
    # One process, many pipelines (a worker of a joined cluster, a notebook): a helper module
    # or package named alike in two pipeline folders is each pipeline's own, and an edited
    # helper is read again.
    folders = {}
    for label, value in (("a", 1.0), ("b", 2.0)):
        folder = folders[label] = tmp_path / label
        folder.mkdir()
        _write_module(folder, "flowrl_test_shared", f"VALUE = {value}\n")
        _write_module(folder, "rw", "from flowrl_test_shared import VALUE\n\n"
                                    "def score(completions, **kwargs):\n    return [VALUE] * len(completions)\n")
        package = folder / "flowrl_test_shared_pkg"
        package.mkdir()
        (package / "__init__.py").write_text("")
        (package / "values.py").write_text(f"def score(completions, **kwargs):\n    return [{value} * 10] * len(completions)\n")
    first = resolve_reward("rw:score", base_dir=folders["a"])
    assert resolve_reward("rw:score", base_dir=folders["b"])(completions=["x"]) == [2.0]
    # the folder in use comes first among the pipeline folders
    assert sys.path.index(str(folders["b"].resolve())) < sys.path.index(str(folders["a"].resolve()))
    assert first(completions=["x"]) == [1.0]  # a function loaded before keeps its helpers
    assert resolve_reward("rw:score", base_dir=folders["a"])(completions=["x"]) == [1.0]
    assert resolve_reward("flowrl_test_shared_pkg.values:score", base_dir=folders["a"])(completions=["x"]) == [10.0]
    assert resolve_reward("flowrl_test_shared_pkg.values:score", base_dir=folders["b"])(completions=["x"]) == [20.0]
    helper = folders["b"] / "flowrl_test_shared.py"
    helper.write_text("VALUE = 3.0\n")
    os.utime(helper, (helper.stat().st_atime, helper.stat().st_mtime + 5))
    assert resolve_reward("rw:score", base_dir=folders["b"])(completions=["x"]) == [3.0]
    assert resolve_reward("rw.py:score", base_dir=folders["b"])(completions=["x"]) == [3.0]


def test_only_a_pipeline_s_own_helpers_are_imported_afresh(tmp_path: Path) -> None:
    # Modules imported before the pipeline's first reward (flowrl's own, where a pipeline sits
    # in its repository), modules of a folder deeper down (a src/ layout, a .venv) found through
    # another sys.path entry, and sys.path entries the process had already, stay as they are.
    project, other = tmp_path / "project", tmp_path / "other"
    (project / "src" / "flowrl_test_lib").mkdir(parents=True)
    other.mkdir()
    (project / "src" / "flowrl_test_lib" / "__init__.py").write_text("class Thing:\n    pass\n")
    _write_module(project, "flowrl_test_early", "")
    _write_module(project, "rw", "import flowrl_test_lib\nimport flowrl_test_early\n\n"
                                 "def score(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    _write_module(other, "rw", "def score(completions, **kwargs):\n    return [2.0] * len(completions)\n")
    sys.path.insert(0, str(project / "src"))
    sys.path.insert(0, str(project.resolve()))  # as `python project/train.py` puts it
    import flowrl_test_early  # noqa: F401  - imported by the script before any reward
    import flowrl_test_lib

    resolve_reward("rw:score", base_dir=project)
    assert resolve_reward("rw:score", base_dir=other)(completions=["x"]) == [2.0]
    assert sys.modules["flowrl_test_lib"] is flowrl_test_lib and "flowrl_test_early" in sys.modules
    assert sys.path[0] == str(project.resolve())


def test_a_package_beside_the_pipeline_named_like_an_imported_one_is_a_clash(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "__init__.py").write_text("")
    (tmp_path / "json" / "score.py").write_text("def score(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    with pytest.raises(RewardError, match=r"the package 'json' next to the pipeline file has the name of one imported "
                                          r"already .*rename the folder"):
        resolve_reward("json.score:score", base_dir=tmp_path)
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
    _write_module(tmp_path, "broken", "import os\nimport no_such_dependency_xyz\n")
    expected = r"importing reward module .*broken\.py failed at line 2: ModuleNotFoundError"
    with pytest.raises(RewardError, match=expected):
        resolve_reward("broken:fn", base_dir=tmp_path)
    _write_module(tmp_path, "syntax", "def f(:\n")
    with pytest.raises(RewardError, match="SyntaxError"):
        resolve_reward("syntax:f", base_dir=tmp_path)


def test_a_file_path_names_the_module_relative_to_the_pipeline_or_absolute(tmp_path: Path) -> None:
    (tmp_path / "graders").mkdir()
    (tmp_path / "graders" / "score.py").write_text("def length(completions, **kwargs):\n    return [1.0]\n")
    relative = resolve_reward("graders/score.py:length", base_dir=tmp_path)
    absolute = resolve_reward(f"{tmp_path / 'graders' / 'score.py'}:length")
    assert relative(completions=["a"]) == absolute(completions=["a"]) == [1.0]
    with pytest.raises(RewardError) as caught:
        resolve_reward("graders/scores.py:length", base_dir=tmp_path)
    assert str(caught.value) == (f"reward file {tmp_path / 'graders' / 'scores.py'} not found "
                                 "(a relative path is read from the pipeline file's folder)")


def test_params_a_builtin_reward_function_does_not_take_are_named() -> None:
    from flowrl.api.checks import builtin_params_problem

    assert builtin_params_problem("digits", {"foo": 1}) == (
        "the built-in reward function 'digits' has no parameter foo (it takes none)")
    assert builtin_params_problem("regex_format", {"patern": "x"}) == (
        "the built-in reward function 'regex_format' has no parameter patern (it takes pattern)")
    assert builtin_params_problem("regex_format", {"pattern": "x"}) is None
    assert builtin_params_problem("my_rewards:f", {"anything": 1}) is None  # its signature says
    # a function the user registered reads its params from **kwargs as it likes
    from flowrl.rewards.builtin import REWARD_FUNCTIONS, register_reward

    def by_kwargs(completions: list[str], **kwargs: object) -> list[float]:
        return [float(kwargs.get("scale", 1.0))] * len(completions)  # type: ignore[arg-type]

    register_reward("test_by_kwargs", by_kwargs)
    try:
        assert builtin_params_problem("test_by_kwargs", {"scale": 2.0}) is None
    finally:
        REWARD_FUNCTIONS.pop("test_by_kwargs")


def test_a_function_of_another_process_s_main_script_is_named_as_such() -> None:
    with pytest.raises(RewardError) as caught:
        resolve_reward("__main__:no_such_correct")
    assert str(caught.value).startswith(
        "'__main__:no_such_correct' names a function of the script or notebook that built the pipeline in Python")


def test_malformed_references() -> None:
    for ref in ("mod:", ":fn", "a:b:c"):
        with pytest.raises(RewardError, match="not of the form 'module:function'"):
            resolve_reward(ref)


# --- score_safely --------------------------------------------------------------------------


def _lengths(completions: list[str], **kwargs: object) -> list[float]:
    if any("boom" in completion for completion in completions):
        raise RuntimeError("cannot grade boom")
    return [float(len(completion)) for completion in completions]


RAISE_LINE = _lengths.__code__.co_firstlineno + 2
"""The line of ``_lengths`` that raises."""


def _inputs(completions: list[str]) -> RewardInputs:
    count = len(completions)
    return RewardInputs(["p="] * count, completions, [[1]] * count, 8)


def _call(fn: object, completions: list[str], on_error: str = "zero") -> tuple[list[float], int]:
    result = score_safely(fn, _inputs(completions), {}, on_error, name="lengths")  # type: ignore[arg-type]
    return result.scores, result.num_failed


def test_good_function() -> None:
    assert _call(_lengths, ["ab", "abc"]) == ([2.0, 3.0], 0)


def test_a_raising_sample_scores_zero_and_the_others_keep_their_score() -> None:
    # The batch call raises; each sample is retried alone, so only "boom" is lost.
    assert _call(_lengths, ["ab", "xboom", "abcd"]) == ([2.0, 0.0, 4.0], 1)
    result = score_safely(_lengths, _inputs(["ab", "xboom"]), {}, name="lengths")
    assert result.first_error == (
        "reward function 'lengths' failed on sample 1 (prompt 'p=', completion 'xboom'): "
        f"raised RuntimeError: cannot grade boom at test_rewards.py:{RAISE_LINE} "
        "(raise RuntimeError(\"cannot grade boom\")); 1 of 2 samples failed"
    )


def test_strict_names_the_function_and_the_first_failing_sample() -> None:
    with pytest.raises(RewardError) as caught:
        _call(_lengths, ["ab", "xboom", "boom"], on_error="strict")
    assert str(caught.value) == (
        "reward function 'lengths' failed on sample 1 (prompt 'p=', completion 'xboom'): "
        f"raised RuntimeError: cannot grade boom at test_rewards.py:{RAISE_LINE} "
        "(raise RuntimeError(\"cannot grade boom\")); 2 of 3 samples failed; fix the function, or "
        "set on_error: zero on the score node to score such samples 0 and count them in the "
        "metrics"
    )
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_nan_and_non_numbers_are_failures_and_none_is_not_applicable() -> None:
    def odd(completions: list[str], **kwargs: object) -> list[object]:
        return [1, None, math.nan, "high", True, math.inf, "1.0"]

    result = score_safely(odd, _inputs(["c"] * 7), {})
    # None scores 0 from this function but is not a failure (TRL: "does not apply"); text is
    # not a number even where float() would read it
    assert (result.scores, result.num_failed, result.num_none) == ([1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0], 4, 1)
    with pytest.raises(RewardError, match="failed on sample 2 .*: returned nan"):
        _call(odd, ["c"] * 7, on_error="strict")


def test_wrong_length_fails_every_sample() -> None:
    def short(completions: list[str], **kwargs: object) -> list[float]:
        return [1.0]

    assert _call(short, ["a", "b", "c"]) == ([0.0, 0.0, 0.0], 3)
    # the call's result as a whole is wrong: no one sample is blamed
    assert score_safely(short, _inputs(["a", "b", "c"]), {}, name="short").first_error == (
        "reward function 'short' returned 1 scores for 3 completions (called on a batch of 3 completions); "
        "3 of 3 samples failed")
    with pytest.raises(RewardError, match="returned 1 scores for 3 completions"):
        _call(short, ["a", "b", "c"], on_error="strict")
    assert _call(lambda completions, **kwargs: 0.5, ["a"]) == ([0.0], 1)
    # a mapping has a length, but nothing pairs its items with the completions
    assert score_safely(lambda completions, **kwargs: {"a": 1.0}, _inputs(["a"]), {}, name="keyed").first_error == (
        "reward function 'keyed' returned dict, not a list with one float per completion (called on a batch of 1 "
        "completion); 1 of 1 samples failed")


def test_batch_failure_that_no_single_sample_reproduces() -> None:
    def batch_of_one_only(completions: list[str], **kwargs: object) -> list[float]:
        if len(completions) > 1:
            raise MemoryError("too many at once")
        return [1.0]

    assert _call(batch_of_one_only, ["a", "b"]) == ([1.0, 1.0], 0)
    # the fallback to one call per sample is said, with where the batch call raised
    result = score_safely(batch_of_one_only, _inputs(["a", "b"]), {}, name="one")
    assert result.first_error is None and result.batch_error is not None
    assert result.batch_error.startswith(
        "the call of reward function 'one' on the batch of 2 raised MemoryError: too many at once at test_rewards.py:")
    assert result.batch_error.endswith("; each sample was scored alone (2 calls)")
    assert score_safely(batch_of_one_only, _inputs(["a"]), {}).batch_error is None
    assert score_safely(_lengths, _inputs(["ab", "abc"]), {}).batch_error is None
    expected = "raised MemoryError: too many at once on the batch of 2, though no single sample"
    with pytest.raises(RewardError, match=expected):
        _call(batch_of_one_only, ["a", "b"], on_error="strict")


def test_default_name_and_argument_checks() -> None:
    with pytest.raises(RewardError, match=r"reward function '[\w.]*test_rewards:_lengths'"):
        score_safely(_lengths, _inputs(["boom"]), {}, "strict")
    with pytest.raises(ValueError, match="on_error"):
        score_safely(_lengths, _inputs(["a"]), {}, "ignore")  # type: ignore[arg-type]


def _raises_by_value(completions: list[str], **kwargs: object) -> list[float]:
    raise ValueError("no grade")  # the line an error names


def _grade(text: str) -> float:
    raise KeyError(text)  # a helper's line


def _calls_a_helper_by_value(completions: list[str], **kwargs: object) -> list[float]:
    return [_grade(text) for text in completions]


def test_a_function_passed_by_value_names_its_file_and_line_when_it_raises() -> None:
    # a test module is a loose file: its functions travel by value, whose code cloudpickle
    # names "<dynamic-code>"; unpickled, it names this file again
    from flowrl.api.builder import function_by_value
    from flowrl.rewards.resolve import RewardCache

    function = function_by_value(_raises_by_value)
    assert function.file == __file__
    loaded = RewardCache().get(function)
    assert loaded is not _raises_by_value
    line = _raises_by_value.__code__.co_firstlineno + 1
    result = score_safely(loaded, _inputs(["a"]), {}, name="by_value")
    assert result.first_error is not None
    assert f"raised ValueError: no grade at test_rewards.py:{line} (raise ValueError(\"no grade\")" in result.first_error
    # a helper of the same file, called from a comprehension: the helper's line
    helper = RewardCache().get(function_by_value(_calls_a_helper_by_value))
    line = _grade.__code__.co_firstlineno + 1
    failed = score_safely(helper, _inputs(["a"]), {}, name="helper").first_error
    assert failed is not None and f"at test_rewards.py:{line} (raise KeyError(text)" in failed, failed
