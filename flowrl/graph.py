"""The pipeline as an immutable dataflow graph, and the rules a graph must follow.

Nodes are the iteration's role nodes plus the implicit data source ``prompts``; an edge
``producer -> consumer`` means the consumer reads the producer's output. A node whose role
reads the rollout without listing it (an advantage node reads the completion mask and the
sampling log-probs) gets an edge from its rollout too, marked ``implicit``, so the planner,
the executor and ``flowrl plan`` see every read. The checks here
know nothing of files: they return ``(dotted path, message)`` pairs, and the loader maps
paths to lines.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

import networkx as nx

from flowrl.errors import SpecError, SpecIssue
from flowrl.spec.messages import Issue, did_you_mean
from flowrl.spec.schema import (
    ADAPTER_DIR,
    SOURCE_NODE,
    AdvantageNode,
    GenerateNode,
    NodeBase,
    PipelineSpec,
    ReferenceLogprobNode,
    ScoreNode,
    UpdateNode,
    ValueNode,
)

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def find_graph_issues(spec: PipelineSpec, broken: Collection[str] = frozenset()) -> list[Issue]:
    """Every cross-reference and dataflow problem of ``spec``, as (dotted path, message).

    ``broken`` holds dotted paths that already failed schema validation: whole entries
    missing from ``spec`` (``nodes.adv``, or a section ``models``), or fields reset to their
    defaults (``nodes.train.kl_coef``). References to them are not reported again and rules
    that read them are skipped, so one mistake gives one message.
    """
    return _Checker(spec, frozenset(broken)).run()


class _Checker:
    def __init__(self, spec: PipelineSpec, broken: frozenset[str]) -> None:
        self.spec = spec
        self.broken = broken
        self.issues: list[Issue] = []

    def run(self) -> list[Issue]:
        for section in ("models", "devices", "nodes"):
            for name in getattr(self.spec, section):
                self._check_name(section, name)
        for name, model in self.spec.models.items():
            self._check_group(f"models.{name}.device_group", model.device_group)
            self._check_offload(name)
            self._check_sharded(name)
            self._check_lora(name)
            self._check_fp16_training(name)
            self._check_one_update(name)
        for name in self.spec.nodes:
            self._check_node(name)
        self._check_cycles()
        self._check_final_names()
        self._check_unused()
        self._check_eval()
        self._check_groups()
        self._check_unread()
        return self.issues

    def add(self, path: str, message: str) -> None:
        self.issues.append((path, message))

    def known(self, section: str, name: str) -> bool:
        """True when ``name`` exists in ``section`` or cannot be judged (it failed earlier)."""
        if section in self.broken or f"{section}.{name}" in self.broken:
            return True
        return name in getattr(self.spec, section)

    def reliable(self, path: str) -> bool:
        """False when ``path`` or an enclosing entry failed schema validation."""
        parts = path.split(".")
        return not any(".".join(parts[:end]) in self.broken for end in range(1, len(parts) + 1))

    def _check_name(self, section: str, name: str) -> None:
        if name == SOURCE_NODE and section == "nodes":
            self.add(
                f"nodes.{name}", "'prompts' is the data source's output; give the node another name"
            )
        elif not _NAME.match(name):
            suggestion = re.sub(r"[^a-z0-9_]+", "_", name.lower()).strip("_")
            self.add(
                f"{section}.{name}",
                f"names are lower_snake_case (a-z, digits, _; starting with a letter), "
                f"found '{name}'; try '{suggestion}'",
            )

    def _check_offload(self, model: str) -> None:
        """Paged weights suit only inference: a sampled or trained model stays on its device."""
        if not self.spec.models[model].offload_to_cpu or not self.reliable(f"models.{model}.offload_to_cpu"):
            return
        for name, node in self.spec.nodes.items():
            if node.model == model and not node.inference:
                self.add(
                    f"models.{model}.offload_to_cpu",
                    f"node '{name}' ({node.role_name()}) samples from or trains '{model}', and offloaded weights "
                    "serve only inference (reference, reward or value nodes); set offload_to_cpu: false",
                )
                return

    def _check_sharded(self, model: str) -> None:
        """Sharding is how an update trains: a model no update trains has nothing to shard,
        and two sharded models never share a group (a worker shards one model at a time)."""
        spec = self.spec.models[model]
        path = f"models.{model}.sharded"
        if not spec.sharded or not self.reliable(path):
            return
        if not self._nodes_known():
            return  # which nodes train what is not known
        trained, group = self._training_group(model)
        if not trained:
            self.add(path, f"no update node trains '{model}', and sharding splits a model's training over "
                           "the update's devices; set sharded: false, or train the model")
            return
        others = [name for name, other in self.spec.models.items()
                  if name < model and other.sharded and group is not None and self._training_group(name)[1] == group]
        if others:
            self.add(path, f"'{others[0]}' is trained sharded in device group '{group}' too, and a device "
                           "shards one model at a time; give one of them a device group of its own, or set "
                           "sharded: false on one")

    def _check_lora(self, model: str) -> None:
        """Adapters are trained by a policy's update, on whole copies of the model."""
        spec = self.spec.models[model]
        path = f"models.{model}.lora"
        if spec.lora is None or not self.reliable(path):
            return
        if spec.kind != "policy" and self.reliable(f"models.{model}.kind"):
            self.add(path, f"'{model}' is a {spec.kind} model, and adapters are trained on policies only; "
                           "remove lora from it")
            return
        if spec.sharded and self.reliable(f"models.{model}.sharded"):
            self.add(path, f"'{model}' also trains sharded, and adapters train on whole copies (their gradients "
                           "and optimizer state are small); set sharded: false, or remove lora")
            return
        if self._nodes_known() and not self._training_group(model)[0]:
            self.add(path, f"no update node trains '{model}', so its adapters would stay zero; remove lora, "
                           "or train the model")
            return

    def _check_final_names(self) -> None:
        """final/ is the one trained policy's directory, its adapters in final/adapter/ and any
        other trained model's weights in final/<name>/: a trained model named like the
        adapters' folder would collide with them (with several policies each has a folder)."""
        other = self.spec.models.get(ADAPTER_DIR)
        if other is None or not self._nodes_known() or not self._training_group(ADAPTER_DIR)[0]:
            return
        policies = [name for name, spec in self.spec.models.items()
                    if spec.kind == "policy" and self._training_group(name)[0]]
        if len(policies) == 1 and policies[0] != ADAPTER_DIR and self.spec.models[policies[0]].lora is not None:
            self.add(f"models.{ADAPTER_DIR}",
                     f"final/{ADAPTER_DIR}/ holds the adapters of '{policies[0]}', and a trained model's final "
                     f"weights go to final/<name>/; give this model another name")

    def _check_fp16_training(self, model: str) -> None:
        """fp16 gradients under- and overflow without loss scaling, which the update does not do."""
        path = f"models.{model}.dtype"
        if self.spec.models[model].dtype != "fp16" or not self.reliable(path):
            return
        if self._nodes_known() and self._training_group(model)[0]:
            self.add(path, f"an update node trains '{model}', and fp16 gradients underflow and overflow without "
                           "loss scaling, which flowrl's update does not do; train in bf16 (or fp32), and keep fp16 "
                           "for models that only generate or score")

    def _check_one_update(self, model: str) -> None:
        """One update node per model: a second would train it again on the same rollout with
        an optimizer of its own settings, and both would log under the same metric names."""
        updates = self._updates_of(model)
        for extra in updates[1:]:
            self.add(f"nodes.{extra}.model",
                     f"update node '{updates[0]}' trains '{model}' already, and a model has one update node; "
                     f"remove '{extra}', or give it more passes over the rollout with ppo_epochs on '{updates[0]}'")

    def _nodes_known(self) -> bool:
        """Every node passed schema validation, so which nodes train what is known."""
        return not any(broken == "nodes" or broken.startswith("nodes.") for broken in self.broken)

    def _updates_of(self, model: str) -> list[str]:
        """The update nodes that train ``model``, in file order."""
        return [name for name, node in self.spec.nodes.items() if node.model == model and node.trains]

    def _training_group(self, model: str) -> tuple[bool, str | None]:
        """Whether an update node trains ``model``, and the declared device group it trains it
        in (the node's own, else the model's; None: the model's own automatic group)."""
        updates = self._updates_of(model)
        if not updates:
            return False, None
        return True, self.spec.nodes[updates[0]].device_group or self.spec.models[model].device_group

    def _check_group(self, path: str, group: str | None) -> None:
        if group is None or self.known("devices", group):
            return
        declared = list(self.spec.devices)
        hint = did_you_mean(group, declared) or (
            f"; declared groups: {', '.join(declared)}"
            if declared
            else "; declare it under devices:"
        )
        self.add(path, f"no device group '{group}'{hint}")

    def _model_kind(self, node_name: str) -> str | None:
        """Kind of the node's model, or None when it has none or it is unknown/broken."""
        model_name = self.spec.nodes[node_name].model
        model = self.spec.models.get(model_name) if model_name is not None else None
        if model is None or not self.reliable(f"models.{model_name}.kind"):
            return None
        return model.kind

    def _check_node(self, name: str) -> None:
        node = self.spec.nodes[name]
        path = f"nodes.{name}"
        if node.model is not None and not self.known("models", node.model):
            models = list(self.spec.models)
            hint = did_you_mean(node.model, models) or f"; models: {', '.join(models)}"
            self.add(f"{path}.model", f"no model '{node.model}'{hint}")
        self._check_group(f"{path}.device_group", node.device_group)
        self._check_reference_model(name)
        if self.reliable(f"{path}.inputs") and self._check_inputs(name):
            self._check_role(name)
            self._check_mini_batch(name)

    def _check_mini_batch(self, name: str) -> None:
        """A mini-batch larger than the rollout is one optimizer step over the whole rollout,
        not what was asked (one that does not divide it is a warning when the run starts:
        ``uneven_mini_batches``)."""
        node = self.spec.nodes[name]
        size = getattr(node, "mini_batch_size", None)
        path = f"nodes.{name}.mini_batch_size"
        if size is None or not self.reliable(path) or not self.reliable("data.batch_size"):
            return
        rollouts = [item for item in node.inputs if isinstance(self.spec.nodes.get(item), GenerateNode)]
        if not all(self.reliable(f"nodes.{item}.n") for item in rollouts):
            return  # an n that failed the schema reads as its default here
        found = _rollout_size(self.spec, name)
        if found is not None and size > found[0]:
            rows, described = found
            self.add(path, f"mini_batch_size {size} is more than {described}; set at most {rows}, or remove it "
                           "(one optimizer step over the whole rollout)")

    def _check_reference_model(self, name: str) -> None:
        """A reference is a frozen model: a trained policy serves as one only through its
        frozen weights under adapters; without adapters its log-probs are the policy's own."""
        node = self.spec.nodes[name]
        model = node.model
        if not isinstance(node, ReferenceLogprobNode) or model is None or model not in self.spec.models:
            return
        if not self._nodes_known() or not self.reliable(f"models.{model}.lora"):
            return
        updates = self._updates_of(model)
        samples = any(isinstance(other, GenerateNode) and other.model == model for other in self.spec.nodes.values())
        # an update of a model that generates nothing is reported as that update's mistake
        if updates and samples and self.spec.models[model].lora is None:
            self.add(f"nodes.{name}.model",
                     f"update node '{updates[0]}' trains '{model}', so its log-probs are the policy's own, not a "
                     f"reference's; give the reference a model of its own (the same path, not trained), or train "
                     f"'{model}' with lora: its reference is then its frozen weights under the adapters")

    def _check_inputs(self, name: str) -> bool:
        """Report unknown, repeated and self inputs; False when an input cannot be judged."""
        path = f"nodes.{name}.inputs"
        judged = True
        seen: set[str] = set()
        for item in self.spec.nodes[name].inputs:
            if item in seen:
                self.add(path, f"'{item}' is listed twice")
            seen.add(item)
            if item == name:
                self.add(path, f"'{name}' reads its own output; drop '{name}' from inputs")
            elif item != SOURCE_NODE and not self.known("nodes", item):
                hint = did_you_mean(item, [*self.spec.nodes, SOURCE_NODE])
                self.add(path, f"no node '{item}'{hint}; inputs name other nodes or 'prompts'")
            if item != SOURCE_NODE and item not in self.spec.nodes:
                judged = False
        return judged

    def _check_role(self, name: str) -> None:
        self.spec.nodes[name].check(_View(self, name))

    def _check_cycles(self) -> None:
        """One message per group of nodes that feed each other: its shortest cycle."""
        order = {name: index for index, name in enumerate(self.spec.nodes)}
        graph = self._input_graph()
        components = [
            sorted(group, key=order.__getitem__)
            for group in nx.strongly_connected_components(graph)
        ]
        for group in sorted(
            (group for group in components if len(group) > 1), key=lambda g: order[g[0]]
        ):
            start = group[0]
            subgraph = graph.subgraph(group)
            paths = [
                nx.shortest_path(subgraph, start, last) for last in subgraph.predecessors(start)
            ]
            cycle = min(paths, key=lambda path: (len(path), [order[item] for item in path]))
            shown = " -> ".join([*cycle, start])
            # the edge that closes the cycle is an input of the first node
            self.add(f"nodes.{start}.inputs", f"cycle {shown}; one iteration must flow one way")

    def _check_unread(self) -> None:
        """A reference, value or advantage node whose output no node reads runs every step for
        nothing. Said only of an otherwise valid pipeline: where a node lacks an input, that
        node's message says what to add, and the unread one is the same mistake."""
        if self.issues or self.broken:
            return
        read = {item for node in self.spec.nodes.values() for item in node.inputs}
        readers = {AdvantageNode: "an update", ReferenceLogprobNode: "an update or an advantage with kl_coef > 0",
                   ValueNode: "an advantage (estimator: gae)"}
        for name, node in self.spec.nodes.items():
            # a score node no advantage reads still watches (logged, evaluated): a note, not this
            wanted = next((who for role, who in readers.items() if isinstance(node, role)), None)
            if wanted is not None and name not in read:
                self.add(f"nodes.{name}", f"no node reads {node.role} node '{name}': it would run every step for "
                                          f"nothing; list it in the inputs of {wanted}, or remove it")

    def _check_groups(self) -> None:
        """grpo and rloo compare the samples of each prompt: a rollout of one sample per
        prompt gives every completion the advantage 0, and nothing would train."""
        if self.issues or self.broken:
            return  # the inputs or the rollouts' fields may be what is wrong
        inputs = self._input_graph()
        for name, node in self.spec.nodes.items():
            if not isinstance(node, AdvantageNode) or node.estimator not in ("grpo", "rloo"):
                continue
            rollouts = {item: rollout for item in nx.ancestors(inputs, name)
                        if isinstance(rollout := self.spec.nodes[item], GenerateNode)}
            single = sorted(item for item, rollout in rollouts.items() if rollout.n < 2)
            if single and len(single) == len(rollouts):
                outcome = ("every advantage would be 0 and nothing would train" if node.estimator == "grpo"
                           else "a sample's baseline is the mean of the other samples of its prompt, and there are none")
                self.add(f"nodes.{single[0]}.n",
                         f"advantage '{name}' uses {node.estimator}, which compares the n samples of each prompt, "
                         f"and '{single[0]}' draws n: 1: {outcome}; set n to 2 or more (8 is usual), or use "
                         "estimator: reinforce_pp or gae, which need no groups")

    def _input_graph(self) -> nx.DiGraph:
        """The nodes and the inputs they list (not ``prompts``, not themselves), as edges."""
        graph = nx.DiGraph()
        graph.add_nodes_from(self.spec.nodes)
        graph.add_edges_from((item, name) for name, node in self.spec.nodes.items()
                             for item in node.inputs if item in self.spec.nodes and item not in (name, SOURCE_NODE))
        return graph

    def _check_eval(self) -> None:
        """Evaluation scores with score nodes (reward functions or reward models): named ones
        must be score nodes."""
        evaluation = getattr(self.spec, "eval", None)
        if evaluation is None or "eval" in self.broken or evaluation.scores is None:
            return
        scorers = [name for name, node in self.spec.nodes.items() if isinstance(node, ScoreNode)]
        for position, name in enumerate(evaluation.scores):
            if name in scorers or "nodes" in self.broken or f"nodes.{name}" in self.broken:
                continue
            if name in self.spec.nodes:
                self.add(f"eval.scores.{position}", f"'{name}' is not a score node")
            else:
                hint = did_you_mean(name, scorers) or (f"; score nodes: {', '.join(scorers)}" if scorers else "")
                self.add(f"eval.scores.{position}", f"no score node '{name}'{hint}")

    def _check_unused(self) -> None:
        if self.broken:
            return  # a broken entry or field may be the one that uses them
        used_models = {node.model for node in self.spec.nodes.values()}
        for name in self.spec.models:
            if name not in used_models:
                # a reward model named as a score node's function is read as a function's name
                named = [node for node, spec in self.spec.nodes.items()
                         if isinstance(spec, ScoreNode) and isinstance(spec.fn, str) and spec.fn.strip() == name]
                if named:
                    self.add(f"nodes.{named[0]}.fn", f"'{name}' is read as a reward function's name, and it is a "
                                                     f"model of this pipeline: to score with the model, write "
                                                     f"model: {name} instead of fn: {name}")
                    continue
                self.add(
                    f"models.{name}", f"no node uses model '{name}'; remove it or use it in a node"
                )
        used_groups = {
            item.device_group for item in [*self.spec.models.values(), *self.spec.nodes.values()]
        }
        for name in self.spec.devices:
            if name not in used_groups:
                self.add(
                    f"devices.{name}", f"no model or node uses device group '{name}'; remove it"
                )
        if not any(isinstance(node, GenerateNode) for node in self.spec.nodes.values()):
            self.add("nodes", "a pipeline needs a generate node to produce rollouts")
        elif not any(isinstance(node, UpdateNode) for node in self.spec.nodes.values()):
            self.add("nodes", "a pipeline needs an update node: without one nothing is trained; add one (role: update) "
                              "that trains the generating model on the rollout and its advantages")


