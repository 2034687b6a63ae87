"""``builtin:arith-llama``: a small Llama warm-started on arithmetic, built locally.

Reinforcement learning from a 0/1 reward needs a policy that is sometimes right: a random
model never samples a correct sum, so every group's rewards are equal and GRPO learns
nothing. This module fits a Llama of ``builtin:tiny-llama``'s shape (0.5 M parameters, the
character tokenizer) to the train split of the arithmetic task by a short supervised
schedule, and stops while it is right on only part of the held-out problems, so that RL
has both a signal and room to improve.

The task: one- and two-digit addition and subtraction (operands 0..99). The model writes
its working, the digits of the result from the lowest up, then ``;`` and the result::

    37+45=    ->  28;82        23-45=    ->  22;-22        7+5=    ->  21;12

Written lowest digit first, each digit depends only on the digits already written and one
carry, which a two-layer model learns in minutes; reading the result back in the usual
order is a copy. Only the final number counts (the ``math_answer`` reward takes a
completion's last number), so RL is free to change the working.

- inputs: ``prompt`` + working + ``;`` + result + ``<eos>``, no ``<bos>``, as the generate
  role feeds prompts; loss on the completion tokens only;
- schedule: AdamW, linear warm-up then a constant rate, a fixed number of steps, one thread
  and fixed seeds, so a machine rebuilds the same weights (about 1.5 minutes on one core).

The result is cached like the builtin models::

    <cache root>/models/arith-llama-v<version>/
        config.json  generation_config.json  model.safetensors
        tokenizer.json  tokenizer_config.json  fit.json

``fit.json``, written last, records the schedule's wall time and the held-out greedy accuracy.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from flowrl.backends.arith_problems import LARGEST_OPERAND, ArithData, ArithProblem, all_problems, arith_problems
from flowrl.backends.catalog import BUILTIN_MODELS
from flowrl.backends.builtin import quiet_progress_bars
from flowrl.backends.cache import cache_root, write_once
from flowrl.backends.generation import generate_tokens
from flowrl.backends.tokenizer import build_char_tokenizer, char_ids

FIT_FILE = "fit.json"
ARITH_MAX_NEW_TOKENS = 10
"""Completion budget (tokens) that holds the longest worked answer (``891;198`` or
``99;-99``: 7 characters) and ``<eos>``, with room to spare."""
_SHAPE = BUILTIN_MODELS["arith-llama"]


@dataclass(frozen=True)
class ArithModelRecipe:
    """Shape and supervised schedule of the model; any change changes the weights."""

    hidden_size: int = _SHAPE.hidden_size
    """Width of the residual stream (``BUILTIN_MODELS["arith-llama"]``, like every size here)."""
    num_layers: int = _SHAPE.num_layers
    """Decoder layers."""
    num_heads: int = _SHAPE.num_heads
    """Attention heads per layer."""
    intermediate_size: int = _SHAPE.intermediate_size
    """Width of the MLP's hidden layer."""
    num_steps: int = 1700
    """Optimizer steps of the fit; chosen to stop at a partial held-out accuracy (18 %).

    The fit learns the format, the sign and the higher digits first and the lowest digit (a
    sum mod 10) last: right on 11 % of lowest digits (chance) after 800 steps, 16 % after
    1500, 23 % after 1700, 49 % after 2000. Stopped at chance on that digit (800 steps, 7 %
    held-out), a sample earns the 0/1 reward about 2 % of the time and GRPO barely moves
    (9.8 % after 1500 steps); from 1700 steps it goes from 18 % to about 60 % in 3000 steps."""
    batch_size: int = 64
    """Problems per optimizer step, drawn from the train split."""
    lr: float = 3e-3
    """AdamW learning rate after the warm-up."""
    warmup_steps: int = 50
    """Steps of linear warm-up."""
    data: ArithData = ArithData()
    """The dataset whose train split the fit reads (its test split is evaluated)."""
    seed: int = 0
    """Seed of the weights and of the order of the training problems."""
    version: int = BUILTIN_MODELS["arith-llama"].version
    """Bumped whenever the bytes would change, so stale caches are never reused."""


@dataclass(frozen=True)
class ArithFit:
    """What the supervised fit did and how well the result answers held-out problems."""

    num_steps: int
    """Optimizer steps."""
    train_s: float
    """Wall time of the fit (training and evaluation), seconds."""
    final_loss: float
    """Mean training loss of the last 10% of the steps (nats per completion token)."""
    test_accuracy: float
    """Share of the test problems whose greedy completion ends in the exact answer."""
    num_eval: int
    """Test problems evaluated."""


