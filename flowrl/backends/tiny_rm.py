"""``builtin:tiny-rm``: a tiny reward model fitted to a toy task's rule, built locally.

A model-based reward is only meaningful if the model knows something. tiny-rm is a small
Llama backbone with a scalar head (:class:`~flowrl.backends.value_model.ScalarHeadModel`)
fitted by a short supervised regression to the reward rule of a builtin task:

- inputs: the task's prompts (8 random letters + ``=``) joined with synthetic completions of
  ``TINY_RM_MAX_NEW_TOKENS`` tokens (or fewer, then ending in ``<eos>``, as generation
  stops), whose share of digits is drawn uniformly so every reward level is seen;
- target: the task's reward function on the decoded completion (for ``digits``:
  :func:`flowrl.rewards.digit_match` with ``max_new_tokens = 16``);
- loss: mean squared error of the scalar at the last real token.

Everything comes from fixed seeds and runs on one thread, so a machine rebuilds the same
weights; it takes a few seconds on CPU. The result is cached like the builtin policies
(``<cache root>/models/tiny-rm-<task>-v<version>/``, written to a private temporary
directory and renamed into place) with ``fit.json`` recording the held-out fit. The directory
is a ``LlamaForSequenceClassification`` checkpoint with one label (see
:mod:`flowrl.backends.scalar_files`), so transformers opens it too.

tiny-rm scores like the rule for completions of up to 16 tokens; generate with
``max_new_tokens: 16`` when it replaces ``fn: digits``.
"""

from __future__ import annotations

import json
import random
import string
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaModel, PreTrainedTokenizerBase

from flowrl.backends.catalog import BUILTIN_MODELS
from flowrl.backends.cache import cache_root, write_once
from flowrl.backends.tokenizer import build_char_tokenizer, char_ids
from flowrl.backends.value_model import ScalarHeadModel, save_scalar_model
from flowrl.errors import ModelLoadError

TINY_RM_MAX_NEW_TOKENS = 16
"""Completion budget (tokens) the rule is normalised by, as a generate node's max_new_tokens."""
FIT_FILE = "fit.json"


_SHAPE = BUILTIN_MODELS["tiny-rm"]


@dataclass(frozen=True)
class TinyRMRecipe:
    """Shape and training schedule of tiny-rm; changing any field changes the weights."""

    hidden_size: int = _SHAPE.hidden_size
    """Width of the residual stream (``BUILTIN_MODELS["tiny-rm"]``, like every size here)."""
    num_layers: int = _SHAPE.num_layers
    """Decoder layers."""
    num_heads: int = _SHAPE.num_heads
    """Attention heads per layer."""
    intermediate_size: int = _SHAPE.intermediate_size
    """Width of the MLP's hidden layer."""
    num_steps: int = 300
    """Optimizer steps of the fit."""
    batch_size: int = 64
    """Sequences per optimizer step."""
    lr: float = 3e-3
    """AdamW learning rate (cosine-decayed to 0)."""
    num_eval: int = 512
    """Held-out sequences for the reported fit."""
    seed: int = 0
    """Seed of the weights, the training strings and the held-out strings."""
    version: int = BUILTIN_MODELS["tiny-rm"].version
    """Bumped whenever the bytes would change, so stale caches are never reused (2: saved as
    a ...ForSequenceClassification checkpoint, head without bias)."""


@dataclass(frozen=True)
class TinyRMFit:
    """How well the fitted model follows the rule on held-out strings."""

    task: str
    correlation: float
    """Pearson correlation of predicted and true reward."""
    mse: float
    """Mean squared error (reward units squared)."""
    target_std: float
    """Standard deviation of the true reward, to read ``mse`` against."""
    num_steps: int
    train_s: float
    """Wall time of the fit, seconds."""


PROMPT_LETTERS = 8
"""Random lowercase letters before the ``=`` of a builtin prompt (as in :mod:`flowrl.data`)."""


def _letters_prompt(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(PROMPT_LETTERS)) + "="


def _digit_share(completion: str) -> float:
    # The rule of flowrl.rewards.digit_match at max_new_tokens = 16, restated here because
    # backends sit below rewards in the layering; a test checks the two agree.
    return min(
        1.0, sum(char.isascii() and char.isdigit() for char in completion) / TINY_RM_MAX_NEW_TOKENS
    )


@dataclass(frozen=True)
class TaskRule:
    """What tiny-rm learns for one builtin task."""

    make_prompt: Callable[[random.Random], str]
    """A prompt of the task (its data source's format)."""
    reward: Callable[[str], float]
    """The task's reward of a completion (its reward function's rule)."""


TASK_RULES: dict[str, TaskRule] = {"digits": TaskRule(_letters_prompt, _digit_share)}
"""Tasks tiny-rm can be fitted to -> their prompt format and reward rule."""


def _check_task(task: str) -> TaskRule:
    if task not in TASK_RULES:
        raise ModelLoadError(
            f"tiny-rm has no recipe for task '{task}'; it can be fitted to: {', '.join(TASK_RULES)}"
        )
    return TASK_RULES[task]


