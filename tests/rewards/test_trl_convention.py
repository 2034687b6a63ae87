"""Reward functions written for TRL work unchanged: keywords, columns by name, None, chats.

The functions below have the shapes of TRL's documented examples (``def f(completions,
**kwargs)``, ``def f(prompts, completions, answer, **kwargs)``, a function returning None for
samples it does not apply to, and a conversational format reward reading
``completion[0]["content"]``); they are called through flowrl's score role on a real rollout.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import torch

from flowrl.rewards import FLOWRL_KEYWORDS, signature_problem
from flowrl.roles.batch import Rollout
from flowrl.roles.score import run_score

ROOT = Path(__file__).resolve().parents[2]
FLOWRL = str(Path(sys.executable).parent / "flowrl")


def reward_len(completions: list[str], **kwargs: Any) -> list[float]:
    """TRL docs: rewards completions close to 20 characters."""
    return [-abs(20 - len(completion)) for completion in completions]


def correct_answer(prompts: list[str], completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
    """TRL docs shape: compare with the dataset's answer column."""
    return [1.0 if completion.strip() == str(expected) else 0.0 for completion, expected in zip(completions, answer)]


def only_for_math(completions: list[str], task: list[str], **kwargs: Any) -> list[float | None]:
    """Returns None for samples of another task (TRL: the function does not apply)."""
    return [float(len(c)) if kind == "math" else None for c, kind in zip(completions, task)]


