"""How a reward function is called: TRL's keyword convention, checked before the run.

A score node calls its function once per batch with keyword arguments (see
:mod:`flowrl.rewards.builtin`). A function that ends in ``**kwargs`` gets every keyword; one
without gets only the keywords it names, so ``def f(completions, answer)`` works too. A
function that needs a keyword the data does not provide, or takes positional-only
arguments, can never be called: :func:`signature_problem` says so at ``flowrl validate``.
"""

from __future__ import annotations

import asyncio
import difflib
import inspect
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

FLOWRL_KEYWORDS = ("prompts", "completions", "completion_ids", "max_new_tokens")
"""Keywords every call gets, besides the dataset's columns and the node's params."""


@dataclass(frozen=True)
class RewardInputs:
    """One batch of samples as a reward function sees them (rows in rollout order)."""

    prompts: list[Any]
    """Each sample's prompt as the data holds it (text, or a list of chat messages)."""
    completions: list[Any]
    """Each sample's completion: text, or ``[{"role": "assistant", "content": text}]`` for a chat."""
    completion_ids: list[list[int]]
    """Each sample's generated token ids (end-of-sequence included, no padding)."""
    max_new_tokens: int
    columns: dict[str, list[Any]] = field(default_factory=dict)
    """Dataset column -> one value per sample."""

    def __len__(self) -> int:
        return len(self.completions)

    def keywords(self) -> dict[str, Any]:
        return {
            **self.columns,
            "prompts": self.prompts,
            "completions": self.completions,
            "completion_ids": self.completion_ids,
            "max_new_tokens": self.max_new_tokens,
        }

    def row(self, index: int) -> RewardInputs:
        """Sample ``index`` alone (a batch of one)."""
        one = slice(index, index + 1)
        return RewardInputs(
            self.prompts[one], self.completions[one], self.completion_ids[one], self.max_new_tokens,
            {name: values[one] for name, values in self.columns.items()},
        )


def _parameters(fn: Callable[..., Any]) -> list[inspect.Parameter] | None:
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # some builtins and C callables have no signature
        return None


def signature_problem(fn: Callable[..., Any], offered: Iterable[str], params: dict[str, Any],
                      answer_field: str = "data.answer_key") -> str | None:
    """Why ``fn`` cannot be called with the ``offered`` keywords plus ``params``, or None.
    ``answer_field``: the setting that names the reference answers' column of the data checked
    (``eval.answer_key`` for the held-out prompts)."""
    parameters = _parameters(fn)
    if parameters is None:
        return None
    names = set(offered) | set(params)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    for parameter in parameters:
        required = parameter.default is inspect.Parameter.empty
        if parameter.kind is inspect.Parameter.POSITIONAL_ONLY and required:
            return (
                f"its argument '{parameter.name}' is positional-only, but reward functions are called "
                "with keyword arguments (TRL's convention): def f(completions, **kwargs)"
            )
        if parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            if required and parameter.name not in names:
                fix = (f"set {answer_field} to the column that holds the reference answers, rename the "
                       "argument or add the column") if parameter.name == "answer" else \
                    "rename the argument or add the column"
                return (
                    f"it needs the argument '{parameter.name}', which no call provides; it receives "
                    f"{', '.join(sorted(names))} (every dataset column by its name, the reference answer "
                    f"as 'answer', and the score node's params); {fix}"
                )
    accepted = {p.name for p in parameters if p.kind is not inspect.Parameter.VAR_KEYWORD}
    unused = sorted(set(params) - accepted)
    if unused and not takes_any:
        return f"the score node's params {', '.join(unused)} are not arguments of it (and it takes no **kwargs)"
    for name in unused:  # through **kwargs, a misspelling of a named argument would go unread
        # (a name that extends another, answers beside answer, is taken as meant)
        close = [match for match in difflib.get_close_matches(name, sorted(accepted - set(params)), n=1, cutoff=0.75)
                 if not (match.startswith(name) or name.startswith(match))]
        if close:
            return (f"the score node's param '{name}' is not an argument of it (did you mean '{close[0]}'?); "
                    f"it would reach the function only through **kwargs")
    return None


def call_reward(fn: Callable[..., Any], inputs: RewardInputs, params: dict[str, Any]) -> Any:
    """``fn`` called on the batch with the keywords it takes; an ``async def`` function's
    result awaited (as TRL awaits one)."""
    keywords = {**inputs.keywords(), **params}
    parameters = _parameters(fn)
    if parameters is not None and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        accepted = {p.name for p in parameters if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
        keywords = {name: value for name, value in keywords.items() if name in accepted}
    return _awaited(fn(**keywords))


def _awaited(result: Any) -> Any:
    """``result`` itself, or what it gives when awaited, on this process's reward event loop."""
    if not inspect.isawaitable(result):
        return result

    async def wait() -> Any:
        return await result

    return asyncio.run_coroutine_threadsafe(wait(), _reward_loop()).result()


_LOOP: tuple[int, asyncio.AbstractEventLoop] | None = None
"""(process id, loop): a forked worker inherits the object but not the thread that runs it."""
_LOOP_LOCK = threading.Lock()


def _reward_loop() -> asyncio.AbstractEventLoop:
    """One event loop for the process's reward calls, run by a daemon thread and kept from
    call to call (as TRL keeps one): what a reward module makes once and reuses across calls
    (a client, a semaphore that rate-limits a judge) stays bound to the same loop. Its own
    thread also serves a caller that already runs a loop of its own."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP[0] != os.getpid() or _LOOP[1].is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="flowrl-reward-loop", daemon=True).start()
            _LOOP = (os.getpid(), loop)
        return _LOOP[1]