"""The driver's data: the training prompts and the held-out ones, formatted for the policy.

Chats are rendered and prompt lengths measured with the policy's tokenizer, here on the
driver, once, before any worker starts: bad rows and a missing chat template stop the run
before step 1. The tokenizer is read only when something needs it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flowrl.api.model_fit import prompt_room
from flowrl.data import PromptExample, PromptFormatter, PromptSource, eval_split, read_examples
from flowrl.data.formatting import FormatCounts
from flowrl.errors import DataError, ModelLoadError
from flowrl.graph import PipelineGraph
from flowrl.spec.schema import GenerateNode


class _LazyTokenizer:
    """The policy's tokenizer, loaded on first use."""

    def __init__(self, graph: PipelineGraph, base_dir: Path | None) -> None:
        generate = graph.nodes_of(GenerateNode)[0]
        self.model_name = str(graph.spec.nodes[generate].model)
        self._model = graph.spec.models[self.model_name]
        self._base_dir = base_dir
        self._loaded: Any = None

    def __call__(self) -> Any:
        if self._loaded is None:
            # transformers is imported only now: prompts that need no tokenizer never pay for it
            from flowrl.backends.policy_tokenizer import load_tokenizer

            model = self._model
            self._loaded = load_tokenizer(
                model.path, self._base_dir, getattr(model, "revision", None), getattr(model, "trust_remote_code", False)
            )
        return self._loaded


def policy_formatter(graph: PipelineGraph, base_dir: Path | None) -> PromptFormatter:
    """Renders chats and applies ``data.max_prompt_tokens`` with the policy's tokenizer; without
    it, a prompt longer than the models' positions leave room for is an error
    (``flowrl.api.model_fit``)."""
    data = graph.spec.data
    tokenizer = _LazyTokenizer(graph, base_dir)
    room = prompt_room(graph, base_dir) if data.max_prompt_tokens is None else None
    return PromptFormatter(
        tokenizer=tokenizer, tokenizer_name=f"model '{tokenizer.model_name}'",
        max_prompt_tokens=data.max_prompt_tokens, overlong=data.overlong_prompts,
        room=room.tokens if room is not None else None, room_why=room.why if room is not None else "",
    )


@contextmanager
def _placed_at(field: str) -> Iterator[None]:
    """A data or tokenizer error raised inside names ``field`` when it names none of its own,
    so that ``validate`` and a run's command line place it at that field's line."""
    try:
        yield
    except (DataError, ModelLoadError) as error:
        error.field = error.field or field
        raise


def training_source(graph: PipelineGraph, base_dir: Path | None, formatter: PromptFormatter) -> PromptSource:
    """The training prompts; a problem with them (or the tokenizer that reads them) is placed
    at its own field, else at ``data.source``."""
    with _placed_at("data.source"):
        return PromptSource.from_spec(graph.spec.data, seed=graph.spec.trainer.seed, base_dir=base_dir,
                                      formatter=formatter)


def eval_examples(graph: PipelineGraph, base_dir: Path | None, formatter: PromptFormatter) -> list[PromptExample]:
    """The held-out prompts in the data's order (the first ``max_examples``); [] without eval."""
    return read_eval(graph, base_dir, formatter)[0]


def read_eval(graph: PipelineGraph, base_dir: Path | None,
              formatter: PromptFormatter) -> tuple[list[PromptExample], FormatCounts | None]:
    """The held-out prompts (as :func:`eval_examples`) and what formatting did to the split's
    rows (skipped or truncated as too long); ([], None) without eval. A problem with them is
    placed at its own field, else at ``eval.source`` when the evaluation names its own data,
    or ``eval.split`` (the split of the training source it reads)."""
    spec = graph.spec
    evaluation = spec.eval
    if evaluation is None:
        return [], None
    with _placed_at("eval.source" if evaluation.source else "eval.split"):
        source, split, subset = _eval_data(graph, base_dir)
        if spec.data.max_prompt_tokens is None and formatter.room is not None:
            room = prompt_room(graph, base_dir, evaluation=True)
            formatter = formatter.with_room(room.tokens if room else None, room.why if room else "")
        examples, counts = read_examples(
            source, split, subset, base_dir, evaluation.prompt_key or spec.data.prompt_key,
            evaluation.answer_key or spec.data.answer_key, formatter, section="eval",
            answer_key_named=evaluation.answer_key is not None,
        )
    return (examples[: evaluation.max_examples] if evaluation.max_examples else examples), counts


def evaluates_training_prompts(graph: PipelineGraph, base_dir: Path | None) -> bool:
    """Whether the evaluation reads the very split training draws from (as a single data file
    without ``eval.source`` does: its one split is the training data)."""
    data = graph.spec.data
    return graph.spec.eval is not None and _eval_data(graph, base_dir) == (data.source, data.split, data.subset)


def not_held_out(graph: PipelineGraph, base_dir: Path | None) -> str | None:
    """Where the evaluation's prompts come from when they are the training data's split
    (:func:`evaluates_training_prompts`), said for a warning; None when they are held out."""
    if not evaluates_training_prompts(graph, base_dir):
        return None
    data = graph.spec.data
    return (f"split '{data.split}' of {data.source}, the split training draws from, so they are not held out; give "
            "eval.source held-out prompts (a single data file has only that split) or eval.split another split")


def _eval_data(graph: PipelineGraph, base_dir: Path | None) -> tuple[str, str, str | None]:
    """(source, split, subset) an evaluation reads: its own, else the training data's."""
    spec = graph.spec
    evaluation = spec.eval
    assert evaluation is not None
    source = evaluation.source or spec.data.source
    split = eval_split(evaluation.source, evaluation.split, spec.data.source, base_dir)
    subset = evaluation.subset if evaluation.source is not None else (evaluation.subset or spec.data.subset)
    return source, split, subset
