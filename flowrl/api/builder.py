"""The Python front end: build a pipeline step by step instead of writing YAML.

    p = Pipeline("grpo-digits")
    actor = p.model("actor", path="builtin:tiny-llama", group="actor_group")
    prompts = p.source("builtin:digits", batch_size=16)
    roll = p.generate(actor, prompts, n=8)
    ...
    graph = p.build()          # the same PipelineGraph load_pipeline() gives for the YAML

The builder only collects plain data; ``build()`` runs it through the same validation as a
YAML file, so both front ends accept and reject exactly the same pipelines. Issues carry
the dotted path (``nodes.train.lr``) but no file or line. A field name that the section or
node does not have is refused at once, by the call that gives it.
"""

from __future__ import annotations

import sys
from pathlib import Path, PurePath
from typing import Any, Callable

from flowrl.errors import SpecError, SpecIssue
from flowrl.graph import PipelineGraph
from flowrl.spec.dump import to_yaml
from flowrl.spec.loader import pipeline_from_dict
from flowrl.spec.messages import unknown_field
from flowrl.spec.schema import (
    NODE_CLASSES,
    SOURCE_NODE,
    DataSpec,
    DeviceGroupSpec,
    EvalSpec,
    ModelSpec,
    ProfilerSpec,
    PythonFunction,
    RuntimeSpec,
    SchedulerSpec,
    TrainerSpec,
)


class ModelRef(str):
    """The name of a model declared with ``Pipeline.model``; pass it to node methods."""


class NodeRef(str):
    """The name of a node (or ``prompts``); pass it as an input of later nodes."""