def encode_batch(
    problems: Sequence[ArithProblem], tokenizer: PreTrainedTokenizerBase
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``prompt + worked + <eos>`` rows: ids, attention mask, and labels (-100
    except on the completion and ``<eos>``), all ``[B, L]``."""
    eos, pad = int(tokenizer.eos_token_id), int(tokenizer.pad_token_id)
    rows, starts = [], []
    for problem in problems:
        prompt = char_ids(tokenizer, problem.prompt)
        completion = char_ids(tokenizer, problem.worked)
        rows.append([*prompt, *completion, eos])
        starts.append(len(prompt))
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for index, (row, start) in enumerate(zip(rows, starts)):
        input_ids[index, : len(row)] = torch.tensor(row)
        mask[index, : len(row)] = 1
        labels[index, start : len(row)] = torch.tensor(row[start:])
    return input_ids, mask, labels


def greedy_completions(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str], batch_size: int = 256
) -> list[str]:
    """The greedy completion of each prompt, up to ``<eos>``."""
    completions: list[str] = []
    for start in range(0, len(prompts), batch_size):
        chunk = list(prompts[start : start + batch_size])
        encoded = tokenizer(chunk, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        output = generate_tokens(
            model, encoded["input_ids"], encoded["attention_mask"],  # type: ignore[arg-type]
            max_new_tokens=ARITH_MAX_NEW_TOKENS, eos_token_id=int(tokenizer.eos_token_id),
            pad_token_id=int(tokenizer.pad_token_id), greedy=True,
        )
        for ids, keep in zip(output.completion_ids.tolist(), output.completion_mask.tolist()):
            kept = [token for token, flag in zip(ids, keep) if flag]
            completions.append(str(tokenizer.decode(kept, skip_special_tokens=True)))
    return completions


def final_number(completion: str) -> str:
    """What follows the last ``;`` of a completion (the whole completion without one)."""
    return completion.rsplit(";", 1)[-1].strip()


def greedy_accuracy(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, problems: Sequence[ArithProblem]) -> float:
    """Share of ``problems`` whose greedy completion ends in the exact answer."""
    completions = greedy_completions(model, tokenizer, [problem.prompt for problem in problems])
    right = sum(final_number(text) == problem.answer for text, problem in zip(completions, problems))
    return right / max(len(problems), 1)


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


def train_arith_model(
    recipe: ArithModelRecipe = ArithModelRecipe(),
) -> tuple[LlamaForCausalLM, PreTrainedTokenizerBase, ArithFit]:
    """Fit the model to the train split; returns it (eval mode), its tokenizer and the fit."""
    tokenizer = build_char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=recipe.hidden_size, num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads, num_key_value_heads=recipe.num_heads,
        intermediate_size=recipe.intermediate_size, max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    splits = arith_problems(recipe.data)
    train, test = splits["train"], splits["test"]
    started = time.perf_counter()
    losses: list[float] = []
    with torch.random.fork_rng(devices=[]), _one_thread():
        torch.manual_seed(recipe.seed)
        model = LlamaForCausalLM(config)
        order = random.Random(f"arith-model-{recipe.seed}")
        optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0)
        model.train()
        for step in range(recipe.num_steps):
            for group in optimizer.param_groups:
                group["lr"] = recipe.lr * min(1.0, (step + 1) / recipe.warmup_steps)
            batch = [train[order.randrange(len(train))] for _ in range(recipe.batch_size)]
            input_ids, mask, labels = encode_batch(batch, tokenizer)
            loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            losses.append(float(loss.detach()))
        model.eval()
        accuracy = greedy_accuracy(model, tokenizer, test)
    tail = losses[-max(len(losses) // 10, 1):]
    fit = ArithFit(
        num_steps=recipe.num_steps, train_s=round(time.perf_counter() - started, 2),
        final_loss=round(sum(tail) / len(tail), 4), test_accuracy=accuracy, num_eval=len(test),
    )
    return model, tokenizer, fit


def read_fit(directory: Path) -> ArithFit:
    """The fit recorded when ``directory`` was built."""
    return ArithFit(**json.loads((Path(directory) / FIT_FILE).read_text()))


def arith_model_dir(cache_dir: Path | None = None, recipe: ArithModelRecipe = ArithModelRecipe()) -> Path:
    """The directory of the model, fitted on first use (see the module docstring).

    A recipe other than the default is cached under its own name, so a test's small fit
    never takes the default's place.
    """
    name = "arith-llama" if recipe == ArithModelRecipe() else f"arith-llama-{_digest(recipe)}"
    target = cache_root(cache_dir) / "models" / f"{name}-v{recipe.version}"

    def build(folder: Path) -> None:
        model, tokenizer, fit = train_arith_model(recipe)
        with quiet_progress_bars():
            model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
        # fit.json last: its presence marks a complete folder.
        (folder / FIT_FILE).write_text(json.dumps(asdict(fit), indent=2) + "\n")

    return write_once(target, FIT_FILE, build, "the arithmetic model")


def _digest(recipe: ArithModelRecipe) -> str:
    return hashlib.sha256(repr(recipe).encode()).hexdigest()[:10]