class _View:
    """One node's view of the pipeline for its own rules (``NodeView``)."""

    def __init__(self, checker: _Checker, name: str) -> None:
        self._checker, self.name = checker, name
        self.model_kind = checker._model_kind(name)

    def inputs_of(self, role: type[NodeBase]) -> list[str]:
        nodes = self._checker.spec.nodes
        return [item for item in nodes[self.name].inputs if item != SOURCE_NODE and isinstance(nodes.get(item), role)]

    def node(self, name: str) -> NodeBase | None:
        return self._checker.spec.nodes.get(name)

    def reliable(self, path: str) -> bool:
        return self._checker.reliable(path)

    def add(self, path: str, message: str) -> None:
        self._checker.add(path, message)


class PipelineGraph:
    """An immutable, validated pipeline: the spec plus its dataflow graph.

    Building one checks every graph rule and raises ``SpecError`` listing all problems.
    Two graphs are equal when their specs are equal.
    """

    __slots__ = ("_spec", "_graph", "_order", "_rollouts")
    _spec: PipelineSpec
    _graph: nx.DiGraph
    _order: tuple[str, ...]
    _rollouts: dict[str, str | None]

    def __init__(self, spec: PipelineSpec) -> None:
        issues = find_graph_issues(spec)
        if issues:
            raise SpecError([SpecIssue(path, message) for path, message in issues])
        graph = nx.DiGraph()
        graph.add_node(SOURCE_NODE, role="source", spec=spec.data)
        for name, node in spec.nodes.items():
            graph.add_node(name, role=node.role, spec=node)
        for name, node in spec.nodes.items():
            graph.add_edges_from((item, name) for item in node.inputs)
        rank = {name: index for index, name in enumerate([SOURCE_NODE, *spec.nodes])}
        order = list(nx.lexicographical_topological_sort(graph, key=rank.__getitem__))
        rollouts = {name: _rollout_of(graph, order, name) for name in spec.nodes}
        for name, node in spec.nodes.items():
            rollout = rollouts[name]
            if node.reads_rollout and rollout is not None and rollout not in node.inputs:
                graph.add_edge(rollout, name, implicit=True)
        object.__setattr__(self, "_spec", spec)
        object.__setattr__(self, "_graph", nx.freeze(graph))
        object.__setattr__(self, "_order", tuple(name for name in order if name != SOURCE_NODE))
        object.__setattr__(self, "_rollouts", rollouts)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("a PipelineGraph cannot be changed; build a new one")

    @property
    def spec(self) -> PipelineSpec:
        """The validated spec this graph was built from."""
        return self._spec

    @property
    def name(self) -> str:
        """The pipeline's name."""
        return self._spec.name

    @property
    def graph(self) -> nx.DiGraph:
        """Frozen graph: nodes carry ``role`` and ``spec``; ``prompts`` has role ``source``."""
        return self._graph

    def topological_order(self) -> list[str]:
        """Node names (without ``prompts``) producers first; ties keep file order."""
        return list(self._order)

    def producers(self, node: str) -> list[str]:
        """Names whose output ``node`` reads: its inputs in order (may include prompts), then
        the rollout its role reads without listing it."""
        if node == SOURCE_NODE:
            return []
        listed = list(self._spec.nodes[node].inputs)
        return listed + [item for item in self._graph.predecessors(node) if item not in listed]

    def consumers(self, node: str) -> list[str]:
        """Nodes that read ``node``'s output, in file order."""
        return [name for name in self._spec.nodes if self._graph.has_edge(node, name)]

    def rollout_of(self, node: str) -> str | None:
        """The generate node ``node`` is or reads: itself, the first generate node among its
        inputs, else the first in file order among its ancestors; None when there is none."""
        return self._rollouts[node]

    def nodes_of(self, role: type[NodeBase]) -> list[str]:
        """Names of the nodes of ``role`` (a spec class such as ``UpdateNode``), in file order."""
        return [name for name, node in self._spec.nodes.items() if isinstance(node, role)]

    def to_dict(self) -> dict[str, Any]:
        """The spec as plain data (lists, dicts, strings, numbers); loads back to an equal graph."""
        return self._spec.model_dump(mode="json")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PipelineGraph):
            return NotImplemented
        return self._spec == other._spec

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PipelineGraph(name={self.name!r}, nodes={list(self._spec.nodes)})"