def format_reward(completions: list[list[dict[str, str]]], **kwargs: Any) -> list[float]:
    """TRL docs (conversational): completion_contents = [completion[0]["content"] ...]."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if re.match(pattern, content) else 0.0 for content in contents]


def seen_keywords(**kwargs: Any) -> list[float]:
    seen_keywords.calls.append(kwargs)  # type: ignore[attr-defined]
    return [0.0] * len(kwargs["completions"])


seen_keywords.calls = []  # type: ignore[attr-defined]


def _rollout(completions: list[str], columns: dict[str, list[Any]], chat: bool = False) -> Rollout:
    count = len(completions)
    ids = torch.tensor([[5, 6, 2], [7, 2, 0], [8, 9, 2], [3, 2, 0]][:count])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 0]][:count])
    prompts = [f"q{i}" for i in range(count)]
    return Rollout(
        prompt_ids=torch.ones(count, 2, dtype=torch.long), prompt_mask=torch.ones(count, 2, dtype=torch.long),
        completion_ids=ids, completion_mask=mask, group_size=1, prompts=prompts, completions=completions,
        answers=[None] * count, max_new_tokens=3, temperature=1.0,
        data_prompts=[[{"role": "user", "content": p}] for p in prompts] if chat else [],
        columns=columns, chat=chat,
    )


def _scores(fn: Any, rollout: Rollout, weight: float = 1.0) -> tuple[list[float], float, float]:
    output = run_score(rollout, fn, weight, "zero", name="f")
    return output.value.values.tolist(), output.metrics["reward/num_failed"], output.metrics["reward/num_none"]


def test_trl_shaped_functions_score_as_written() -> None:
    rollout = _rollout(["4", "5", "12", " 7 "], {"answer": ["4", "4", "12", "7"], "task": ["math", "code", "math", "math"]})
    # len("4") = 1 -> -19; "5" -> -19; "12" -> -18; " 7 " -> -17
    assert _scores(reward_len, rollout) == ([-19.0, -19.0, -18.0, -17.0], 0.0, 0.0)
    # answers 4, 4, 12, 7 against stripped completions "4", "5", "12", "7"
    assert _scores(correct_answer, rollout) == ([1.0, 0.0, 1.0, 1.0], 0.0, 0.0)
    # sample 1 is "code": None -> 0, counted as not applicable, not as failed; weight 0.5 applies
    assert _scores(only_for_math, rollout, weight=0.5) == ([0.5, 0.0, 1.0, 1.5], 0.0, 1.0)


def test_conversational_completions_are_assistant_messages() -> None:
    rollout = _rollout(["<think>a</think><answer>4</answer>", "4"], {}, chat=True)
    assert _scores(format_reward, rollout)[0] == [1.0, 0.0]


def test_every_keyword_a_function_receives() -> None:
    rollout = _rollout(["ab", "c"], {"answer": [4, 5], "level": [1, 2]})
    run_score(rollout, seen_keywords, 1.0, "zero", params={"bonus": 3})
    kwargs = seen_keywords.calls[-1]  # type: ignore[attr-defined]
    assert set(kwargs) == {"prompts", "completions", "completion_ids", "max_new_tokens", "answer", "level", "bonus"}
    assert kwargs["prompts"] == ["q0", "q1"] and kwargs["completions"] == ["ab", "c"]
    # completion ids without padding, end-of-sequence included
    assert kwargs["completion_ids"] == [[5, 6, 2], [7, 2]]
    assert kwargs["answer"] == [4, 5] and kwargs["level"] == [1, 2] and kwargs["bonus"] == 3


def test_a_function_without_kwargs_gets_only_what_it_names() -> None:
    def plain(completions: list[str], answer: list[str]) -> list[float]:
        return [float(c == a) for c, a in zip(completions, answer)]

    assert _scores(plain, _rollout(["4", "5"], {"answer": ["4", "4"], "extra": [0, 0]}))[0] == [1.0, 0.0]


async def async_length(completions: list[str], **kwargs: Any) -> list[float]:
    """TRL awaits an ``async def`` reward function (one that would call a remote judge)."""
    import asyncio

    await asyncio.sleep(0)
    return [float(len(completion)) for completion in completions]


_LOOPS: list[Any] = []


async def judge_on_one_loop(completions: list[str], **kwargs: Any) -> list[float]:
    """A judge that keeps what it made on its first call (a client, a rate-limiting
    semaphore): usable only on the event loop it was made on."""
    import asyncio

    _LOOPS.append(asyncio.get_running_loop())
    return [1.0] * len(completions)


def test_an_async_function_is_awaited() -> None:
    import asyncio

    rollout = _rollout(["abc", "d"], {})
    assert _scores(async_length, rollout) == ([3.0, 1.0], 0.0, 0.0)

    async def inside_a_running_loop() -> tuple[list[float], float, float]:
        return _scores(async_length, rollout)

    # a caller that already runs an event loop on this thread: awaited on the reward loop's thread
    assert asyncio.run(inside_a_running_loop()) == ([3.0, 1.0], 0.0, 0.0)
    # every call runs on the same loop, as TRL's: what a judge keeps from one call works in the next
    for _ in range(3):
        assert _scores(judge_on_one_loop, rollout)[0] == [1.0, 1.0]
    assert len(_LOOPS) == 3 and len(set(map(id, _LOOPS))) == 1


def test_signature_problems() -> None:
    offered = set(FLOWRL_KEYWORDS) | {"answer", "level"}
    assert signature_problem(reward_len, offered, {}) is None
    assert signature_problem(correct_answer, offered, {}) is None
    assert signature_problem(lambda completions, solution, **kw: [], offered, {}) == (
        "it needs the argument 'solution', which no call provides; it receives answer, completion_ids, "
        "completions, level, max_new_tokens, prompts (every dataset column by its name, the reference "
        "answer as 'answer', and the score node's params); rename the argument or add the column"
    )
    old_style = signature_problem(lambda prompts, completions, answers, max_new_tokens: [], offered, {})
    assert old_style is not None and "needs the argument 'answers'" in old_style
    # data whose answers are in another column: the fix names data.answer_key first
    no_answer = signature_problem(lambda completions, answer, **kw: [], set(FLOWRL_KEYWORDS) | {"solution"}, {})
    assert no_answer is not None and no_answer.endswith(
        "; set data.answer_key to the column that holds the reference answers, rename the argument or add the column")

    def positional(completions: list[str], /) -> list[float]:
        return []

    assert "positional-only" in str(signature_problem(positional, offered, {}))
    assert "params bonus are not arguments" in str(signature_problem(lambda completions: [], offered, {"bonus": 1}))
    # through **kwargs a misspelt argument would go unread; a param of another name is the function's own business
    scaled = lambda completions, scale=1.0, **kw: []  # noqa: E731
    assert signature_problem(scaled, offered, {"scael": 2}) == (
        "the score node's param 'scael' is not an argument of it (did you mean 'scale'?); it would reach the "
        "function only through **kwargs")
    assert signature_problem(scaled, offered, {"scale": 2, "bonus": 1}) is None
    assert signature_problem(scaled, offered, {"scales": [1, 2]}) is None  # extends a name: meant so


def _pipeline(folder: Path, reward_source: str, fn: str, **trainer: Any) -> Path:
    (folder / "my_rewards.py").write_text(textwrap.dedent(reward_source))
    (folder / "data.jsonl").write_text("".join(f'{{"prompt": "q{i}=", "answer": "{i}"}}\n' for i in range(8)))
    extra = "".join(f", {key}: {value}" for key, value in trainer.items())
    path = folder / "p.yaml"
    path.write_text(textwrap.dedent(f"""\
        name: trl-rewards
        models:
          actor: {{path: builtin:tiny-llama}}
        nodes:
          rollout: {{role: generate, model: actor, inputs: [prompts], n: 4, max_new_tokens: 4}}
          reward:  {{role: score, fn: "{fn}", inputs: [rollout]}}
          adv:     {{role: advantage, estimator: grpo, inputs: [reward]}}
          train:   {{role: update, model: actor, inputs: [rollout, adv], lr: 1.0e-4}}
        data:    {{source: data.jsonl, batch_size: 2}}
        trainer: {{steps: 10, output_dir: {folder / 'out'}{extra}}}
        """))
    return path


def test_validate_refuses_an_incompatible_signature_with_its_line(tmp_path: Path) -> None:
    path = _pipeline(tmp_path, "def wants_solution(completions, solution, **kwargs):\n    return [0.0] * len(completions)\n",
                     "my_rewards:wants_solution")
    result = subprocess.run([FLOWRL, "validate", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    # line 6 of the file holds the score node
    assert f"{path}:6: nodes.reward.fn: the reward function 'my_rewards:wants_solution' cannot be called: " \
           "it needs the argument 'solution'" in result.stderr.replace("\n", " ").replace("  ", " ")


def test_validate_refuses_a_missing_module(tmp_path: Path) -> None:
    path = _pipeline(tmp_path, "", "no_such_module_xyz:f")
    result = subprocess.run([FLOWRL, "validate", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and f"{path}:6: nodes.reward.fn: module 'no_such_module_xyz' not found" in result.stderr


def test_validate_accepts_a_trl_function(tmp_path: Path) -> None:
    path = _pipeline(tmp_path, "def ok(prompts, completions, answer, **kwargs):\n    return [0.0] * len(completions)\n",
                     "my_rewards:ok")
    result = subprocess.run([FLOWRL, "validate", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_validate_checks_the_evaluation_s_reward_functions_on_its_own_columns(tmp_path: Path) -> None:
    """Held-out prompts may lack a column the training rows have: every evaluation sample's
    reward would fail, and the run would report a held-out score of 0."""
    path = _pipeline(tmp_path, "def ok(prompts, completions, answer, **kwargs):\n    return [0.0] * len(completions)\n",
                     "my_rewards:ok")
    (tmp_path / "held.jsonl").write_text("".join(f'{{"prompt": "h{i}=", "target": "{i}"}}\n' for i in range(4)))
    path.write_text(path.read_text() + "eval:    {source: held.jsonl, every_steps: 5}\n")
    result = subprocess.run([FLOWRL, "validate", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert (f"{path}:11: eval.source: the evaluation scores with 'my_rewards:ok' (score node 'reward'), which cannot "
            "be called on the held-out prompts: it needs the argument 'answer'") in " ".join(result.stderr.split())
    assert "; set eval.answer_key to the column that holds the reference answers" in " ".join(result.stderr.split())
    (tmp_path / "held.jsonl").write_text("".join(f'{{"prompt": "h{i}=", "answer": "{i}"}}\n' for i in range(4)))
    result = subprocess.run([FLOWRL, "validate", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_validate_refuses_params_named_like_a_column_or_flowrl_s_own_arguments(tmp_path: Path) -> None:
    path = _pipeline(tmp_path, "def ok(completions, answer, **kwargs):\n    return [0.0] * len(completions)\n",
                     "my_rewards:ok")
    for params, taken in (('{bonus: 1, answer: "3"}', "answer is"), ("{completions: [a], prompts: [b]}", "completions, prompts are")):
        result = subprocess.run([FLOWRL, "validate", str(path), f"nodes.reward.params={params}"],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, result.stdout + result.stderr
        # placed at the override that set the params
        assert (f"command line: nodes.reward.params={params}: {taken} already an argument of every call (flowrl's own, or a dataset column by "
                "its name): a param of that name would replace the per-sample values") in " ".join(result.stderr.split())
    result = subprocess.run([FLOWRL, "validate", str(path), "nodes.reward.params={bonus: 1}"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_validate_reports_a_missing_training_file_and_a_missing_held_out_file_at_once(tmp_path: Path) -> None:
    path = _pipeline(tmp_path, "def ok(completions, **kwargs):\n    return [0.0] * len(completions)\n", "my_rewards:ok")
    path.write_text(path.read_text().replace("source: data.jsonl", "source: trian.jsonl")
                    + "eval:    {source: tset.jsonl, every_steps: 5}\n")
    result = subprocess.run([FLOWRL, "validate", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    text = " ".join(result.stderr.split())
    assert "2 problems in the pipeline" in text
    assert "data.source: data source 'trian.jsonl' not found" in text and "eval.source: data source 'tset.jsonl' not found" in text


def test_validate_reports_a_training_problem_once_not_again_for_the_evaluation(tmp_path: Path) -> None:
    path = _pipeline(tmp_path, "def wants(completions, solution, **kwargs):\n    return [0.0] * len(completions)\n",
                     "my_rewards:wants")
    (tmp_path / "held.jsonl").write_text("".join(f'{{"prompt": "h{i}=", "answer": "{i}"}}\n' for i in range(4)))
    path.write_text(path.read_text() + "eval:    {source: held.jsonl, every_steps: 5}\n")
    result = subprocess.run([FLOWRL, "validate", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "1 problem in the pipeline" in result.stderr, result.stderr
    assert "nodes.reward.fn" in result.stderr and "eval.source" not in result.stderr
    # a missing training file that the evaluation reads too is one problem, at data.source
    path.write_text(path.read_text().replace("source: data.jsonl", "source: trian.jsonl")
                    .replace("eval:    {source: held.jsonl, every_steps: 5}", "eval:    {every_steps: 5}"))
    result = subprocess.run([FLOWRL, "validate", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "1 problem in the pipeline" in result.stderr, result.stderr
    assert "data.source: data source 'trian.jsonl' not found" in " ".join(result.stderr.split())
