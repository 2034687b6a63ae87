"""Whether the pipeline's models fit its sequences and each other's token ids, from their
configs and tokenizers (``flowrl.backends.model_facts``), before any worker loads them.

- Lengths: a completion of ``max_new_tokens`` after a prompt must fit the positions of every
  model that reads it (the policy generating it, the reference, the critic, a reward model).
  A ``max_new_tokens`` that leaves no room, or a ``data.max_prompt_tokens`` that with it goes
  past the positions, is refused by validation; without ``data.max_prompt_tokens`` every prompt
  is measured against the room that is left (:func:`prompt_room`) and a longer one stops the
  run before step 1, as vLLM refuses a sequence past a model's length.
- Token ids: every model reads the ids the policy samples, so each needs an embedding row for
  every id of the policy's vocabulary and, where both folders hold a tokenizer, the same id
  for each of the policy's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowrl.backends.cache import BUILTIN_PREFIX
from flowrl.backends.catalog import lookup_builtin
from flowrl.backends.locations import TOKENIZER_FILES, resolve_model_path
from flowrl.backends.model_facts import ModelFacts, model_facts
from flowrl.errors import ModelLoadError
from flowrl.graph import PipelineGraph
from flowrl.spec.messages import Issue
from flowrl.spec.schema import GenerateNode, ScoreNode, eval_score_nodes


@dataclass(frozen=True)
class PromptRoom:
    """The longest prompt the models' positions leave room for beside the longest completion."""

    tokens: int
    why: str
    """The numbers behind it, for messages."""


def policy_name(graph: PipelineGraph) -> str | None:
    """The model of the first generate node (whose tokenizer makes the rollout's ids)."""
    generates = graph.nodes_of(GenerateNode)
    model = graph.spec.nodes[generates[0]].model if generates else None
    return str(model) if model else None


def _facts(graph: PipelineGraph, base_dir: Path | None) -> dict[str, ModelFacts]:
    found: dict[str, ModelFacts] = {}
    for name, model in graph.spec.models.items():
        try:
            facts = model_facts(model.path, base_dir, getattr(model, "revision", None))
        except ModelLoadError:  # a path that names nothing: model_issues says so
            continue
        if facts is not None:
            found[name] = facts
    return found


def _training_completions(graph: PipelineGraph) -> list[tuple[int, str]]:
    """(tokens, field) of every generate node's completion length."""
    return [(int(getattr(graph.spec.nodes[node], "max_new_tokens")), f"nodes.{node}.max_new_tokens")
            for node in graph.nodes_of(GenerateNode)]


def _eval_completion(graph: PipelineGraph) -> tuple[int, str] | None:
    """(tokens, field) of the evaluation's own completion length; None: it has none (it
    generates as the generate node does) or there is no evaluation."""
    evaluation = graph.spec.eval
    if evaluation is None or evaluation.max_new_tokens is None:
        return None
    return evaluation.max_new_tokens, "eval.max_new_tokens"


def _shortest(facts: dict[str, ModelFacts]) -> tuple[int, str, ModelFacts] | None:
    limits = [(item.positions, name, item) for name, item in facts.items() if item.positions is not None]
    return min(limits) if limits else None


def prompt_room(graph: PipelineGraph, base_dir: Path | None, evaluation: bool = False) -> PromptRoom | None:
    """The room left for a training prompt (every model reads its sequences), or with
    ``evaluation`` for a held-out one (the policy and the evaluation's reward models read
    those); None where no model says how long a sequence may be, or no room is left at all
    (validation refuses that)."""
    facts = _facts(graph, base_dir)
    asked = _training_completions(graph)
    if evaluation:
        readers = _held_out_readers(graph)
        facts = {name: item for name, item in facts.items() if name in readers}
        own = _eval_completion(graph)
        asked = [own] if own is not None else asked
    shortest = _shortest(facts)
    if shortest is None or not asked:
        return None
    positions, name, item = shortest
    new_tokens, field = max(asked)
    if new_tokens >= positions:
        return None
    return PromptRoom(positions - new_tokens, f"model '{name}' takes at most {positions} tokens per sequence "
                                              f"({item.source}), and {field} is {new_tokens}")


def model_fit_issues(graph: PipelineGraph, base_dir: Path | None) -> list[Issue]:
    """(field, message) for lengths past the models' positions and models that cannot read
    the policy's token ids."""
    facts = _facts(graph, base_dir)
    return _length_issues(graph, facts) + _vocabulary_issues(graph, base_dir, facts)


def _held_out_readers(graph: PipelineGraph) -> set[str]:
    """The models that read held-out sequences: the policy, and the reward models the
    evaluation scores with."""
    policy = policy_name(graph)
    reward_models = {str(node.model) for node in eval_score_nodes(graph.spec).values() if node.model is not None}
    return reward_models | ({policy} if policy is not None else set())


