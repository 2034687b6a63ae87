"""Checks that need more than the pipeline's text: its data, and its reward functions' code.

``flowrl validate`` and ``flowrl run`` both call them, so a reward function that cannot be
imported, or whose signature asks for an argument no call provides, fails validation with
the file and line of its ``fn:``, not at step 1.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from flowrl.api.data import eval_examples, policy_formatter, training_source
from flowrl.api.model_fit import model_fit_issues
from flowrl.backends.cache import BUILTIN_PREFIX as MODEL_PREFIX
from flowrl.backends.catalog import lookup_builtin
from flowrl.backends.locations import config_problem, hub_model_problem, read_config, saved_model_location, tokenizer_problem
from flowrl.backends.model_facts import kind_problem, model_facts
from flowrl.data import PromptExample, PromptSource
from flowrl.data.files import missing_local_source, resolve_local
from flowrl.data.source import BUILTIN_PREFIX, endless_task, is_endless_task
from flowrl.errors import DataError, ModelLoadError, RewardError, SpecError, SpecIssue
from flowrl.graph import PipelineGraph, trained_scores
from flowrl.rewards import FLOWRL_KEYWORDS, REWARD_FUNCTIONS, resolve_reward, signature_problem
from flowrl.spec.loader import Locate
from flowrl.spec.messages import Issue
from flowrl.spec.schema import ScoreNode, eval_score_nodes

BUILTIN_REWARDS_MODULE = "flowrl.rewards.builtin"
"""Where flowrl's own reward functions live (the registry also holds the user's)."""

SAMPLED_ROWS = 1000
"""Examples whose columns are read to learn what keywords reward functions will get."""


def offered_keywords(source: PromptSource) -> set[str]:
    """Every keyword a reward function's call gets: flowrl's own and the data's columns
    (the columns present in the training rows)."""
    return call_keywords(source.examples if source.examples else source.next_batch(0))


def call_keywords(examples: list[PromptExample]) -> set[str]:
    """Every keyword a reward function's call gets on ``examples`` (the held-out prompts, or
    the training rows): flowrl's own and the columns of the first ``SAMPLED_ROWS``."""
    columns: set[str] = set()
    for example in examples[:SAMPLED_ROWS]:
        columns.update(example.columns)
    return set(FLOWRL_KEYWORDS) | columns


def eval_reward_issues(graph: PipelineGraph, base_dir: Path | None, offered: set[str],
                       offered_training: set[str] | None) -> list[Issue]:
    """A (path, message) per reward function the evaluation scores with that cannot be called
    with the held-out data's keywords ``offered`` (its columns may differ from training's),
    or whose params clash with them; what the training keywords ``offered_training`` already
    give away is reported at the score node, not here again."""
    spec = graph.spec
    where = "eval.source" if spec.eval is not None and spec.eval.source else "eval.split"
    issues: list[Issue] = []
    for name, node in eval_score_nodes(spec).items():
        if node.fn is None:
            continue
        try:
            fn = resolve_reward(node.fn, base_dir)
        except RewardError:
            continue  # reported at the score node
        params = dict(node.params)
        known = offered_training or set()
        pairs = ((signature_problem(fn, offered, params, "eval.answer_key"), signature_problem(fn, known, params)),
                 (params_clash(params, offered), params_clash(params, offered_training)))
        for problem, training in pairs:
            if problem is not None and (offered_training is None or training is None):
                issues.append((where, f"the evaluation scores with '{node.fn_name}' (score node '{name}'), which "
                                      f"cannot be called on the held-out prompts: {problem}"))
    return issues


def reward_issues(graph: PipelineGraph, base_dir: Path | None, offered: set[str] | None) -> list[Issue]:
    """A (path, message) per score node whose function cannot be loaded or called with the
    ``offered`` keywords (None: do not check signatures)."""
    issues: list[Issue] = []
    for name, node in graph.spec.nodes.items():
        if not isinstance(node, ScoreNode) or node.fn is None:
            continue
        try:
            fn = resolve_reward(node.fn, base_dir)
        except RewardError as error:
            issues.append((f"nodes.{name}.fn", str(error)))
            continue
        unknown = builtin_params_problem(node.fn, dict(node.params))
        if unknown is not None:
            issues.append((f"nodes.{name}.params", unknown))
        clash = params_clash(dict(node.params), offered)
        if clash is not None:
            issues.append((f"nodes.{name}.params", clash))
        if offered is None:
            continue
        problem = signature_problem(fn, offered, dict(node.params))
        if problem is not None:
            issues.append((f"nodes.{name}.fn", f"the reward function '{node.fn_name}' cannot be called: {problem}"))
    return issues


