"""The pipeline schema: what a pipeline file (or the Python builder) may say.

Every model here is frozen and rejects unknown keys, so a typo is an error and never a
silently ignored setting. Each field carries its unit and default in the docstring under it.
Cross-references between sections (a node naming a model, a model naming a device group)
are checked on the graph (``flowrl.graph``), not here, so that all problems are found at once.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal, Protocol

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    InstanceOf,
    TypeAdapter,
    ValidationError,
    field_serializer,
    model_validator,
)

from flowrl.spec.strict import StrictModel

SOURCE_NODE = "prompts"
"""The name of the data source's output; node inputs use it to read prompts."""


def _check_targets(value: Any) -> Any:
    """One message for the two kinds of value ``target_modules`` takes (a union's error would
    name each of its branches)."""
    if value == "all-linear":
        return value
    if isinstance(value, list) and value and all(isinstance(item, str) and item for item in value):
        return value
    hint = " (did you mean all-linear?)" if isinstance(value, str) and value.replace("_", "-").lower() == "all-linear" else (
        f" (a list: [{value}])" if isinstance(value, str) and value else "")
    raise ValueError(f"expected all-linear or a list of module names such as [q_proj, v_proj], found {value!r}{hint}")


ADAPTER_DIR = "adapter"
"""The folder of a checkpoint or ``final/`` that holds a model's adapters alone."""


class LoraSpec(StrictModel):
    """Low-rank adapters (LoRA, through ``peft``): the update trains two small matrices beside
    each adapted linear layer, ``W x + (alpha / rank) B A x``, and the model's own weights stay
    frozen, so gradients and optimizer state exist for the adapters only."""

    rank: Annotated[int, Field(ge=1)] = 16
    """Inner dimension r of each adapter (A is r x in, B is out x r). Default 16."""
    alpha: Annotated[int, Field(ge=1)] | None = None
    """Scale numerator: the adapter's output is multiplied by alpha / rank. Default None
    (= 2 x rank)."""
    target_modules: Annotated[Literal["all-linear"] | list[str], BeforeValidator(_check_targets)] = "all-linear"
    """Which linear layers get adapters: ``all-linear`` (every linear layer of the decoder
    layers, not the output head) or a list of module names (``[q_proj, v_proj]``; a name matches
    the end of a module's dotted path). The embeddings and the output head cannot take
    adapters. Default all-linear."""

    @property
    def scale_alpha(self) -> int:
        return self.alpha if self.alpha is not None else 2 * self.rank


