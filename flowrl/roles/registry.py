"""Every role, behind one protocol, by name.

A role says what it reads (the roles of its producers), whether it can be split by rows over
several workers, whether it trains a model (the runtime then pushes the new weights to the
model's other copies), and how it runs one node call. The host only moves data and state: it
fetches a call's inputs, asks the registry for the role, and runs it on its compute thread.

    host: inputs by producer role -> ROLES[call.role].run(context, inputs, call) -> NodeOutput
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from flowrl.backends.value_model import ScalarHeadModel
from flowrl.roles.advantage import run_advantage
from flowrl.roles.batch import NodeOutput
from flowrl.roles.critic_update import run_critic_update
from flowrl.roles.data_parallel import DataParallel
from flowrl.roles.generate import run_generate
from flowrl.roles.ppo_advantage import run_ppo_advantage
from flowrl.roles.ppo_batch import PPOAdvantages
from flowrl.roles.reference import run_reference_logprob
from flowrl.roles.reward_model import run_reward_model
from flowrl.roles.score import run_score
from flowrl.roles.state import ModelState
from flowrl.roles.update import run_update
from flowrl.roles.value import run_value


@dataclass(frozen=True)
class RoleCall:
    """What a role needs of one node call (the runtime's ``NodeCall`` carries more)."""

    node: str
    spec: Any
    model: str | None
    prompts: tuple[Any, ...]
    group_size: int
    kl_coef: float


@dataclass(frozen=True)
class RoleContext:
    """The worker's side of a call: its models, reward functions and process group."""

    models: Mapping[str, ModelState]
    reward: Callable[[Any], Callable[..., Any]]
    """A score node's ``fn`` -> the callable (resolved once per worker)."""
    seed: int
    group: DataParallel | None = None
    """The data-parallel group of a split update; None on one worker."""

    def model(self, call: RoleCall) -> ModelState:
        if call.model is None:
            raise ValueError(f"node '{call.node}' names no model")
        return self.models[call.model]


Inputs = Mapping[str, list[Any]]
"""A call's inputs by the role of their producer (``generate`` -> [rollout])."""


class Role(Protocol):
    name: str
    trains: bool
    """Its calls change a model's weights (the runtime then pushes them to other copies)."""

    def run(self, context: RoleContext, inputs: Inputs, call: RoleCall) -> NodeOutput: ...


class Generate:
    name, trains = "generate", False

    def run(self, context: RoleContext, inputs: Inputs, call: RoleCall) -> NodeOutput:
        return run_generate(context.model(call), call.prompts, call.spec)


class Score:
    name, trains = "score", False

    def run(self, context: RoleContext, inputs: Inputs, call: RoleCall) -> NodeOutput:
        spec, rollout = call.spec, inputs["generate"][0]
        if spec.model is not None:
            return run_reward_model(context.models[spec.model], rollout, spec.weight)
        return run_score(rollout, context.reward(spec.fn), spec.weight, spec.on_error, spec.fn_name, spec.params)


class ReferenceLogprob:
    name, trains = "reference_logprob", False

    def run(self, context: RoleContext, inputs: Inputs, call: RoleCall) -> NodeOutput:
        return run_reference_logprob(context.model(call), inputs["generate"][0], call.spec.micro_batch_tokens)


class Value:
    name, trains = "value", False

    def run(self, context: RoleContext, inputs: Inputs, call: RoleCall) -> NodeOutput:
        return run_value(context.model(call), inputs["generate"][0], call.spec.micro_batch_tokens)


class Advantage:
    name, trains = "advantage", False

    def run(self, context: RoleContext, inputs: Inputs, call: RoleCall) -> NodeOutput:
        spec = call.spec
        if spec.estimator == "grpo" and call.kl_coef == 0:
            return run_advantage(inputs["score"], call.group_size, spec)
        rollout = inputs["generate"][0]
        return run_ppo_advantage(
            inputs["score"],
            inputs.get("value", [None])[0],
            inputs.get("reference_logprob", [None])[0],
            rollout.sampled_logprobs,
            rollout.completion_mask,
            call.group_size,
            spec,
            kl_coef_for_reward=call.kl_coef,
        )


class Update:
    name, trains = "update", True

    def run(self, context: RoleContext, inputs: Inputs, call: RoleCall) -> NodeOutput:
        state, rollout, advantage = context.model(call), inputs["generate"][0], inputs["advantage"][0]
        if isinstance(state.module, ScalarHeadModel):
            if not isinstance(advantage, PPOAdvantages) or advantage.returns is None:
                raise ValueError(f"critic update '{call.node}' needs returns: its advantage node must use estimator gae")
            return run_critic_update(state, rollout, advantage.returns, inputs.get("value", [None])[0], call.spec,
                                     context.seed)
        advantages = advantage.advantages if isinstance(advantage, PPOAdvantages) else advantage
        reference = inputs.get("reference_logprob", [None])[0]
        return run_update(state, rollout, advantages, reference, call.spec, context.seed, context.group)


ROLES: dict[str, Role] = {role.name: role for role in (Generate(), Score(), ReferenceLogprob(), Value(), Advantage(), Update())}


def role(name: str) -> Role:
    found = ROLES.get(name)
    if found is None:
        raise ValueError(f"role {name!r} cannot run on a host (roles: {', '.join(ROLES)})")
    return found