def params_clash(params: dict[str, Any], offered: set[str] | None) -> str | None:
    """Params named like a keyword every call gets (flowrl's own, or a dataset column when
    ``offered`` is known): the param would replace the per-sample values in every call."""
    taken = sorted(set(params) & (set(FLOWRL_KEYWORDS) | (offered or set())))
    if not taken:
        return None
    names = ", ".join(taken)
    return (f"{names} {'is' if len(taken) == 1 else 'are'} already an argument of every call (flowrl's own, or a "
            f"dataset column by its name): a param of that name would replace the per-sample values; rename the "
            f"param{'s' if len(taken) > 1 else ''}")


def builtin_params_problem(fn: object, params: dict[str, Any]) -> str | None:
    """Params a built-in reward function does not take (they take ``**kwargs`` for the
    dataset's columns, which would swallow a misspelt or foreign param)."""
    if not isinstance(fn, str) or fn.strip() not in REWARD_FUNCTIONS or not params:
        return None
    function = REWARD_FUNCTIONS[fn.strip()]
    if function.__module__ != BUILTIN_REWARDS_MODULE:
        return None  # registered by the user (register_reward): its **kwargs may read params
    taken = sorted(
        parameter.name for parameter in inspect.signature(function).parameters.values()
        if parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        and parameter.name not in FLOWRL_KEYWORDS
    )
    unknown = sorted(set(params) - set(taken))
    if not unknown:
        return None
    takes = f"it takes {', '.join(taken)}" if taken else "it takes none"
    return f"the built-in reward function '{fn.strip()}' has no parameter {', '.join(unknown)} ({takes})"


def check_inputs(graph: PipelineGraph, base_dir: Path | None, locate: Locate | None = None) -> None:
    """Check the model paths, load the data (and held-out data) and check every reward
    function against it; SpecError listing every problem, each placed by ``locate`` (a line
    of the pipeline file, or the override that set it) when given."""
    issues: list[Issue] = model_issues(graph, base_dir) + task_field_issues(graph)
    offered: set[str] | None = None
    held_out: list[Any] = []
    if not issues:  # the data is read with the policy's tokenizer
        formatter = policy_formatter(graph, base_dir)
        source: PromptSource | None = None
        tokenizer_failed = False
        try:
            source = training_source(graph, base_dir, formatter)
        except (DataError, ModelLoadError) as error:
            issues.extend(_data_issues(error, "data.source"))  # training_source names one
            tokenizer_failed = isinstance(error, ModelLoadError)
        evaluation = graph.spec.eval
        endless = _endless_eval(graph)
        if endless is not None:
            issues.append(endless)
        elif not tokenizer_failed and (source is not None or evaluation is None or evaluation.source):
            # the held-out data too, so that a missing training file and a missing held-out
            # file are reported at once (not when it is the training source that failed)
            try:
                held_out = eval_examples(graph, base_dir, formatter)
            except (DataError, ModelLoadError) as error:
                issues.extend(_data_issues(error, "eval.source"))  # read_eval names one
        if source is not None:
            offered = offered_keywords(source)
    if not any(path.startswith("models.") for path, _ in issues):
        issues.extend(model_fit_issues(graph, base_dir))  # beside the data's problems, not instead
        issues.extend(lora_issues(graph, base_dir))
    issues.extend(reward_issues(graph, base_dir, offered))
    issues.extend(local_subset_issues(graph, base_dir) + arch_issues(graph))  # beside the data's, not instead
    if held_out:
        issues.extend(eval_reward_issues(graph, base_dir, call_keywords(held_out), offered))
    if issues:
        raise SpecError(_located(issues, locate))


def _data_issues(error: DataError | ModelLoadError, field: str) -> list[Issue]:
    """The error and those found beside it (``DataError.also``), each at its field, else ``field``."""
    found = [error, *(error.also if isinstance(error, DataError) else [])]
    return [(item.field or field, str(item)) for item in found]


def model_issues(graph: PipelineGraph, base_dir: Path | None) -> list[Issue]:
    """A (path, message) per model whose path names nothing loadable here: an unknown builtin
    name, a missing folder, a folder without config.json, a hub name neither in the local cache
    nor downloadable."""
    issues: list[Issue] = []
    for name, model in graph.spec.models.items():
        where = f"models.{name}.path"
        try:
            if model.path.startswith(MODEL_PREFIX):
                lookup_builtin(model.path[len(MODEL_PREFIX):])
                continue
            location = saved_model_location(model.path, base_dir)
            if isinstance(location, str):
                problem = hub_model_problem(location, model.revision, base_dir)
            else:  # a policy's tokenizer renders and reads the prompts
                problem = config_problem(location) or (tokenizer_problem(location) if model.kind == "policy" else None)
                problem = problem or _weights_problem(location, model.path, base_dir, model.trust_remote_code)
            if problem is None:  # what the checkpoint is, against its kind
                facts = model_facts(model.path, base_dir, model.revision)
                wrong = kind_problem(facts, model.kind) if facts is not None else None
                problem = f"{model.path} {wrong}" if wrong else None
            if problem is not None:
                issues.append((where, problem))
        except ModelLoadError as error:
            issues.append((where, str(error)))
    return issues