def _length_issues(graph: PipelineGraph, facts: dict[str, ModelFacts]) -> list[Issue]:
    issues: list[Issue] = []
    # training sequences are read by every model; held-out ones by the policy and the
    # evaluation's reward models
    checks = [(_shortest(facts), _training_completions(graph))]
    own = _eval_completion(graph)
    if own is not None:
        readers = _held_out_readers(graph)
        checks.append((_shortest({name: item for name, item in facts.items() if name in readers}), [own]))
    for shortest, asked in checks:
        if shortest is None:
            continue
        positions, name, item = shortest
        limit = f"model '{name}' takes at most {positions} tokens per sequence, prompt and completion ({item.source})"
        for new_tokens, field in asked:
            if new_tokens >= positions:
                issues.append((field, f"{new_tokens} new tokens leave no room for a prompt: {limit}; "
                                      f"lower it below {positions}"))
        fitting = [(new_tokens, field) for new_tokens, field in asked if new_tokens < positions]
        most = graph.spec.data.max_prompt_tokens
        if most is not None and fitting and not any(field == "data.max_prompt_tokens" for field, _ in issues):
            new_tokens, field = max(fitting)
            if most + new_tokens > positions:
                issues.append(("data.max_prompt_tokens",
                               f"{most} prompt tokens and {field} = {new_tokens} make {most + new_tokens}, more "
                               f"than the {positions} tokens per sequence model '{name}' takes ({item.source}); "
                               f"lower data.max_prompt_tokens to {positions - new_tokens} or less"))
    return issues


def _vocabulary_issues(graph: PipelineGraph, base_dir: Path | None, facts: dict[str, ModelFacts]) -> list[Issue]:
    policy = policy_name(graph)
    if policy is None or policy not in graph.spec.models:
        return []
    issues: list[Issue] = []
    # the policy's tokenizer's size, not its embedding's: embeddings are often padded past the
    # tokenizer (Qwen2.5's sizes differ between models of one tokenizer)
    policy_tokenizer = _model_tokenizer(graph, base_dir, policy)  # loaded once for both checks
    policy_rows = facts[policy].vocabulary if policy in facts else None
    tokens = _ids_fed(policy_tokenizer, policy_rows) if policy_tokenizer is not None else None
    described = "the tokenizer of" if tokens is not None else "the embedding of"
    if tokens is None and policy in facts:
        tokens = facts[policy].vocabulary
    # a reward model that reads the texts with its own tokenizer (retokenize) needs none of the policy's ids
    readers: dict[str, list[bool]] = {}
    for node in graph.spec.nodes.values():
        if node.model is not None:
            readers.setdefault(node.model, []).append(isinstance(node, ScoreNode) and node.retokenize)
    own_tokens = {model for model, retokenized in readers.items() if all(retokenized)}
    others = [name for name in graph.spec.models if name != policy and name not in own_tokens]
    for name in others:
        rows = facts[name].vocabulary if name in facts else None
        if tokens is not None and rows is not None and rows < tokens:
            issues.append((f"models.{name}.path",
                           f"model '{name}' has {rows} token ids ({facts[name].source}), but {described} the "
                           f"policy '{policy}' has {tokens}: every model of a pipeline reads the policy's token "
                           f"ids, so it needs the policy's tokenizer; give a model trained with it{_retokenize_hint(graph, name)}"))
    if issues:
        return issues
    policy_vocabulary = dict(policy_tokenizer.get_vocab()) if policy_tokenizer is not None else None
    for name in others:
        problem = _tokenizer_mismatch(graph, base_dir, policy, name, policy_vocabulary)
        if problem is not None:
            issues.append((f"models.{name}.path", problem))
    return issues


def _ids_fed(tokenizer: Any, rows: int | None) -> int:
    """How many token ids a run feeds the models: the tokenizer's, less a pad token past the
    policy's embedding (a tokenizer class that adds a pad token the model has no row for: the
    run pads with eos instead, ``hf.set_padding``)."""
    count = len(tokenizer)
    pad = tokenizer.pad_token_id
    return count - 1 if rows is not None and pad is not None and pad >= rows else count


def _is_builtin(graph: PipelineGraph, name: str) -> bool:
    return graph.spec.models[name].path.startswith(BUILTIN_PREFIX)