class Pipeline:
    """A pipeline under construction. Every node method returns the node's name."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._models: dict[str, dict[str, Any]] = {}
        self._devices: dict[str, dict[str, Any]] = {}
        self._implicit_groups: list[str] = []
        self._nodes: dict[str, dict[str, Any]] = {}
        self._data: dict[str, Any] | None = None
        self._sections: dict[str, dict[str, Any]] = {}
        self._unnamable: dict[str, str] = {}
        """Score node -> why its function (passed by value) has no name a file can load."""

    # --- models, devices, data -------------------------------------------------------

    def model(self, name: str, path: str, group: str | None = None, **fields: Any) -> ModelRef:
        """Declare a model. ``group`` (or ``device_group``) names its device group.

        A group that ``devices()`` never describes is a default group (one CPU slot).
        """
        if name in self._models:
            raise SpecError([SpecIssue(f"models.{name}", f"a model named '{name}' already exists")])
        _check_fields(fields, ModelSpec, f"models.{name}")
        given = fields.get("device_group")
        if group is not None and given is not None and given != group:
            raise SpecError([SpecIssue(f"models.{name}.device_group", f"two device groups given, group='{group}' and "
                                                                      f"device_group='{given}': give one")])
        entry: dict[str, Any] = {"path": path, **fields}
        if group is not None:
            entry["device_group"] = group
        self._note_group(entry.get("device_group"))
        self._models[name] = entry
        return ModelRef(name)

    def devices(self, group: str, **fields: Any) -> str:
        """Describe a device group (``type``, ``count``, ``min_memory_gb``, ...)."""
        _check_fields(fields, DeviceGroupSpec, f"devices.{group}")
        self._devices[group] = {**self._devices.get(group, {}), **fields}
        return group

    def source(self, source: str, **fields: Any) -> NodeRef:
        """Set the prompt source (``builtin:digits``, a .jsonl path); returns ``prompts``."""
        if self._data is not None:
            raise SpecError(
                [SpecIssue("data", "a pipeline has one data source; source() was called twice")]
            )
        _check_fields(fields, DataSpec, "data")
        self._data = {"source": source, **fields}
        return NodeRef(SOURCE_NODE)

    def trainer(self, **fields: Any) -> None:
        """Set trainer fields (``steps``, ``output_dir``, ``seed``, ...)."""
        self._set_section("trainer", fields)

    def eval(self, **fields: Any) -> None:
        """Set held-out evaluation fields (``source``, ``every_steps``, ``n``, ...)."""
        self._set_section("eval", fields)

    def profiler(self, **fields: Any) -> None:
        """Set profiler fields (``ewma_window``, ...)."""
        self._set_section("profiler", fields)

    def scheduler(self, **fields: Any) -> None:
        """Set scheduler fields (``policy``, ``every_steps``, ...)."""
        self._set_section("scheduler", fields)

    def runtime(self, **fields: Any) -> None:
        """Set runtime fields (``cpu_slots``, ``scheduler_address``, ...)."""
        self._set_section("runtime", fields)

    # --- nodes -----------------------------------------------------------------------

    def generate(self, model: str, *inputs: str, name: str | None = None, **fields: Any) -> NodeRef:
        """Sample completions of ``inputs`` (normally ``prompts``) from a policy model."""
        return self._node("generate", name, inputs, {"model": str(model), **fields})

    def score(self, scorer: str | Callable[..., Any], *inputs: str, name: str | None = None, **fields: Any) -> NodeRef:
        """Score a rollout with a reward model, a reward function's name (``math_answer``,
        ``module:function``), or a Python function itself, which reaches the workers by value."""
        if isinstance(scorer, ModelRef):
            return self._node("score", name, inputs, {"model": str(scorer), **fields})
        if isinstance(scorer, str) and scorer in self._models:
            raise SpecError([SpecIssue("nodes", f"score('{scorer}', ...): a name is read as a reward function's, and "
                                                f"'{scorer}' is a model of this pipeline: pass what p.model() returned "
                                                "for it to score with the model")])
        if isinstance(scorer, str):
            return self._node("score", name, inputs, {"fn": scorer, **fields})
        if callable(scorer):
            function = function_by_value(scorer)
            node = self._node("score", name, inputs, {"fn": function, **fields})
            if (problem := unnamable_function(scorer, function.name)) is not None:
                self._unnamable[node] = problem
            return node
        raise SpecError([SpecIssue("nodes", f"score() takes a model, a function's name or a function, not {type(scorer).__name__}")])

    def reference_logprob(
        self, model: str, *inputs: str, name: str | None = None, **fields: Any
    ) -> NodeRef:
        """Log-probabilities of a rollout under a frozen reference model."""
        return self._node("reference_logprob", name, inputs, {"model": str(model), **fields})

    def value(self, model: str, *inputs: str, name: str | None = None, **fields: Any) -> NodeRef:
        """Value estimates of a rollout from a value model."""
        return self._node("value", name, inputs, {"model": str(model), **fields})

    def advantage(
        self, estimator: str, *inputs: str, name: str | None = None, **fields: Any
    ) -> NodeRef:
        """Advantages from scores (and values) with ``estimator`` (``grpo``, ...)."""
        return self._node("advantage", name, inputs, {"estimator": estimator, **fields})

    def update(self, model: str, *inputs: str, name: str | None = None, **fields: Any) -> NodeRef:
        """Train ``model`` on a rollout and its advantages (and reference log-probs)."""
        return self._node("update", name, inputs, {"model": str(model), **fields})

    # --- output ----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The pipeline as plain data, the same shape as a parsed YAML file."""
        devices: dict[str, dict[str, Any]] = {
            group: {} for group in self._implicit_groups if group not in self._devices
        }
        devices.update(self._devices)
        data: dict[str, Any] = {"name": self._name, "models": dict(self._models)}
        if devices:
            data["devices"] = devices
        data["nodes"] = dict(self._nodes)
        if self._data is not None:
            data["data"] = dict(self._data)
        data.update({section: dict(fields) for section, fields in self._sections.items()})
        return plain_value(data)

    def build(self) -> PipelineGraph:
        """Validate and return the immutable pipeline; raises ``SpecError`` listing all problems."""
        return pipeline_from_dict(self.to_dict())

    def to_yaml(self) -> str:
        """The pipeline as YAML text (validated first). A reward function passed by value is
        written as its ``module:function`` name, so it must be one a file can name."""
        graph = self.build()
        issues = [SpecIssue(f"nodes.{name}.fn", problem) for name, problem in self._unnamable.items()]
        if issues:
            raise SpecError(issues)
        return to_yaml(graph)

    # --- internals -------------------------------------------------------------------

    def _node(
        self, role: str, name: str | None, inputs: tuple[str, ...], fields: dict[str, Any]
    ) -> NodeRef:
        if name is None:
            default = NODE_CLASSES[role].default_name
            # a second node of a role is named by its model where that differs from the first's
            # (train_critic beside train)
            model = fields.get("model")
            by_model = isinstance(model, str) and self._nodes.get(default, {}).get("model") not in (None, str(model))
            name = f"{default}_{model}" if default in self._nodes and by_model else default
            suffix = 2
            while name in self._nodes:
                name = f"{default}_{suffix}"
                suffix += 1
        elif name in self._nodes:
            raise SpecError([SpecIssue(f"nodes.{name}", f"a node named '{name}' already exists")])
        _check_fields(fields, NODE_CLASSES[role], f"nodes.{name}", role)
        listed = [item for item in inputs if not isinstance(item, str)]
        if listed:
            raise SpecError([SpecIssue(f"nodes.{name}.inputs", f"inputs are passed one by one (p.{role}(..., roll, adv)), "
                                                               f"not as {type(listed[0]).__name__} {listed[0]!r}")])
        self._note_group(fields.get("device_group"))
        self._nodes[name] = {"role": role, "inputs": [str(item) for item in inputs], **fields}
        return NodeRef(name)

    def _note_group(self, group: Any) -> None:
        if isinstance(group, str) and group not in self._implicit_groups:
            self._implicit_groups.append(group)

    def _set_section(self, section: str, fields: dict[str, Any]) -> None:
        _check_fields(fields, _SECTIONS[section], section)
        self._sections[section] = {**self._sections.get(section, {}), **fields}