def _weights_problem(location: Path, path: str, base_dir: Path | None, trust_remote_code: bool) -> str | None:
    """A local model's safetensors weights against its config.json (``weight_files.weights_problem``):
    headers only, against the shapes of the model built from the config on the meta device."""
    from flowrl.backends.weight_files import has_weights, weights_problem  # torch: only for a local model

    if not has_weights(location):
        return None
    quantized = "quantization_config" in read_config(location)
    skeleton = None if quantized else _skeleton(path, base_dir, None, trust_remote_code)
    if skeleton is None:  # quantized weights are packed: their shapes are not the config's
        return weights_problem(location)
    shapes = {name: tuple(tensor.shape) for name, tensor in skeleton.state_dict().items()}
    return weights_problem(location, shapes, getattr(skeleton, "base_model_prefix", ""))


def model_problems(graph: PipelineGraph, base_dir: Path | None) -> list[Issue]:
    """:func:`model_issues`; when every path names something, whether the models fit the
    sequences and each other's token ids (``flowrl.api.model_fit``) and whether their adapters'
    targets exist (:func:`lora_issues`)."""
    issues = model_issues(graph, base_dir)
    return issues or model_fit_issues(graph, base_dir) + lora_issues(graph, base_dir)


def lora_issues(graph: PipelineGraph, base_dir: Path | None) -> list[Issue]:
    """A (path, message) per model whose ``lora.target_modules`` name layers the model lacks
    or cannot adapt, or whose ``lora.rank`` is above every width of the layers it adapts,
    found on the model built from its config on the meta device (no weights read). A model
    whose config cannot be read here is left to the run's own check."""
    issues: list[Issue] = []
    for name, model in graph.spec.models.items():
        if model.lora is None:
            continue
        from flowrl.backends.lora import rank_problem, target_problem  # torch: only for a model with adapters

        skeleton = _skeleton(model.path, base_dir, model.revision, model.trust_remote_code)
        if skeleton is None:
            continue
        problem = target_problem(skeleton, model.lora.target_modules, name)
        if problem is not None:
            issues.append((f"models.{name}.lora.target_modules", problem))
            continue
        problem = rank_problem(skeleton, model.lora.target_modules, model.lora.rank, name)
        if problem is not None:
            issues.append((f"models.{name}.lora.rank", problem))
    return issues


