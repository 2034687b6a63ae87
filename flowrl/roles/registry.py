"""Every role's run-time half, behind one protocol, by name.

What a role *is* (its typed node spec, what it reads, how it splits over devices, whether it
trains, the work the planner prices) is its spec class in ``flowrl.spec.schema``, which every
layer can read without torch. Here is how it runs on a worker: one node call from its inputs
(``run``) and, for a node split over devices, how the parts become one output (``join``). The
host only moves data and state: it fetches a call's inputs, asks this registry for the role,
and runs it on its compute thread.

    host: inputs by producer role -> ROLES[call.role].run(context, inputs, call) -> NodeOutput
          split node, shard 0: ROLES[call.role].join(parts, rollout, spec) -> whole output
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch

from flowrl.rewards import RewardCache
from flowrl.roles.advantage import run_advantage
from flowrl.roles.batch import Advantages, NodeOutput, Rollout, Scores
from flowrl.roles.data_parallel import DataParallel
from flowrl.roles.generate import rollout_metrics, run_generate
from flowrl.roles.reference import run_reference_logprob
from flowrl.roles.reward_model import run_reward_model
from flowrl.roles.score import run_score, score_metrics
from flowrl.roles.shards import join_rollouts
from flowrl.roles.state import ModelState
from flowrl.roles.update import update_critic, update_policy
from flowrl.roles.value import run_value, value_metrics
from flowrl.spec.schema import (
    AdvantageNode,
    GenerateNode,
    NodeBase,
    ReferenceLogprobNode,
    ScoreNode,
    UpdateNode,
    ValueNode,
    pass_tokens,
)

SpecT = TypeVar("SpecT", bound=NodeBase)


@dataclass(frozen=True)
class RoleCall(Generic[SpecT]):
    """What a role needs of one node call (the runtime's ``NodeCall`` carries more)."""

    node: str
    spec: SpecT
    prompts: tuple[Any, ...]
    group_size: int
    kl_coef: float
    lr: float | None = None
    """Update nodes: this step's learning rate (the node's schedule); None: the node's ``lr``."""


@dataclass(frozen=True)
class RoleContext:
    """The worker's side of a call: its models, reward functions and process group."""

    models: Mapping[str, ModelState]
    rewards: RewardCache
    """A score node's ``fn`` -> the callable (resolved once per worker)."""
    seed: int
    group: DataParallel | None = None
    """The data-parallel group of a split update; None on one worker."""

    def model(self, call: RoleCall[Any]) -> ModelState:
        name = call.spec.model
        if name is None:
            raise ValueError(f"node '{call.node}' names no model")
        return self.models[name]


Inputs = Mapping[str, list[Any]]
"""A call's inputs by the role of their producer (``generate`` -> [rollout])."""


class Role(Protocol):
    name: str

    def run(self, context: RoleContext, inputs: Inputs, call: RoleCall[Any]) -> NodeOutput: ...

    def join(self, parts: list[Any], rollout: Rollout | None, spec: Any) -> tuple[Any, dict[str, float]]:
        """The output of a node split over devices from its parts (in row order; parts that
        got no rows left out), with its whole-batch metrics."""
        ...


def _rollout(inputs: Inputs) -> Rollout:
    rollout: Rollout = inputs[GenerateNode.role_name()][0]
    return rollout


def _optional(inputs: Inputs, role: type[NodeBase]) -> Any:
    return inputs.get(role.role_name(), [None])[0]


class _Unsplit:
    def join(self, parts: list[Any], rollout: Rollout | None, spec: Any) -> tuple[Any, dict[str, float]]:
        raise ValueError(f"'{getattr(self, 'name')}' nodes are not split by rows over devices")


class Generate:
    name = GenerateNode.role_name()

    def run(self, context: RoleContext, inputs: Inputs, call: RoleCall[GenerateNode]) -> NodeOutput:
        return run_generate(context.model(call), call.prompts, call.spec)

    def join(self, parts: list[Any], rollout: Rollout | None, spec: GenerateNode) -> tuple[Any, dict[str, float]]:
        joined = join_rollouts(parts)
        return joined, rollout_metrics(joined)


class Score:
    name = ScoreNode.role_name()

    def run(self, context: RoleContext, inputs: Inputs, call: RoleCall[ScoreNode]) -> NodeOutput:
        spec, rollout = call.spec, _rollout(inputs)
        if spec.model is not None:
            return run_reward_model(context.model(call), rollout, spec.weight, pass_tokens(spec.micro_batch_tokens),
                                    spec.retokenize)
        assert spec.fn is not None  # the schema wants fn or model
        return run_score(rollout, context.rewards.get(spec.fn), spec.weight, spec.on_error, spec.fn_name, spec.params)

    def join(self, parts: list[Any], rollout: Rollout | None, spec: ScoreNode) -> tuple[Any, dict[str, float]]:
        scores = Scores(
            torch.cat([part.values for part in parts]),
            sum(part.num_failed for part in parts),
            sum(part.num_none for part in parts),
            next((part.first_error for part in parts if part.first_error), None),
            next((part.batch_error for part in parts if part.batch_error), None),
        )
        return scores, score_metrics(scores, spec.fn is not None)


class ReferenceLogprob:
    name = ReferenceLogprobNode.role_name()

    def run(self, context: RoleContext, inputs: Inputs, call: RoleCall[ReferenceLogprobNode]) -> NodeOutput:
        return run_reference_logprob(context.model(call), _rollout(inputs), pass_tokens(call.spec.micro_batch_tokens))

    def join(self, parts: list[Any], rollout: Rollout | None, spec: Any) -> tuple[Any, dict[str, float]]:
        return torch.cat(parts), {}


class Value:
    name = ValueNode.role_name()

    def run(self, context: RoleContext, inputs: Inputs, call: RoleCall[ValueNode]) -> NodeOutput:
        return run_value(context.model(call), _rollout(inputs), pass_tokens(call.spec.micro_batch_tokens))

    def join(self, parts: list[Any], rollout: Rollout | None, spec: Any) -> tuple[Any, dict[str, float]]:
        assert rollout is not None
        values = torch.cat(parts)
        return values, value_metrics(values, rollout)


class Advantage(_Unsplit):
    name = AdvantageNode.role_name()

    def run(self, context: RoleContext, inputs: Inputs, call: RoleCall[AdvantageNode]) -> NodeOutput:
        rollout = _rollout(inputs)
        return run_advantage(
            inputs[ScoreNode.role_name()],
            _optional(inputs, ValueNode),
            _optional(inputs, ReferenceLogprobNode),
            rollout.sampled_logprobs,
            rollout.completion_mask,
            call.group_size,
            call.spec,
            kl_coef=call.kl_coef,
        )


class Update(_Unsplit):
    """A policy follows the advantages; a value model learns the returns. Both through one optimizer loop (``roles.update``)."""

    name = UpdateNode.role_name()

    def run(self, context: RoleContext, inputs: Inputs, call: RoleCall[UpdateNode]) -> NodeOutput:
        state, rollout = context.model(call), _rollout(inputs)
        advantage: Advantages = inputs[AdvantageNode.role_name()][0]
        if state.kind == "value":
            if advantage.returns is None:
                raise ValueError(f"critic update '{call.node}' needs returns: its advantage node must use estimator gae")
            return update_critic(state, rollout, advantage.returns, _optional(inputs, ValueNode), call.spec,
                                 context.seed, context.group, call.lr)
        return update_policy(state, rollout, advantage.advantages, _optional(inputs, ReferenceLogprobNode), call.spec,
                             context.seed, context.group, call.lr)


ROLES: dict[str, Role] = {role.name: role for role in (Generate(), Score(), ReferenceLogprob(), Value(), Advantage(), Update())}


def role(name: str) -> Role:
    found = ROLES.get(name)
    if found is None:
        raise ValueError(f"role {name!r} cannot run on a host (roles: {', '.join(ROLES)})")
    return found