def synthetic_batch(
    task: str, rng: random.Random, tokenizer: PreTrainedTokenizerBase, size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``size`` prompt + completion sequences: ids and mask ``[size, L]`` (right-padded), targets.

    The targets are the task's rule on the decoded completions.
    """
    rule = _check_task(task)
    digit_ids = char_ids(tokenizer, string.digits)
    eos = int(tokenizer.eos_token_id)
    other_ids = [i for i in range(len(tokenizer)) if i not in digit_ids and i != eos]
    rows, completions = [], []
    for _ in range(size):
        prompt = rule.make_prompt(rng)
        share = rng.random()
        # Mostly full-budget completions (what a policy that never stops early makes), some
        # shorter ones that end in <eos>, as generation stops.
        length = (
            TINY_RM_MAX_NEW_TOKENS
            if rng.random() < 0.7
            else rng.randint(1, TINY_RM_MAX_NEW_TOKENS - 1)
        )
        completion = [
            rng.choice(digit_ids) if rng.random() < share else rng.choice(other_ids)
            for _ in range(length)
        ]
        completions.append(str(tokenizer.decode(completion, skip_special_tokens=True)))
        if length < TINY_RM_MAX_NEW_TOKENS:
            completion.append(eos)
        rows.append(char_ids(tokenizer, prompt) + completion)
    targets = [rule.reward(completion) for completion in completions]
    width = max(len(row) for row in rows)
    input_ids = torch.full((size, width), int(tokenizer.pad_token_id), dtype=torch.long)
    mask = torch.zeros((size, width), dtype=torch.long)
    for index, row in enumerate(rows):
        input_ids[index, : len(row)] = torch.tensor(row)
        mask[index, : len(row)] = 1
    return input_ids, mask, torch.tensor(targets, dtype=torch.float32)


def _last_token_scores(
    model: ScalarHeadModel, input_ids: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    position_ids = (mask.cumsum(dim=1) - 1).clamp(min=0)
    scores = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids)
    last = mask.sum(dim=1) - 1
    return scores[torch.arange(scores.shape[0]), last]


@contextmanager
def _one_thread() -> Iterator[None]:
    # One thread fixes the order of float reductions, so the weights do not depend on how
    # many cores the building process happens to have.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def train_tiny_rm(
    task: str = "digits", recipe: TinyRMRecipe = TinyRMRecipe()
) -> tuple[ScalarHeadModel, PreTrainedTokenizerBase, TinyRMFit]:
    """Fit tiny-rm to ``task``'s rule; returns the model (eval mode), its tokenizer and the fit."""
    _check_task(task)
    tokenizer = build_char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_heads,
        intermediate_size=recipe.intermediate_size,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    started = time.perf_counter()
    with torch.random.fork_rng(devices=[]), _one_thread():
        torch.manual_seed(recipe.seed)
        # No bias: a reward model is saved as ...ForSequenceClassification, whose score layer
        # has none. A small random head (not zeros) so the backbone gets gradient from the
        # first step.
        head = torch.nn.Linear(recipe.hidden_size, 1, bias=False)
        torch.nn.init.normal_(head.weight, std=recipe.hidden_size**-0.5)
        model = ScalarHeadModel(LlamaModel(config), head)
        train_rng = random.Random(f"tiny-rm-train-{task}-{recipe.seed}")
        optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=recipe.num_steps)
        model.train()
        for _ in range(recipe.num_steps):
            input_ids, mask, targets = synthetic_batch(
                task, train_rng, tokenizer, recipe.batch_size
            )
            loss = torch.nn.functional.mse_loss(_last_token_scores(model, input_ids, mask), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
        model.eval()
        eval_rng = random.Random(f"tiny-rm-eval-{task}-{recipe.seed}")
        fit = evaluate_fit(model, tokenizer, task, eval_rng, recipe.num_eval)
    fit = TinyRMFit(
        **{**asdict(fit), "num_steps": recipe.num_steps, "train_s": time.perf_counter() - started}
    )
    return model, tokenizer, fit


def evaluate_fit(
    model: ScalarHeadModel,
    tokenizer: PreTrainedTokenizerBase,
    task: str,
    rng: random.Random,
    size: int,
) -> TinyRMFit:
    """Correlation and MSE of ``model``'s last-token score against the rule on fresh strings."""
    input_ids, mask, targets = synthetic_batch(task, rng, tokenizer, size)
    with torch.no_grad():
        predicted = _last_token_scores(model, input_ids, mask)
    stacked = torch.stack([predicted, targets])
    correlation = float(torch.corrcoef(stacked)[0, 1])
    return TinyRMFit(
        task=task,
        correlation=correlation,
        mse=float(((predicted - targets) ** 2).mean()),
        target_std=float(targets.std()),
        num_steps=0,
        train_s=0.0,
    )


def read_fit(directory: Path) -> TinyRMFit:
    """The fit recorded when ``directory`` was built."""
    return TinyRMFit(**json.loads((Path(directory) / FIT_FILE).read_text()))


def tiny_rm_dir(
    task: str = "digits", cache_dir: Path | None = None, recipe: TinyRMRecipe = TinyRMRecipe()
) -> Path:
    """The directory of tiny-rm fitted to ``task``, training it on first use (a few seconds)."""
    _check_task(task)
    target = cache_root(cache_dir) / "models" / f"tiny-rm-{task}-v{recipe.version}"

    def build(folder: Path) -> None:
        model, tokenizer, fit = train_tiny_rm(task, recipe)
        save_scalar_model(model, tokenizer, folder, trained_by=f"flowrl tiny-rm ({task}, {asdict(recipe)})")
        # fit.json last: its presence marks a complete folder.
        (folder / FIT_FILE).write_text(json.dumps(asdict(fit), indent=2) + "\n")

    return write_once(target, FIT_FILE, build, "tiny-rm")