def _builtin_vocabulary(graph: PipelineGraph, name: str) -> dict[str, int] | None:
    """Token -> id of a builtin model's character tokenizer, padded with filler tokens to its
    embedding's rows as the builtin models' own tokenizers are; None for a name no builtin has."""
    try:
        shape = lookup_builtin(graph.spec.models[name].path[len(BUILTIN_PREFIX):])
    except ModelLoadError:
        return None
    from flowrl.backends.tokenizer import char_vocab, filler_token

    vocabulary = char_vocab()
    base = len(vocabulary)
    vocabulary.update({filler_token(index): base + index for index in range(shape.vocabulary - base)})
    return vocabulary


def _local_tokenizer(graph: PipelineGraph, base_dir: Path | None, name: str) -> Path | None:
    """The model's folder when it is a local one holding tokenizer files."""
    path = graph.spec.models[name].path
    if path.startswith(BUILTIN_PREFIX):
        return None  # every builtin model uses the same character tokenizer
    try:
        location = resolve_model_path(path, base_dir)
    except ModelLoadError:
        return None
    if isinstance(location, Path) and any((location / file).is_file() for file in TOKENIZER_FILES):
        return location
    return None


def _tokenizer_mismatch(graph: PipelineGraph, base_dir: Path | None, policy: str, name: str,
                        policy_vocabulary: dict[str, int] | None) -> str | None:
    """Where each is a local folder with a tokenizer or a builtin model (whose tokenizer is the
    character tokenizer), and not both builtin: the policy's tokens (``policy_vocabulary``, None
    for a builtin policy) that ``name``'s tokenizer gives another id (or none)."""
    policy_builtin, other_builtin = _is_builtin(graph, policy), _is_builtin(graph, name)
    if policy_vocabulary is None and not policy_builtin:
        return None  # a local policy whose tokenizer cannot be loaded here: nothing to compare
    if policy_builtin and other_builtin:
        return None  # every builtin model uses the same character tokenizer
    mine = None if policy_builtin else _local_tokenizer(graph, base_dir, policy)
    theirs = None if other_builtin else _local_tokenizer(graph, base_dir, name)
    if (mine is None and not policy_builtin) or (theirs is None and not other_builtin):
        return None
    if mine is not None and theirs is not None and mine.resolve() == theirs.resolve():
        return None
    if policy_vocabulary is None:
        policy_vocabulary = _builtin_vocabulary(graph, policy)
    if theirs is None:
        other_vocabulary = _builtin_vocabulary(graph, name)
    else:
        other = _load(str(theirs), None, None, False)
        other_vocabulary = None if other is None else dict(other.get_vocab())
    if policy_vocabulary is None or other_vocabulary is None:
        return None
    differ = [(token, index) for token, index in policy_vocabulary.items() if other_vocabulary.get(token) != index]
    if not differ:
        return None
    token, index = min(differ, key=lambda pair: pair[1])
    their_index = other_vocabulary.get(token)
    where = theirs if theirs is not None else graph.spec.models[name].path
    return (f"the tokenizer of model '{name}' ({where}) is not the policy's: {len(differ)} of the "
            f"{len(policy_vocabulary)} tokens of '{policy}' have another id there (token {token!r} is {index} "
            f"for '{policy}', {'absent' if their_index is None else their_index} for '{name}'); every model of a pipeline "
            f"reads the policy's token ids, so give a model trained with the policy's tokenizer"
            f"{_retokenize_hint(graph, name)}")


def _retokenize_hint(graph: PipelineGraph, name: str) -> str:
    """The other way out for a reward model: its score nodes read the texts with its own tokenizer."""
    scorers = [node for node, spec in graph.spec.nodes.items() if isinstance(spec, ScoreNode) and spec.model == name]
    if graph.spec.models[name].kind != "reward" or not scorers:
        return ""
    return (f", or set retokenize: true on score node '{scorers[0]}' (it then reads each prompt and completion as "
            "text with the reward model's own tokenizer)")


def _model_tokenizer(graph: PipelineGraph, base_dir: Path | None, name: str) -> Any:
    """Model ``name``'s tokenizer; None for a builtin model (its embedding is its tokenizer's
    size: ``model_facts``) or where it cannot be loaded here."""
    model = graph.spec.models[name]
    if model.path.startswith(BUILTIN_PREFIX):
        return None
    return _load(model.path, base_dir, getattr(model, "revision", None), getattr(model, "trust_remote_code", False))


def _load(path: str, base_dir: Path | None, revision: str | None, trust_remote_code: bool) -> Any:
    """A tokenizer, or None where it cannot be loaded here (this check then says nothing: the
    run's own loading reports a tokenizer that is broken)."""
    from flowrl.backends.policy_tokenizer import load_tokenizer

    try:
        return load_tokenizer(path, base_dir, revision, trust_remote_code)
    except Exception:  # noqa: BLE001 - any tokenizer that fails to load: not this check's to report
        return None