def _rollout_of(graph: nx.DiGraph, order: list[str], node: str) -> str | None:
    """``node`` itself if it generates, else the first generate node among its inputs, else
    the first generate node in ``order`` among its ancestors."""

    def generates(name: str) -> bool:
        return isinstance(graph.nodes[name].get("spec"), GenerateNode)

    if generates(node):
        return node
    listed = next((item for item in graph.nodes[node]["spec"].inputs if item in graph and generates(item)), None)
    if listed is not None:
        return listed
    ancestors = nx.ancestors(graph, node)
    return next((name for name in order if name in ancestors and generates(name)), None)


def _rollout_size(spec: PipelineSpec, name: str) -> tuple[int, str] | None:
    """The sequences of the rollout that update node ``name`` reads (data.batch_size x n) and
    how a message names them, or None when it reads no single generate node."""
    rollouts = [spec.nodes[item] for item in spec.nodes[name].inputs if isinstance(spec.nodes.get(item), GenerateNode)]
    if len(rollouts) != 1 or not isinstance(rollouts[0], GenerateNode):
        return None
    rows = spec.data.batch_size * rollouts[0].n
    return rows, f"the {rows} sequences of a rollout (data.batch_size {spec.data.batch_size} x n {rollouts[0].n})"


def trained_scores(spec: PipelineSpec) -> set[str]:
    """The score nodes an advantage reads: what training adds up. A score node no advantage
    reads only watches (its numbers are logged and evaluated, nothing trains on them)."""
    read = {item for node in spec.nodes.values() if isinstance(node, AdvantageNode) for item in node.inputs}
    return {name for name, node in spec.nodes.items() if isinstance(node, ScoreNode) and name in read}


def uneven_mini_batches(spec: PipelineSpec) -> list[str]:
    """A warning per update whose mini_batch_size does not divide its rollout: the last
    optimizer step of each epoch holds the few sequences left over, with a whole step's weight."""
    warnings = []
    for name, node in spec.nodes.items():
        size = getattr(node, "mini_batch_size", None)
        found = _rollout_size(spec, name) if size is not None else None
        if size is None or found is None:
            continue
        rows, described = found
        if size <= rows and rows % size:
            warnings.append(f"nodes.{name}.mini_batch_size: {size} does not divide {described}: "
                            f"the last optimizer step of each epoch holds {rows % size} sequence(s) with a whole step's "
                            f"weight; a divisor of {rows} gives equal steps")
    return warnings