def plain_value(value: Any, key: str = "") -> Any:
    """Python values as a YAML file would give them, which validation takes strictly: a tuple
    is a list, a ``Path`` a string, a numpy scalar its number. A score node's ``params`` go to
    the reward function as given."""
    if isinstance(value, dict):
        return value if key == "params" else {name: plain_value(item, str(name)) for name, item in value.items()}
    if isinstance(value, (tuple, list)):
        return [plain_value(item) for item in value]
    if isinstance(value, PurePath):
        return str(value)
    # a numpy scalar (or 0-d array), not an array: validation names an array as it is
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
        number = value.item()
        # a float32's shortest text is the number meant (0.7, not 0.699999988079071)
        return float(str(value)) if isinstance(number, float) else number
    return value


_SECTIONS = {"trainer": TrainerSpec, "scheduler": SchedulerSpec, "runtime": RuntimeSpec, "eval": EvalSpec,
             "profiler": ProfilerSpec}


def _check_fields(fields: dict[str, Any], owner: Any, path: str, role: str | None = None) -> None:
    """Refuse, where the builder's method is called, field names that ``owner`` does not have."""
    issues = [SpecIssue(f"{path}.{name}", unknown_field(name, owner, role)) for name in fields
              if name not in owner.model_fields]
    if issues:
        raise SpecError(issues)


def function_by_value(fn: Callable[..., Any]) -> PythonFunction:
    """``fn`` pickled with its code, so a worker that cannot import its module still runs it.

    Functions of installed packages (and flowrl's own) pickle by reference, like any import;
    a function of ``__main__`` or of a module that is a loose file (a script, a test) pickles
    by value, with the module-level names it uses.
    """
    import cloudpickle  # type: ignore[import-untyped]

    module_name = getattr(fn, "__module__", None) or "__main__"
    module = sys.modules.get(module_name)
    by_value = module is not None and module_name != "__main__" and not _installed(module)
    if by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        payload = cloudpickle.dumps(fn)
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(module)
    qualname = getattr(fn, "__qualname__", type(fn).__name__)
    file = getattr(getattr(fn, "__code__", None), "co_filename", None)
    return PythonFunction(name=f"{module_name}:{qualname}", payload=payload, file=file)


def unnamable_function(fn: Callable[..., Any], name: str) -> str | None:
    """Why ``fn``, named ``module:qualname``, cannot be named in a pipeline file (a lambda, a
    function defined inside another, one of the script or notebook itself, a callable that its
    name does not lead back to), or None."""
    module_name, _, qualname = name.partition(":")
    if "<lambda>" in qualname or "<locals>" in qualname:
        what = "is a lambda" if qualname.endswith("<lambda>") else "is a function defined inside another"
    elif module_name == "__main__":
        what = "is a function of the script or notebook that builds the pipeline"
    elif _by_name(module_name, qualname) is not fn:
        what = (f"is not what its name {name} leads to (a functools.partial, a callable object or a bound "
                "method is not a function of a module)")
    else:
        return None
    return (
        f"the reward function '{qualname}' {what}, which a pipeline file cannot name: define it at "
        "the top level of a module next to the file (my_rewards.py) and pass it from there, or run "
        "the pipeline from Python with run(p), which takes the function itself"
    )


def _by_name(module_name: str, qualname: str) -> Any:
    """What ``module:qualname`` names in this process (None where nothing)."""
    target: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        target = getattr(target, part, None)
    return target


def _installed(module: Any) -> bool:
    """Whether a module comes from an installed package or the standard library."""
    file = getattr(module, "__file__", None)
    if file is None or module.__name__.split(".")[0] == "flowrl":
        return True
    parts = Path(file).resolve().parts
    return "site-packages" in parts or "dist-packages" in parts or Path(file).resolve().is_relative_to(Path(sys.base_prefix).resolve())