class ModelSpec(StrictModel):
    """One model that nodes run: a policy, a value model (critic) or a reward model."""

    path: str
    """Where the weights come from: ``builtin:NAME``, a local directory, or a hub name. Required."""
    kind: Literal["policy", "value", "reward"] = "policy"
    """What it computes: next-token policy, scalar value, or scalar reward. Default policy."""
    device_group: str | None = None
    """A group under ``devices:``; None gives the model its own one-CPU-slot group. Default None."""
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Parameter and compute precision. A bf16 model that an update trains keeps fp32 master
    weights in its optimizer (with AdamW's moments, 12 bytes per parameter), so updates below
    16-bit resolution add up instead of being lost; fp16 is for models no update trains (its
    gradients would need loss scaling). Default fp32."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory (update nodes only). Default false."""
    offload_to_cpu: bool = False
    """On a GPU, keep the weights in pinned host memory between calls and copy them to the GPU
    for each call (the planner then counts no resident weights). Only for models that are
    never trained or sampled from: a reference, a reward model. Default false."""
    sharded: bool = False
    """When its update node runs on several devices, train the model sharded over them
    (FSDP2): each device keeps 1/N of the trained parameters, their gradients and the
    optimizer's moments, plus the whole weights in bf16/fp32 as declared, for generation,
    scoring and checkpoints (refreshed after each update). Saves memory against a whole
    trainable copy per device, at the price of gathering each layer's parameters in every
    pass. One sharded model per device. Default false (every device trains a whole copy and
    the gradients are summed)."""
    lora: LoraSpec | None = None
    """Train low-rank adapters instead of every weight (see :class:`LoraSpec`; only for a
    policy an update trains, not together with ``sharded``). Copies of the model on other
    devices receive only the adapters after each update; checkpoints hold the adapters alone
    in ``adapter/`` (a ``peft`` adapter directory) and ``final/`` also the merged model (a plain
    model directory). Default None (every weight is trained)."""
    revision: str | None = None
    """Branch, tag or commit of a hub model (``path: org/name``); None takes the default
    branch. Default None."""
    trust_remote_code: bool = False
    """Run the model's own Python code from its folder or hub repository (models whose
    architecture transformers lacks). Only for code you trust. Default false."""


class DeviceGroupSpec(StrictModel):
    """A logical device group: what a set of nodes needs, not which card it gets."""

    type: Literal["cpu", "gpu"] = "cpu"
    """Kind of device. Default cpu."""
    count: Annotated[int, Field(ge=1)] | None = None
    """Number of devices (CPU slots or GPUs). Default None (= 1)."""
    min_count: Annotated[int, Field(ge=1)] | None = None
    """Refused: a group's size is fixed (``count``). Kept as a field so that a file giving it
    is told so, not told of an unknown field. Default None."""
    max_count: Annotated[int, Field(ge=1)] | None = None
    """Refused, as ``min_count``. Default None."""
    min_memory_gb: Annotated[float, Field(gt=0)] | None = None
    """Least memory per device, in GiB. Default None (any)."""
    arch: list[str] | None = None
    """Accepted GPU architectures (``[a100, h100]``); others do not match. Default None (any)."""
    preferred_arch: list[str] | None = None
    """Architectures tried first when several match. Default None (no preference)."""
    device_ids: list[Annotated[int, Field(ge=0)]] | None = None
    """Pin the group to these physical device indices; turns matching off. Default None."""
    exclusive: bool = False
    """Keep this group's devices to itself: the planner then never runs another group's nodes
    on them, nor this group's nodes on another group's devices. Without it the planner may
    let two groups share devices when memory fits and the predicted step is shorter (a
    reference model next to the actor saves the transfers between them). Default false."""

    @model_validator(mode="after")
    def _counts_agree(self) -> DeviceGroupSpec:
        ranged = [name for name in ("min_count", "max_count") if getattr(self, name) is not None]
        if ranged:
            # nothing sizes a group between two counts: the planner splits a node's work over
            # the devices a group has, and the dynamic scheduler moves nodes between devices
            # (a lost device's group goes on with the others) but never adds one to a group
            raise ValueError(
                f"{' and '.join(ranged)}: a device group's size is fixed for the run; give count: N (the "
                "devices its nodes' work is split over)"
            )
        if self.device_ids is not None and self.count is not None:
            if len(self.device_ids) != self.count:
                raise ValueError(
                    f"device_ids lists {len(self.device_ids)} devices but count is {self.count}"
                )
        return self

    @property
    def effective_count(self) -> int:
        """Number of devices the group starts with."""
        if self.count is not None:
            return self.count
        if self.device_ids is not None:
            return len(self.device_ids)
        return 1


Split = Literal["none", "prompts", "rows", "ranks"]
"""How a node runs over several devices: not at all; by whole prompts (generation); by rollout
rows, each part computed alone and the parts joined (inference); as the ranks of one
data-parallel optimisation (training)."""

Work = Literal["decode", "forward", "train", "function", "elementwise"]
"""What a node's call costs (``flowrl.planner.costs`` prices each): token-by-token sampling, one
no-grad pass of a model over the rollout, forward and backward passes plus optimizer steps, a
Python reward function per completion, or a little tensor arithmetic on the CPU."""

Output = Literal["rollout", "per_sequence", "per_token", "none"]
"""What a node's output holds per completion: the sequences themselves, one number, one number
per completion token, or nothing (metrics only)."""

_WHOLE_NUMBER = TypeAdapter(int, config=ConfigDict(strict=True))
"""An integer field's reading, as other fields get it: an int, never a float or a text."""


def _check_pass_tokens(value: Any) -> Any:
    """One message for the three kinds of value ``micro_batch_tokens`` takes (a union's
    error would name each of its branches)."""
    if value is None or value == "auto":
        return value
    shown = str(value).lower() if isinstance(value, bool) else repr(value)
    problem = f"expected a positive whole number of tokens per pass, auto or null, found {shown}"
    if isinstance(value, bool):
        raise ValueError(problem)
    try:
        number = _WHOLE_NUMBER.validate_python(value)
    except ValidationError:
        raise ValueError(problem) from None
    if number < 1:
        raise ValueError(problem)
    return number


_SCHEDULER_ADDRESS = re.compile(r"^(?:(?P<scheme>[a-z]+)://)?(?P<host>\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):(?P<port>\d+)/?$")
SCHEDULER_SCHEMES = ("tcp", "tls", "ucx", "inproc", "ws", "wss")


def check_scheduler_address(value: Any) -> Any:
    """A Dask scheduler address: ``[scheme://]host:port`` with a port in 1-65535."""
    if value is None:
        return value
    text = str(value).strip()
    found = _SCHEDULER_ADDRESS.match(text)
    scheme = found.group("scheme") if found else None
    if found is None or not 0 < int(found.group("port")) < 65536 or (scheme and scheme not in SCHEDULER_SCHEMES):
        raise ValueError(f"expected a Dask scheduler address such as tcp://HOST:8786 (scheme://host:port, "
                         f"port 1-65535, scheme one of {', '.join(SCHEDULER_SCHEMES)}), found {text!r}")
    return text


def _each_once(items: tuple[str, ...]) -> tuple[str, ...]:
    """A list of names where a repeat would do the same thing twice (a logger writing every
    number twice)."""
    repeated = sorted({item for item in items if items.count(item) > 1})
    if repeated:
        raise ValueError(f"each may be listed once; {', '.join(repr(item) for item in repeated)} is listed more than once")
    return items


PassTokens = Annotated[Annotated[int, Field(ge=1)] | Literal["auto"] | None, BeforeValidator(_check_pass_tokens)]
"""``micro_batch_tokens``: a number of padded tokens per pass, ``auto`` (the planner picks the
largest pass that fits the node's devices, ``flowrl.planner.micro_batches``), or None (the
whole batch in one pass)."""


def pass_tokens(value: int | str | None) -> int | None:
    """The token budget of a pass as a role runs it; ``auto`` must have been resolved by the
    planner before the run (``flowrl.planner.micro_batches.resolve_micro_batches``)."""
    if value == "auto":
        raise ValueError("micro_batch_tokens: auto reached a node call unresolved; the planner resolves it "
                         "before a run (flowrl.planner.micro_batches.resolve_micro_batches)")
    assert value is None or isinstance(value, int)
    return value


class NodeView(Protocol):
    """What a node's own rules see of the pipeline around it (``flowrl.graph`` answers)."""

    name: str
    model_kind: str | None
    """Kind of the node's model; None when it has none or the model is unknown or broken."""

    def inputs_of(self, role: type[_NodeBase]) -> list[str]:
        """The node's inputs that are nodes of ``role``, in input order."""
        ...

    def node(self, name: str) -> _NodeBase | None:
        """Another node of the pipeline; None when there is none of that name."""
        ...

    def reliable(self, path: str) -> bool:
        """False when ``path`` (dotted, from the file's top) failed schema validation."""
        ...

    def add(self, path: str, message: str) -> None:
        """Report a problem at ``path`` (dotted, from the file's top)."""
        ...


class _NodeBase(StrictModel):
    """What every node has. The class variables below say what the role is, for every layer
    (no torch here); how a role runs on a worker is ``flowrl.roles.registry``."""

    split: ClassVar[Split] = "none"
    trains: ClassVar[bool] = False
    """Its calls change the weights of its model (the runtime then sends them to the copies)."""
    reads_rollout: ClassVar[bool] = True
    """It reads the rollout of the generate node it descends from, listed in ``inputs`` or not."""
    rate_of_output: ClassVar[bool] = False
    """Its throughput counts the tokens it produces (generation), not those it reads."""
    timing_label: ClassVar[str] = ""
    """Short name of its time in the metrics (``timing_s/gen``), verl's where verl has one."""
    default_name: ClassVar[str] = ""
    """The node name the Python builder gives when none is given."""

    inputs: list[str] = []
    """Names of the nodes (or ``prompts``) whose outputs this node reads. Default []."""
    model: str | None = None
    """Name of a model under ``models:``. Default None."""
    device_group: str | None = None
    """Run this node on this group instead of its model's. Default None (the model's group)."""

    @classmethod
    def role_name(cls) -> str:
        return str(cls.model_fields["role"].default)

    @property
    def work(self) -> Work:
        return "forward"

    @property
    def output(self) -> Output:
        return "per_token"

    @property
    def inference(self) -> bool:
        """One no-grad pass of a model (the planner may page such a model in and out)."""
        return self.work == "forward" and self.model is not None

    def timing_name(self, model_kind: str | None) -> str:
        return self.timing_label

    def check(self, view: NodeView) -> None:
        """Report what is wrong with this node's inputs and model for its role."""

    def _need(self, view: NodeView, role: type[_NodeBase], what: str) -> None:
        if not view.inputs_of(role):
            view.add(f"nodes.{view.name}.inputs", f"{self.role_name()} needs {what}: add a {role.role_name()} node to inputs")

    def _need_kind(self, view: NodeView, wanted: str) -> None:
        if view.model_kind is not None and view.model_kind != wanted:
            view.add(f"nodes.{view.name}.model",
                     f"{self.role_name()} needs a {wanted} model; '{self.model}' is kind {view.model_kind} "
                     f"(set models.{self.model}.kind: {wanted} if it is one)")


class GenerateNode(_NodeBase):
    """Sample completions of the prompts from a policy model (a rollout)."""

    role: Literal["generate"] = "generate"
    """Always ``generate``."""
    split: ClassVar[Split] = "prompts"
    reads_rollout: ClassVar[bool] = False
    rate_of_output: ClassVar[bool] = True
    timing_label: ClassVar[str] = "gen"
    default_name: ClassVar[str] = "rollout"
    model: str
    """Name of the policy model that samples. Required."""
    n: int = Field(default=8, ge=1)
    """Completions per prompt (the GRPO group size). Default 8."""
    max_new_tokens: int = Field(default=16, ge=1)
    """Most tokens generated per completion, in tokens; with the longest prompt, at most the
    positions of the models that read the rollout (checked against their config). Default 16."""
    temperature: float = Field(default=1.0, gt=0)
    """Softmax temperature of sampling. Default 1.0."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling mass; 1.0 keeps every token. Default 1.0."""
    top_k: int = Field(default=0, ge=0)
    """Sample among the k likeliest tokens; 0 turns it off. Default 0."""
    engine: Literal["auto", "static", "loop"] = "auto"
    """Decode engine. ``static``: flowrl's decoder over a KV cache allocated once, whose
    per-token step replays one CUDA graph on a GPU and runs eagerly on a CPU (Llama and Qwen2
    models). ``loop``: one transformers forward per token (any causal LM). ``auto``: static
    when the model supports it, else loop. Default auto."""

    @property
    def work(self) -> Work:
        return "decode"

    @property
    def output(self) -> Output:
        return "rollout"

    def check(self, view: NodeView) -> None:
        path = f"nodes.{view.name}.inputs"
        if SOURCE_NODE not in self.inputs:
            view.add(path, "generate needs the prompts: add 'prompts' to inputs")
        for item in self.inputs:
            if item not in (SOURCE_NODE, view.name) and view.node(item) is not None:
                view.add(path, f"generate reads only 'prompts'; drop '{item}'")
        self._need_kind(view, "policy")


class PythonFunction(BaseModel):
    """A reward function passed by value to the Python builder (``p.score(my_fn, roll)``).

    It travels to the workers as its pickled bytes; a pipeline file can never hold one (only
    an instance passes validation), so loading YAML never unpickles anything. Written to a
    file it becomes its ``name``, ``module:function``.
    """

    model_config = ConfigDict(frozen=True)

    name: str
    """``module:qualified_name`` of the function, for logs and for the YAML form."""
    payload: bytes
    """The function pickled by value (cloudpickle)."""
    file: str | None = None
    """The file the function was defined in: its code unpickled by value names none, and an
    error raised in it is told with this file and line."""


class ScoreNode(_NodeBase):
    """Give every completion a scalar reward, by a function or a reward model."""

    role: Literal["score"] = "score"
    """Always ``score``."""
    split: ClassVar[Split] = "rows"
    timing_label: ClassVar[str] = "reward"
    default_name: ClassVar[str] = "reward"
    fn: str | InstanceOf[PythonFunction] | None = None
    """Reward function: a registry name (``math_answer``), ``module:function`` (a ``.py`` file
    next to the pipeline or an installed module), or, from the Python builder, the function
    itself. Default None."""
    model: str | None = None
    """Name of a reward model (kind reward) instead of ``fn``. Default None."""
    weight: float = 1.0
    """Factor applied to this score when several are summed. Default 1.0."""
    on_error: Literal["zero", "strict"] = "zero"
    """When the function raises: score 0 and go on, or stop the run. Default zero."""
    params: dict[str, Any] = {}
    """Extra keyword arguments for the reward function (``pattern`` of ``regex_format``).
    Default {}."""
    micro_batch_tokens: PassTokens = None
    """With a reward model: most padded tokens (rows x longest row) in one forward pass, rows
    sorted by length; ``auto``: the largest pass that the planner's memory model fits (as on
    reference_logprob nodes). None: the whole batch in one pass. Default None."""
    retokenize: bool = False
    """With a reward model whose tokenizer is not the policy's: read each prompt and completion
    as text with the reward model's own tokenizer (a chat prompt and its completion as an
    assistant message through its chat template, when it has one) instead of the policy's
    token ids. Default false."""

    @field_serializer("fn")
    def _fn_as_text(self, fn: str | PythonFunction | None) -> str | None:
        return fn.name if isinstance(fn, PythonFunction) else fn

    @property
    def fn_name(self) -> str | None:
        """The reward function's name as logs show it."""
        return self.fn.name if isinstance(self.fn, PythonFunction) else self.fn

    @property
    def work(self) -> Work:
        return "function" if self.model is None else "forward"

    @property
    def output(self) -> Output:
        return "per_sequence"

    def check(self, view: NodeView) -> None:
        self._need(view, GenerateNode, "a rollout")
        if self.model is not None:
            self._need_kind(view, "reward")

    @model_validator(mode="after")
    def _one_scorer(self) -> ScoreNode:
        if self.fn is None and self.model is None:
            raise ValueError(
                "a score node needs 'fn' (a reward function) or 'model' (a reward model)"
            )
        if self.fn is not None and self.model is not None:
            raise ValueError("give either 'fn' or 'model', not both")
        if self.model is None and self.micro_batch_tokens is not None:
            raise ValueError("micro_batch_tokens bounds a reward model's forward passes; this score calls "
                             "a function ('fn'): leave micro_batch_tokens out")
        if self.model is None and self.retokenize:
            raise ValueError("retokenize reads the texts with a reward model's own tokenizer; this score calls "
                             "a function ('fn'), which gets the texts anyway: leave retokenize out")
        if self.model is not None:
            function_only = [name for name in ("params", "on_error") if name in self.changed_fields()]
            if function_only:
                raise ValueError(f"{' and '.join(function_only)} {'applies' if len(function_only) == 1 else 'apply'} "
                                 "to a reward function ('fn'); this score runs a reward model: leave "
                                 f"{'it' if len(function_only) == 1 else 'them'} out")
        return self


class ReferenceLogprobNode(_NodeBase):
    """Log-probabilities of the rollout under a frozen reference model (for the KL penalty)."""

    role: Literal["reference_logprob"] = "reference_logprob"
    """Always ``reference_logprob``."""
    split: ClassVar[Split] = "rows"
    timing_label: ClassVar[str] = "ref"
    default_name: ClassVar[str] = "ref"
    model: str
    """Name of the reference model. Required."""
    micro_batch_tokens: PassTokens = None
    """Most padded tokens (rows x longest row) in one forward pass; rows are sorted by length,
    so little padding is computed. ``auto``: the largest pass that the planner's memory model
    fits on the node's devices beside everything else there (with the memory reserve). None:
    the whole batch in one pass. Default None."""

    def check(self, view: NodeView) -> None:
        self._need(view, GenerateNode, "a rollout")
        self._need_kind(view, "policy")


class ValueNode(_NodeBase):
    """Per-token value estimates of the rollout from a value model (critic)."""

    role: Literal["value"] = "value"
    """Always ``value``."""
    split: ClassVar[Split] = "rows"
    timing_label: ClassVar[str] = "values"
    default_name: ClassVar[str] = "values"
    model: str
    """Name of the value model (kind value). Required."""
    micro_batch_tokens: PassTokens = None
    """Most padded tokens (rows x longest row) in one forward pass; rows are sorted by length,
    so little padding is computed. ``auto``: the largest pass that the planner's memory model
    fits on the node's devices beside everything else there (with the memory reserve). None:
    the whole batch in one pass. Default None."""

    def check(self, view: NodeView) -> None:
        self._need(view, GenerateNode, "a rollout")
        self._need_kind(view, "value")


ESTIMATOR_FIELDS: dict[str, tuple[str, ...]] = {
    "scale_by_std": ("grpo",),
    "epsilon": ("grpo",),
    "gamma": ("gae", "reinforce_pp"),
    "lam": ("gae",),
    "whiten": ("gae",),
}
"""An advantage node's field -> the estimators that read it (a value other than the default
for another estimator would be ignored: it is an error)."""


class AdvantageNode(_NodeBase):
    """Turn scores (and values) into per-token advantages."""

    role: Literal["advantage"] = "advantage"
    """Always ``advantage``."""
    timing_label: ClassVar[str] = "adv"
    default_name: ClassVar[str] = "adv"
    estimator: Literal["grpo", "gae", "rloo", "reinforce_pp"] = "grpo"
    """Advantage estimator. Default grpo."""
    scale_by_std: bool = True
    """Divide group-centred scores by the group's standard deviation (grpo). Default true."""
    epsilon: float = Field(default=1e-6, gt=0)
    """Added to the standard deviation before dividing, to avoid division by zero. Default 1e-6."""
    gamma: float = Field(default=1.0, ge=0, le=1)
    """Discount per token (gae, reinforce_pp). Default 1.0."""
    lam: float = Field(default=0.95, ge=0, le=1)
    """GAE lambda. Default 0.95."""
    whiten: bool = True
    """Whiten advantages over the batch's tokens (gae). Default true."""
    kl_coef: float = Field(default=0.0, ge=0)
    """KL to the reference as a per-token reward penalty with this coefficient (needs a
    reference_logprob input); 0 turns it off. Put KL either here or in the update, not both.
    Default 0.0."""
    kl_target: float | None = Field(default=None, gt=0)
    """With a target, the coefficient adapts (Ziegler et al.) to keep the per-sequence KL near
    it; None keeps kl_coef fixed. Default None."""
    kl_horizon: int = Field(default=10000, ge=1)
    """Adaptive KL horizon, in samples. Default 10000."""

    @property
    def work(self) -> Work:
        return "elementwise"

    def check(self, view: NodeView) -> None:
        path = f"nodes.{view.name}"
        if self.model is not None:
            view.add(f"{path}.model", "an advantage node runs no model; remove 'model'")
        self._need(view, ScoreNode, "scores")
        if view.reliable(f"{path}.estimator"):
            for field in sorted(self.changed_fields() & ESTIMATOR_FIELDS.keys()):
                readers = ESTIMATOR_FIELDS[field]
                if self.estimator not in readers:
                    view.add(f"{path}.{field}",
                             f"estimator {self.estimator} does not read '{field}' (only {' and '.join(readers)} "
                             f"{'does' if len(readers) == 1 else 'do'}); remove it, or choose "
                             f"{'that estimator' if len(readers) == 1 else 'one of them'}")
        if self.estimator == "gae" and view.reliable(f"{path}.estimator"):
            self._need(view, ValueNode, "values (gae)")
        if self.kl_coef > 0 and view.reliable(f"{path}.kl_coef") and not view.inputs_of(ReferenceLogprobNode):
            view.add(
                f"{path}.inputs",
                f"kl_coef is {self.kl_coef}, so the KL reward penalty needs reference log-probs: add a "
                "reference_logprob node to inputs (or set kl_coef: 0)",
            )
        if self.kl_coef == 0 and view.reliable(f"{path}.kl_coef"):
            for reference in view.inputs_of(ReferenceLogprobNode):
                view.add(
                    f"{path}.inputs",
                    f"kl_coef is 0, so the KL reward penalty is off and the reference log-probs of '{reference}' "
                    f"are never used here; set kl_coef > 0 or drop '{reference}' from inputs",
                )
            if self.kl_target is not None:
                view.add(f"{path}.kl_target",
                         "kl_target adapts kl_coef from its starting value, and kl_coef is 0, which stays 0; "
                         "set kl_coef > 0 (the starting coefficient) or remove kl_target")
        if self.kl_target is None and "kl_horizon" in self.changed_fields() and view.reliable(f"{path}.kl_target"):
            view.add(f"{path}.kl_horizon", "kl_horizon is read only by the adaptive KL controller, and kl_target is "
                                           "not set; set kl_target or remove kl_horizon")


UPDATE_FIELDS: dict[str, str] = {
    "clip_eps": "policy",
    "clip_eps_high": "policy",
    "entropy_coef": "policy",
    "mask_truncated_completions": "policy",
    "rollout_is_cap": "policy",
    "kl_coef": "policy",
    "kl_estimator": "policy",
    "clip_range_value": "value",
}
"""An update node's field -> the kind of model whose update reads it."""


class UpdateNode(_NodeBase):
    """One optimisation pass of a model on the rollout (policy gradient or value regression)."""

    role: Literal["update"] = "update"
    """Always ``update``."""
    split: ClassVar[Split] = "ranks"
    trains: ClassVar[bool] = True
    default_name: ClassVar[str] = "train"
    model: str
    """Name of the model trained. Required."""
    lr: float = Field(default=1e-5, gt=0)
    """AdamW learning rate (the peak, with a schedule). Default 1e-5."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """The rate after the warm-up: ``constant`` keeps ``lr``; ``linear`` and ``cosine`` decay it
    from ``lr`` towards ``min_lr_ratio`` x ``lr``, which the step after ``lr_decay_steps``
    reaches (so a run's last step still learns). Default constant."""
    lr_warmup_steps: int = Field(default=0, ge=0)
    """Training steps whose rate rises linearly towards ``lr``: step k of them trains at
    ``lr * k / (lr_warmup_steps + 1)``, and the step after them at ``lr``. Default 0."""
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    """Floor of a decaying schedule as a fraction of ``lr``. Default 0.0."""
    lr_decay_steps: Annotated[int, Field(ge=1)] | None = None
    """Steps a decaying schedule spans, from step 1 (warm-up included); None: ``trainer.steps``
    (a run resumed to more steps stretches the rest of its decay). Default None."""
    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of the KL penalty towards the reference; 0 turns it off. Default 0.0."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    """KL estimator (Schulman's k1 or k3). Default k3."""
    clip_eps: float = Field(default=0.2, gt=0)
    """PPO ratio clipping range epsilon: the ratio is clipped to [1 - clip_eps, 1 + clip_eps].
    Default 0.2."""
    clip_eps_high: float | None = Field(default=None, gt=0)
    """Upper clipping range, when it differs from the lower one (DAPO's clip-higher, such as
    0.28 with clip_eps 0.2): the ratio is clipped to [1 - clip_eps, 1 + clip_eps_high]. None:
    clip_eps. Default None."""
    entropy_coef: float = Field(default=0.0, ge=0)
    """Weight of the entropy bonus: the loss subtracts ``entropy_coef`` x the policy's entropy
    at the completion tokens, aggregated like the loss (``loss_agg``); 0 turns it off (the
    entropy is still logged as ``actor/entropy``). Policies only. Default 0.0."""
    mask_truncated_completions: bool = False
    """Leave completions cut at ``max_new_tokens`` (no stop token) out of the loss and its
    normaliser (DAPO's overlong filtering): their reward judged an unfinished answer. A
    mini-batch of only such completions makes no optimizer step. With ``loss_agg:
    token_sum_norm`` the constant normaliser stays (sequences x ``max_new_tokens``, the cut
    ones counted), as Dr. GRPO's constant is meant to. Policies only. Default false."""
    rollout_is_cap: float | None = Field(default=None, ge=1)
    """Truncated importance sampling between generation and training: each token's policy
    term is weighted by ``min(p_train / p_sample, rollout_is_cap)``, p_train the policy's
    probability of the token in the training forward before the update and p_sample the
    probability the generation engine sampled it with (their kernels round differently, and a
    bf16 decode drifts from the training pass); at least 1 (2 is usual), the mean weight is
    ``actor/rollout_is_weight``. None: off (the drift is still logged as
    ``actor/rollout_logprob_diff``). Policies only. Default None."""
    clip_range_value: float | None = Field(default=0.2, gt=0)
    """Value-update clipping around the old values (critics only); None turns it off. Default 0.2."""
    loss_agg: Literal["token_mean", "seq_mean", "token_sum_norm"] = "token_mean"
    """Average the loss over all tokens (``token_mean``), per sequence then over sequences
    (``seq_mean``), or sum it over all tokens and divide by sequences x ``max_new_tokens``
    (``token_sum_norm``: Dr. GRPO's constant normaliser). Default token_mean."""
    ppo_epochs: int = Field(default=1, ge=1)
    """Passes over the rollout per step. Default 1."""
    mini_batch_size: Annotated[int, Field(ge=1)] | None = None
    """Sequences per optimizer step; None uses the whole rollout. Default None."""
    micro_batch_tokens: PassTokens = None
    """Most padded tokens (rows x longest row) in one forward and backward pass; the gradients
    of a mini-batch's passes add up to the whole mini-batch's (gradient accumulation), rows
    sorted by length so little padding is computed. ``auto``: the largest pass that the
    planner's memory model fits on the node's devices beside everything else there (with the
    memory reserve). None: the whole mini-batch in one pass. Default None."""
    max_grad_norm: float = Field(default=1.0, ge=0)
    """Clip the gradient's global norm to this; 0 turns clipping off. Default 1.0."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW decoupled weight decay. Default 0.0."""
    betas: Annotated[tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]],
                     Field(strict=False)] = (  # a YAML list stands for the pair
        0.9,
        0.999,
    )
    """AdamW moment decay rates. Default (0.9, 0.999)."""

    @property
    def work(self) -> Work:
        return "train"

    @property
    def output(self) -> Output:
        return "none"

    def timing_name(self, model_kind: str | None) -> str:
        return "update_critic" if model_kind == "value" else "update_actor"

    def check(self, view: NodeView) -> None:
        path, kind = f"nodes.{view.name}", view.model_kind
        if self.lr_schedule == "constant" and view.reliable(f"{path}.lr_schedule"):
            for field in sorted(self.changed_fields() & {"min_lr_ratio", "lr_decay_steps"}):
                view.add(f"{path}.{field}", f"'{field}' shapes a decaying schedule, and lr_schedule is constant; "
                                            "set lr_schedule: cosine or linear, or remove it")
        if kind == "reward":
            view.add(f"{path}.model", f"update trains a policy or value model; '{self.model}' is kind reward")
            return
        rollouts = view.inputs_of(GenerateNode)
        if not rollouts:
            view.add(f"{path}.inputs", "update needs a rollout: add a generate node to inputs")
        advantages = view.inputs_of(AdvantageNode)
        if not advantages:
            view.add(f"{path}.inputs", "update needs advantages: add an advantage node to inputs")
        for score in view.inputs_of(ScoreNode):
            view.add(f"{path}.inputs", f"an update reads the rewards through its advantages, so score node "
                                       f"'{score}' in its inputs is never read; drop it from inputs")
        if kind == "value":
            for reference in view.inputs_of(ReferenceLogprobNode):
                view.add(f"{path}.inputs", f"a value model's update has no KL term, so reference '{reference}' in "
                                           "its inputs is never read; drop it from inputs")
            # a critic learns the returns, which only gae computes
            for advantage in advantages:
                estimator = getattr(view.node(advantage), "estimator", None)
                if estimator != "gae" and view.reliable(f"nodes.{advantage}.estimator"):
                    view.add(
                        f"{path}.inputs",
                        f"a value model's update learns returns, which advantage '{advantage}' computes only "
                        f"with estimator: gae (it has {estimator}); set estimator: gae there",
                    )
        if kind in ("policy", "value"):
            for field in sorted(self.changed_fields() & UPDATE_FIELDS.keys()):
                if UPDATE_FIELDS[field] != kind:
                    view.add(f"{path}.{field}",
                             f"'{field}' is read by updates of {UPDATE_FIELDS[field]} models only, and '{self.model}' "
                             f"is a {kind} model; remove it")
        if kind != "policy":
            return
        critic_of = next((name for name in view.inputs_of(ValueNode)
                          if getattr(view.node(name), "model", None) == self.model), None)
        if critic_of is not None:  # a critic whose model lacks kind: value
            view.add(f"{path}.model", f"update trains '{self.model}', which value node '{critic_of}' reads as a critic, "
                                      f"but '{self.model}' is kind policy: set models.{self.model}.kind: value")
            return
        for rollout in rollouts:
            source = view.node(rollout)
            source_model = source.model if source is not None else None
            if source_model != self.model:
                view.add(
                    f"{path}.model",
                    f"update trains '{self.model}' but its rollout '{rollout}' comes from "
                    f"'{source_model}'; a policy update trains the model that generated",
                )
        if not view.reliable(f"{path}.kl_coef"):
            return
        references = view.inputs_of(ReferenceLogprobNode)
        if self.kl_coef > 0 and not references:
            view.add(
                f"{path}.inputs",
                f"kl_coef is {self.kl_coef}, so update needs reference log-probs: add a "
                "reference_logprob node to inputs (or set kl_coef: 0)",
            )
        for reference in references if self.kl_coef == 0 else []:
            view.add(
                f"{path}.inputs",
                f"kl_coef is 0, so the reference is never used; set kl_coef > 0 or drop "
                f"'{reference}' from inputs",
            )


NodeSpec = Annotated[
    GenerateNode | ScoreNode | ReferenceLogprobNode | ValueNode | AdvantageNode | UpdateNode,
    Field(discriminator="role"),
]
"""A node of the iteration graph; ``role`` picks which fields it has."""

NODE_CLASSES: dict[str, type[_NodeBase]] = {
    cls.role_name(): cls
    for cls in (GenerateNode, ScoreNode, ReferenceLogprobNode, ValueNode, AdvantageNode, UpdateNode)
}
"""The spec class of each role, in the order an iteration usually runs them."""

ROLES: tuple[str, ...] = tuple(NODE_CLASSES)
"""Every node role."""

NodeBase = _NodeBase
"""The base of every node spec (the type of a node whatever its role)."""


SHARD_SIZE_PATTERN = r"^[1-9][0-9]*(KB|MB|GB|KiB|MiB|GiB)$"
"""A file size as transformers' ``max_shard_size`` takes it: ``500MB``, ``5GB``, ``2GiB``."""


class DataSpec(StrictModel):
    """Where prompts come from; its output is the node input ``prompts``."""

    source: str
    """A built-in task (``builtin:digits``, ``builtin:arith``), a local data file (``.parquet``,
    ``.jsonl``/``.json``, ``.csv``; relative to the pipeline file), a folder written by
    ``datasets``' ``save_to_disk``, or a hub dataset name (``org/name``). Required."""
    split: str = "train"
    """Split of the dataset to train on (a single data file is the split ``train``).
    Default train."""
    subset: str | None = None
    """Configuration of a hub dataset that has several (``main`` of ``openai/gsm8k``).
    Default None."""
    batch_size: int = Field(default=8, ge=1)
    """Prompts per step. Default 8."""
    shuffle: bool = True
    """Visit the prompts in a new seeded random order every epoch. Default true."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a string, or a chat (a list of ``{role, content}``
    messages, rendered with the policy tokenizer's chat template). Default prompt."""
    answer_key: str = "answer"
    """Column holding the reference answer, passed to reward functions as ``answer`` (and
    under its own name); the column may be absent. Default answer."""
    max_prompt_tokens: Annotated[int, Field(ge=1)] | None = None
    """Longest prompt, in tokens of the policy's tokenizer (after the chat template).
    None: no limit. Default None."""
    overlong_prompts: Literal["error", "truncate_left", "skip"] = "error"
    """What a prompt longer than max_prompt_tokens does: stop before step 1 naming it
    (``error``), keep its last max_prompt_tokens tokens (``truncate_left``), or leave it out
    of the data (``skip``). Without max_prompt_tokens the bound is the room the models leave
    a prompt (their positions less the completion's tokens). The log says how many were cut or left out; each step's metrics
    have ``data/prompts_truncated`` (in its batch) and ``data/prompts_skipped`` (in the
    dataset). Default error."""


class EvalSpec(StrictModel):
    """Held-out evaluation: generate for held-out prompts and score the completions,
    before training (``at_start``), every ``every_steps`` steps and after the last step.
    Results go to ``val/<score node>/mean`` (and ``pass@n``, ``mean@n`` with ``n`` > 1)."""

    source: str | None = None
    """Where the held-out prompts come from, as ``data.source``; None: the training
    source (with another ``split``). Default None."""
    split: str | None = None
    """Split of the source to evaluate on; None: ``test`` of a source with splits (a
    folder, a hub dataset, a built-in dataset), the whole file of a single data file.
    Default None."""
    subset: str | None = None
    """Configuration of a hub dataset; None: ``data.subset`` when the source is the
    training one. Default None."""
    prompt_key: str | None = None
    """Column of the held-out prompts; None: ``data.prompt_key``. Default None."""
    answer_key: str | None = None
    """Column of the held-out reference answers; None: ``data.answer_key``. Default None."""
    every_steps: int = Field(default=10, ge=1)
    """Evaluate after every this many steps (and after the last). Default 10."""
    at_start: bool = True
    """Evaluate before the first update (logged as step 0). Default true."""
    n: int = Field(default=1, ge=1)
    """Completions per prompt; with n > 1 pass@n (share of prompts with a completion
    scoring above 0) and mean@n are logged too. Default 1."""
    temperature: float = Field(default=0.0, ge=0)
    """Sampling temperature; 0 decodes greedily. Default 0."""
    max_new_tokens: Annotated[int, Field(ge=1)] | None = None
    """Most tokens per completion; None: the generate node's. Default None."""
    max_examples: Annotated[int, Field(ge=1)] | None = None
    """Evaluate on the first this many prompts of the split; None: all. Default None."""
    scores: list[str] | None = None
    """Score nodes to apply (a reward function, or a reward model on its own worker, to the
    held-out completions); None: every score node. Default None."""
    batch_size: int = Field(default=64, ge=1)
    """Prompts per generation call while evaluating (bounds memory). Default 64."""

    @model_validator(mode="after")
    def _samples_differ(self) -> EvalSpec:
        if self.temperature == 0 and self.n > 1:
            raise ValueError(f"at temperature 0 (greedy) the {self.n} completions per prompt of n: {self.n} are all "
                             "the same, so pass@n and mean@n say nothing more; set n: 1, or a temperature above 0")
        return self


class TrainerSpec(StrictModel):
    """How long to train and where to write."""

    steps: int = Field(default=100, ge=1)
    """Iterations to run. Default 100."""
    output_dir: str = Field(default="outputs/run", min_length=1)
    """Run folder (checkpoints, metrics, plans), relative to the working directory.
    Default outputs/run. Not empty: that would be the working directory itself, whose
    ``checkpoints/`` and ``final/`` an ``--overwrite`` deletes."""
    checkpoint_every: int = Field(default=0, ge=0)
    """Write a checkpoint every this many steps and at the last step; 0 writes none (the
    trained model is still saved in ``final/``, but the run cannot be resumed or extended).
    Default 0."""
    seed: int = Field(default=0, ge=0)
    """Seed of data order, sampling and initialisation. Default 0."""
    log_every: int = Field(default=1, ge=1)
    """Show a step's line in the terminal every this many steps (and the last step);
    ``metrics.jsonl`` keeps every step. Default 1."""
    log_samples: int = Field(default=4, ge=0)
    """Completions written to ``samples.jsonl`` at a logged step: the rollout's first rows,
    each with its prompt, reference answer, every score node's reward and the advantage; 0
    writes none. Default 4."""
    log_samples_every: int = Field(default=10, ge=1)
    """Write samples every this many steps (and at the last step). Default 10."""

    @model_validator(mode="after")
    def _samples_read(self) -> TrainerSpec:
        if self.log_samples == 0 and "log_samples_every" in self.changed_fields():
            raise ValueError("log_samples_every is read only when log_samples is above 0; remove it, or set "
                             "log_samples")
        return self
    keep_checkpoints: int = Field(default=2, ge=1)
    """Newest checkpoints kept on disk. Default 2."""
    torch_profile: Annotated[tuple[Annotated[int, Field(ge=1)], ...], Field(strict=False)] = ()  # a list stands for it
    """Steps whose node calls run under ``torch.profiler``: each call writes
    ``OUTPUT_DIR/torch_profile/step-N/NODE.trace.json`` (a Chrome trace: open it in
    https://ui.perfetto.dev) and ``NODE.txt`` (its operators and GPU kernels by their own
    time), on the machine of the worker that ran it. A profiled step is slower: its times are
    left out of the profiler's averages, the dynamic scheduler's measurements and the plan's
    measured and calibrated sections. Default none."""

    @model_validator(mode="after")
    def _profiled_steps_run(self) -> TrainerSpec:
        late = [step for step in self.torch_profile if step > self.steps]
        if late:
            raise ValueError(f"torch_profile names step {late[0]}, past the run's {self.steps} steps; name steps "
                             f"from 1 to {self.steps}")
        return self
    max_nonfinite_updates: int = Field(default=3, ge=1)
    """An update whose loss or gradient is NaN or infinite is skipped with a warning; this many
    in a row stop the run (the newest checkpoint stays). Default 3."""
    max_failed_reward_steps: int = Field(default=3, ge=1)
    """Steps in a row in which a reward function failed on every sample before the run
    stops with the function's first error (the newest checkpoint stays). Default 3."""
    max_shard_size: str = Field(default="5GB", pattern=SHARD_SIZE_PATTERN)
    """Largest weights file of a checkpoint or ``final/``; bigger models are split into
    several files with a ``model.safetensors.index.json``. Default 5GB."""
    loggers: Annotated[tuple[Literal["jsonl", "tensorboard", "wandb", "mlflow"], ...],
                       AfterValidator(_each_once), Field(strict=False)] = ("jsonl",)  # a list stands for it
    """Where every step's metrics, the resolved pipeline and the run's summary go besides
    ``metrics.jsonl`` (always written): ``tensorboard`` (``OUTPUT_DIR/tensorboard``),
    ``wandb`` (``OUTPUT_DIR/wandb``, offline without an API key), ``mlflow``
    (``MLFLOW_TRACKING_URI``, else ``OUTPUT_DIR/mlruns``). Each needs its package (the
    flowrl extra of the same name). Default [jsonl]."""


class SchedulerSettings(StrictModel):
    """The fields of the ``scheduler:`` section, with no check between them: the dynamic
    policy's own settings (``flowrl.scheduler.PolicySettings``) extend these, and are read
    where the simulator runs that policy beside a file's static one."""

    policy: Literal["static", "dynamic"] = "static"
    """static keeps the first plan; dynamic re-plans from measurements. Default static."""
    every_steps: int = Field(default=10, ge=1)
    """Every this many steps: re-plan if it pays (dynamic), re-balance the rows of nodes
    split over several devices, and print the profile's status line. Default 10."""
    low_util: float = Field(default=0.4, ge=0, le=1)
    """Utilization (0..1) below which a device counts as under-used. Default 0.4."""
    low_util_window_s: float = Field(default=30.0, gt=0)
    """How long a device must stay under-used before acting, in seconds. Default 30."""
    high_memory: float = Field(default=0.9, gt=0, le=1)
    """Memory share (0..1) above which a device counts as full. Default 0.9."""
    min_gain: float = Field(default=0.1, ge=0)
    """A move's predicted gain over the next every_steps steps must exceed its cost by this
    share (hysteresis). Default 0.1."""
    max_moves_per_replan: int = Field(default=4, ge=1)
    """Most models one re-plan may move (a lost device ignores it). Default 4."""


class SchedulerSpec(SchedulerSettings):
    """When the placement is reconsidered while running."""

    @model_validator(mode="after")
    def _dynamic_read(self) -> SchedulerSpec:
        read = [name for name in DYNAMIC_ONLY if name in self.changed_fields()]
        if self.policy == "static" and read:
            raise ValueError(f"{', '.join(read)} {'is' if len(read) == 1 else 'are'} read only by policy: dynamic "
                             "(static keeps the first plan); set policy: dynamic, or remove "
                             f"{'it' if len(read) == 1 else 'them'}")
        return self


DYNAMIC_ONLY = ("low_util", "low_util_window_s", "high_memory", "min_gain", "max_moves_per_replan")
"""The scheduler settings only the dynamic policy reads."""


class RuntimeSpec(StrictModel):
    """The Dask cluster the run uses."""

    cpu_slots: int = Field(default=2, ge=1)
    """CPU device slots (= Dask worker processes) on a CPU machine. Default 2."""
    scheduler_address: Annotated[str | None, BeforeValidator(check_scheduler_address)] = None
    """Existing Dask scheduler (``tcp://host:8786``, or ``tls://host:8786`` with the tls_*
    files); None starts a local cluster. Default None."""
    tls_ca_file: str | None = None
    """CA certificate that the scheduler's and workers' certificates must be signed by (joining
    a ``tls://`` scheduler); None uses Dask's own configuration. Default None."""
    tls_cert: str | None = None
    """This client's certificate (PEM) for a ``tls://`` scheduler. Default None."""
    tls_key: str | None = None
    """The private key of ``tls_cert`` (PEM). Default None."""
    torch_threads: Annotated[int, Field(ge=1)] | None = None
    """Torch threads per worker for the nodes that run a model; None uses all cores of the
    host (a step's nodes mostly run one after another). Nodes without a model (reward
    functions, advantages) run their torch operations on one thread: their tensors are small,
    and waking many threads for each operation costs more than it saves. Default None."""
    node_timeout_s: float = Field(default=600.0, gt=0)
    """Longest one node may run, in seconds; a node past it counts as a hung worker, which is
    restarted and the step run again. Default 600."""
    snapshot_every: Annotated[int, Field(ge=0)] | None = None
    """Steps between in-memory snapshots of the trained models (weights, optimizer, sampling
    RNG), kept by the driver. After a lost worker the run goes back to the newer of the newest
    snapshot and the newest checkpoint and runs the steps after it again; 0: back to the newest
    checkpoint always. None: when the trained models have at most 50 M parameters in all, one
    at the start and then about every 10 s of steps (longer for models above 8 M parameters,
    so that snapshots move at most 10 MB per second of training), following the measured step
    time; else 0. Default None."""
    max_recoveries: int = Field(default=3, ge=0)
    """Faults (lost or hung workers) a run survives within ``recovery_window_steps`` steps;
    one more stops it with a message naming its newest checkpoint (exit code 1). Default 3."""
    recovery_window_steps: int = Field(default=100, ge=1)
    """Faults count against ``max_recoveries`` while they lie within this many steps of
    each other, so a long run survives faults spread over it. Default 100."""
    standby_workers: int = Field(default=1, ge=0)
    """Warm spare workers a local cluster keeps per kind of slot (CPU, each GPU): imports
    done, no models. A spare takes a lost or hung worker's place at once, so a recovery does
    not wait for a new process to import torch. They start once the run has 30 s or more to
    go, or after a first fault (a short run would only lose the CPU they take). Default 1."""
    recovery_timeout_s: float = Field(default=120.0, gt=0)
    """How long to wait for a lost worker's replacement to register, in seconds. Default 120."""
    weight_sync: Literal["collective", "call"] = "collective"
    """How an update's new weights reach the model's copies on other workers (generation
    and reference copies), never through the driver: ``collective``, a broadcast over a
    process group of the trainer and those workers (NCCL between GPU workers, gloo on CPU; like
    a data-parallel group it needs a free TCP port between the workers); ``call``, the
    trainer's worker sends them to each in a Dask call (only Dask's own connections). Default
    collective: 6-9x faster than a call for a 0.4B model on CPU workers
    (``benchmarks/results/weight_sync.json``)."""
    dashboard: bool = False
    """Serve the Dask dashboard on 127.0.0.1:8787 (local cluster only). Default false."""
    prometheus_port: int | None = Field(default=None, ge=1, le=65535)
    """Serve ``/metrics`` for Prometheus on this port of the driver while the run goes: step
    time, reward, per-node seconds and tokens/s, per-device utilisation and memory, faults
    and moves. None serves nothing. Default None."""
    pin_cpus: bool = False
    """Pin each local CPU slot's worker to its own equal share of the cores, so that a slot
    is a fixed part of the machine (another busy process then slows one slot, not all).
    Default false: every worker may use every core."""


class ProfilerSpec(StrictModel):
    """How node calls and devices are measured while running."""

    ewma_window: int = Field(default=10, ge=1)
    """Steps the smoothed estimates average over (EWMA weight 2 / (window + 1)). Default 10."""
    sample_interval_s: float = Field(default=0.5, gt=0)
    """Seconds between two samples of a device's utilisation and memory. Default 0.5."""


class PipelineSpec(StrictModel):
    """A whole pipeline: models, device groups, one iteration's nodes, data and run settings."""

    name: str = Field(min_length=1)
    """Name of the pipeline, shown in logs. Required."""
    models: dict[str, ModelSpec]
    """Every model a node uses, by name. Required."""
    devices: dict[str, DeviceGroupSpec] = {}
    """Logical device groups, by name. Default {}."""
    nodes: dict[str, NodeSpec]
    """The dataflow of one iteration, by node name, in file order. Required."""
    data: DataSpec
    """The prompt source. Required."""
    eval: EvalSpec | None = None
    """Held-out evaluation; None: none. Default None."""
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    """Steps, output folder, checkpoints, seed. Default TrainerSpec()."""
    scheduler: SchedulerSpec = Field(default_factory=SchedulerSpec)
    """Re-planning policy. Default SchedulerSpec()."""
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)
    """Cluster settings. Default RuntimeSpec()."""
    profiler: ProfilerSpec = Field(default_factory=ProfilerSpec)
    """Measuring settings. Default ProfilerSpec()."""


SECTION_CLASSES: dict[str, type[BaseModel]] = {
    "models": ModelSpec,
    "devices": DeviceGroupSpec,
    "data": DataSpec,
    "eval": EvalSpec,
    "trainer": TrainerSpec,
    "scheduler": SchedulerSpec,
    "runtime": RuntimeSpec,
    "profiler": ProfilerSpec,
}
"""Schema class of each top-level section (for models/devices: of each entry)."""


def eval_score_nodes(spec: PipelineSpec) -> dict[str, ScoreNode]:
    """The score nodes an evaluation scores with: ``eval.scores``, else every one (a reward
    function's or a reward model's)."""
    score_nodes = {name: item for name, item in spec.nodes.items() if isinstance(item, ScoreNode)}
    if spec.eval is None:
        return {}
    wanted = spec.eval.scores or list(score_nodes)
    return {name: score_nodes[name] for name in wanted}