def _skeleton(path: str, base_dir: Path | None, revision: str | None, trust_remote_code: bool) -> Any:
    """The causal LM ``path`` names, built from its config on the meta device, or None."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from flowrl.backends.builtin import model_config

    try:
        if path.startswith(MODEL_PREFIX):
            shape = lookup_builtin(path[len(MODEL_PREFIX):])
            config = model_config(shape, shape.vocabulary, 0, 1, 2)
        else:
            location = saved_model_location(path, base_dir)
            config = AutoConfig.from_pretrained(str(location), revision=revision, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - unreadable here (offline, remote code): the run checks it when it loads
        return None


def raise_early_issues(graph: PipelineGraph, base_dir: Path | None, locate: Locate | None = None) -> None:
    """The checks that need no data loaded and no worker: model paths that name nothing,
    reward functions that cannot be loaded, local data files that are not there. SpecError
    listing them, placed by ``locate`` when given (a run checks the rest, with the data, as
    it starts)."""
    issues = (model_problems(graph, base_dir) + reward_issues(graph, base_dir, None) + task_field_issues(graph)
              + local_subset_issues(graph, base_dir) + arch_issues(graph))
    sources = [("data.source", graph.spec.data.source)]
    if graph.spec.eval is not None and graph.spec.eval.source:
        sources.append(("eval.source", graph.spec.eval.source))
    for path, source in sources:
        problem = None if source.startswith(BUILTIN_PREFIX) else missing_local_source(source, base_dir)
        if problem is not None:
            issues.append((path, problem))
    endless = _endless_eval(graph)
    if endless is not None:
        issues.append(endless)
    if issues:
        raise SpecError(_located(issues, locate))


TASK_IGNORES = {
    "split": "splits", "subset": "configurations", "prompt_key": "prompt column",
    "answer_key": "answer column", "shuffle": "order to shuffle",
}
"""The data fields a built-in task of random prompts has no use for -> what it has none of."""


def task_field_issues(graph: PipelineGraph) -> list[Issue]:
    """A data field set to other than its default where ``data.source`` is a built-in task
    of random prompts, which reads none of them (the run would ignore them)."""
    data = graph.spec.data
    if not is_endless_task(data.source):
        return []
    changed = data.changed_fields()
    return [(f"data.{field}", f"{data.source} makes a new random prompt per row and has no {lacks}, so "
             f"data.{field} would be ignored; remove it, or name a data file or dataset as data.source")
            for field, lacks in TASK_IGNORES.items() if field in changed]


def arch_issues(graph: PipelineGraph) -> list[Issue]:
    """A device group's ``arch`` / ``preferred_arch`` that no device could match (a word that
    names no architecture, any on a CPU group): found before any device is matched."""
    from flowrl.devices.explain import arch_word_problem

    issues: list[Issue] = []
    for name, group in graph.spec.devices.items():
        problem = arch_word_problem(group)
        if problem is not None:
            issues.append((f"devices.{name}.{problem[0]}", problem[1]))
    return issues


def local_subset_issues(graph: PipelineGraph, base_dir: Path | None) -> list[Issue]:
    """``data.subset`` / ``eval.subset`` where the source they go with is a single local file:
    a subset is a configuration of a hub dataset (a folder each in its download), and one file
    has none. A folder's configurations are checked as it is read."""
    issues: list[Issue] = []
    data, evaluation = graph.spec.data, graph.spec.eval
    asked = [("data.subset", data.subset, data.source)]
    if evaluation is not None:
        asked.append(("eval.subset", evaluation.subset, evaluation.source or data.source))
    for field, subset, source in asked:
        local = resolve_local(source, base_dir) if subset is not None else None
        if local is not None and local.is_file():
            issues.append((field, f"a subset is a configuration of a hub dataset, and {source} is a single "
                                  f"file, which has none, so '{subset}' would be ignored; remove it"))
    return issues


def _endless_eval(graph: PipelineGraph) -> Issue | None:
    """An evaluation of a built-in task of random prompts: nothing there is held out."""
    evaluation = graph.spec.eval
    source = evaluation.source or graph.spec.data.source if evaluation is not None else None
    return ("eval.source", endless_task(source)) if source is not None and is_endless_task(source) else None


def _located(issues: list[Issue], locate: Locate | None) -> list[SpecIssue]:
    return [locate(path, message) if locate is not None else SpecIssue(path, message) for path, message in issues]


def inert_settings(graph: PipelineGraph) -> list[str]:
    """Settings this pipeline accepts and that change nothing where it runs, for a note (a
    pipeline may be written to run on CPU slots and GPUs alike): ``offload_to_cpu`` of a model
    whose nodes all run on CPU slots, where its weights are in host memory already; ``sharded``
    of a model whose updates all run on one device, where there is nothing to shard over; a
    score node no advantage reads, which only watches."""
    from flowrl.devices.groups import model_group, pipeline_groups
    from flowrl.planner.placement import node_group

    notes = []
    spec = graph.spec
    groups = pipeline_groups(spec)  # a model without a group has a one-CPU-slot group of its own
    for name, model in spec.models.items():
        if not model.offload_to_cpu:
            continue
        used = {node_group(graph, node) for node, item in spec.nodes.items() if item.model == name}
        if all(groups[group].type == "cpu" for group in used or {model_group(graph, name)} if group in groups):
            notes.append(f"models.{name}.offload_to_cpu pages a GPU model's weights, and '{name}' runs on CPU "
                         "slots, where its weights are in host memory already: it changes nothing here")
    trained = trained_scores(spec)
    for name, node in spec.nodes.items():
        if isinstance(node, ScoreNode) and name not in trained:
            notes.append(f"nodes.{name}: no advantage reads score node '{name}': its scores are logged "
                         f"(reward/{name}/*), and evaluated where an eval section scores it, and nothing trains on "
                         "them; list it in an advantage's inputs to train on it")
    for name, model in spec.models.items():
        if not model.sharded:
            continue
        updates = {node_group(graph, node) for node, item in spec.nodes.items() if item.model == name and item.trains}
        if updates and all(group in groups and groups[group].effective_count == 1 for group in updates):
            where = ", ".join(sorted(str(group) for group in updates))
            notes.append(f"models.{name}.sharded splits a trained model over its update's devices, and the update of "
                         f"'{name}' runs on one device (group {where}): it changes nothing here; give the group "
                         "count: 2 or more to shard")
    return notes
