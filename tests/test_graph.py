"""PipelineGraph: graph rules, deterministic order, immutability, equality."""

from __future__ import annotations

import copy
import re
from typing import Any

import networkx as nx
import pytest

from flowrl.errors import SpecError
from flowrl.graph import PipelineGraph, find_graph_issues
from flowrl.spec.loader import pipeline_from_dict
from flowrl.spec.schema import PipelineSpec, UpdateNode


def grpo() -> dict[str, Any]:
    """A valid GRPO pipeline with a KL reference; tests change one thing at a time."""
    return {
        "name": "grpo",
        "models": {
            "actor": {"path": "builtin:tiny-llama", "device_group": "actor_group"},
            "reference": {"path": "builtin:tiny-llama"},
        },
        "devices": {"actor_group": {"type": "cpu"}},
        "nodes": {
            "rollout": {"role": "generate", "model": "actor", "inputs": ["prompts"]},
            "ref": {"role": "reference_logprob", "model": "reference", "inputs": ["rollout"]},
            "reward": {"role": "score", "fn": "digits", "inputs": ["rollout"]},
            "adv": {"role": "advantage", "inputs": ["reward"]},
            "train": {
                "role": "update",
                "model": "actor",
                "inputs": ["rollout", "adv", "ref"],
                "kl_coef": 0.02,
            },
        },
        "data": {"source": "builtin:digits"},
    }


def issues(data: dict[str, Any]) -> list[str]:
    """Graph issues as `path: message`, straight from the rules (no schema step)."""
    return [
        f"{path}: {message}"
        for path, message in find_graph_issues(PipelineSpec.model_validate(data))
    ]


def test_valid_pipeline_builds() -> None:
    graph = PipelineGraph(PipelineSpec.model_validate(grpo()))
    assert graph.name == "grpo"
    # ref and reward both only need rollout; the tie keeps file order (ref is written first)
    assert graph.topological_order() == ["rollout", "ref", "reward", "adv", "train"]
    assert graph.producers("train") == ["rollout", "adv", "ref"]
    assert graph.producers("rollout") == ["prompts"]
    assert graph.producers("prompts") == []
    # adv reads the rollout (mask, sampling log-probs) without listing it: an implicit edge
    assert graph.consumers("rollout") == ["ref", "reward", "adv", "train"]
    assert graph.producers("adv")[-1] == "rollout" and "rollout" not in graph.spec.nodes["adv"].inputs
    assert graph.graph.edges["rollout", "adv"]["implicit"] is True
    assert graph.rollout_of("adv") == "rollout" and graph.rollout_of("rollout") == "rollout"
    assert graph.nodes_of(UpdateNode) == ["train"]
    assert graph.graph.nodes["prompts"]["role"] == "source"
    assert graph.graph.nodes["adv"]["role"] == "advantage"
    assert set(graph.graph.edges) == {
        ("prompts", "rollout"),
        ("rollout", "ref"),
        ("rollout", "reward"),
        ("rollout", "train"),
        ("reward", "adv"),
        ("rollout", "adv"),
        ("adv", "train"),
        ("ref", "train"),
    }


def test_order_follows_declaration_when_file_order_changes() -> None:
    data = grpo()
    nodes = data["nodes"]
    data["nodes"] = {name: nodes[name] for name in ["train", "adv", "reward", "ref", "rollout"]}
    graph = pipeline_from_dict(data)
    # declared order is now train, adv, reward, ref, rollout. After rollout, ref and reward
    # are ready and reward is declared first; then adv (ready) is declared before ref.
    assert graph.topological_order() == ["rollout", "reward", "adv", "ref", "train"]


def test_graph_is_immutable() -> None:
    graph = pipeline_from_dict(grpo())
    with pytest.raises(nx.NetworkXError):
        graph.graph.add_node("extra")
    with pytest.raises(AttributeError):
        graph.extra = 1  # type: ignore[attr-defined]
    order = graph.topological_order()
    order.append("x")
    assert "x" not in graph.topological_order()


def test_equality_and_round_trip() -> None:
    first = pipeline_from_dict(grpo())
    again = pipeline_from_dict(first.to_dict())
    assert again == first
    changed = grpo()
    changed["nodes"]["rollout"]["n"] = 4
    assert pipeline_from_dict(changed) != first
    assert first.to_dict()["nodes"]["train"]["betas"] == [0.9, 0.999]


def test_constructor_raises_without_lines() -> None:
    data = grpo()
    data["nodes"]["train"]["inputs"] = ["adv", "ref"]
    with pytest.raises(SpecError) as caught:
        PipelineGraph(PipelineSpec.model_validate(data))
    (issue,) = caught.value.issues
    assert issue.line is None and issue.file is None
    assert str(issue) == "nodes.train.inputs: update needs a rollout: add a generate node to inputs"


def changed(edit: Any) -> dict[str, Any]:
    data = copy.deepcopy(grpo())
    edit(data)
    return data


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            lambda d: d["nodes"]["train"]["inputs"].remove("adv"),
            ["nodes.train.inputs: update needs advantages: add an advantage node to inputs"],
        ),
        (
            lambda d: d["nodes"]["adv"].update(inputs=["rollout"]),
            ["nodes.adv.inputs: advantage needs scores: add a score node to inputs"],
        ),
        (
            lambda d: d["nodes"]["rollout"].update(inputs=[]),
            ["nodes.rollout.inputs: generate needs the prompts: add 'prompts' to inputs"],
        ),
        (
            lambda d: d["nodes"]["reward"].update(inputs=["prompts"]),
            ["nodes.reward.inputs: score needs a rollout: add a generate node to inputs"],
        ),
        (
            lambda d: d["nodes"]["ref"].update(inputs=["prompts"]),
            ["nodes.ref.inputs: reference_logprob needs a rollout: add a generate node to inputs"],
        ),
        (
            lambda d: d["nodes"]["train"]["inputs"].remove("ref"),
            [
                "nodes.train.inputs: kl_coef is 0.02, so update needs reference log-probs: "
                "add a reference_logprob node to inputs (or set kl_coef: 0)"
            ],
        ),
        (
            lambda d: d["nodes"]["train"].update(kl_coef=0),
            [
                "nodes.train.inputs: kl_coef is 0, so the reference is never used; "
                "set kl_coef > 0 or drop 'ref' from inputs"
            ],
        ),
        (
            lambda d: d["nodes"]["train"].update(model="reference"),
            [
                "nodes.train.model: update trains 'reference' but its rollout 'rollout' comes "
                "from 'actor'; a policy update trains the model that generated",
            ],
        ),
        (
            # rollout -> reward -> adv -> train -> rollout is a longer loop in the same group;
            # only the shortest one is shown
            lambda d: d["nodes"]["rollout"]["inputs"].append("train"),
            [
                "nodes.rollout.inputs: generate reads only 'prompts'; drop 'train'",
                "nodes.rollout.inputs: cycle rollout -> train -> rollout; one iteration must "
                "flow one way",
            ],
        ),
        (
            lambda d: d["nodes"]["adv"]["inputs"].append("adv"),
            ["nodes.adv.inputs: 'adv' reads its own output; drop 'adv' from inputs"],
        ),
        (
            lambda d: d["nodes"]["adv"]["inputs"].append("reward"),
            ["nodes.adv.inputs: 'reward' is listed twice"],
        ),
        (
            lambda d: d["nodes"]["adv"]["inputs"].append("rewards"),
            [
                "nodes.adv.inputs: no node 'rewards' (did you mean 'reward'?); inputs name other "
                "nodes or 'prompts'"
            ],
        ),
        (
            lambda d: d["nodes"]["adv"].update(model="actor"),
            ["nodes.adv.model: an advantage node runs no model; remove 'model'"],
        ),
        (
            lambda d: d["nodes"]["adv"].update(device_group="big_box"),
            ["nodes.adv.device_group: no device group 'big_box'; declared groups: actor_group"],
        ),
        (
            lambda d: d["models"]["actor"].update(device_group="Actor_Group"),
            [
                "models.actor.device_group: no device group 'Actor_Group' (did you mean "
                "'actor_group'?)",
                "devices.actor_group: no model or node uses device group 'actor_group'; remove it",
            ],
        ),
        (
            lambda d: d.pop("devices"),
            ["models.actor.device_group: no device group 'actor_group'; declare it under devices:"],
        ),
        (
            lambda d: d["models"]["reference"].update(kind="reward"),
            ["nodes.ref.model: reference_logprob needs a policy model; 'reference' is kind reward "
             "(set models.reference.kind: policy if it is one)"],
        ),
        (
            lambda d: d["nodes"]["ref"].update(model="referense"),
            [
                "nodes.ref.model: no model 'referense' (did you mean 'reference'?)",
                "models.reference: no node uses model 'reference'; remove it or use it in a node",
            ],
        ),
        (
            lambda d: d["nodes"].update(Train2=d["nodes"].pop("train")),
            [
                "nodes.Train2: names are lower_snake_case (a-z, digits, _; starting with a "
                "letter), "
                "found 'Train2'; try 'train2'"
            ],
        ),
        (
            lambda d: (
                d["nodes"].update(prompts=d["nodes"].pop("ref"))
                # `prompts` in an input list always means the data source, never this node
                or d["nodes"]["train"].update(inputs=["rollout", "adv", "prompts"], kl_coef=0)
            ),
            ["nodes.prompts: 'prompts' is the data source's output; give the node another name"],
        ),
    ],
)
def test_graph_rules(edit: Any, expected: list[str]) -> None:
    assert issues(changed(edit)) == expected


def ppo() -> dict[str, Any]:
    return {
        "name": "ppo",
        "models": {
            "actor": {"path": "builtin:tiny-llama"},
            "critic": {"path": "builtin:tiny-llama", "kind": "value"},
            "rm": {"path": "builtin:tiny-rm", "kind": "reward"},
        },
        "nodes": {
            "rollout": {"role": "generate", "model": "actor", "inputs": ["prompts"]},
            "reward": {"role": "score", "model": "rm", "inputs": ["rollout"]},
            "values": {"role": "value", "model": "critic", "inputs": ["rollout"]},
            "adv": {"role": "advantage", "estimator": "gae", "inputs": ["reward", "values"]},
            "train_actor": {"role": "update", "model": "actor", "inputs": ["rollout", "adv"]},
            "train_critic": {"role": "update", "model": "critic", "inputs": ["rollout", "adv"]},
        },
        "data": {"source": "builtin:digits"},
    }


def test_ppo_graph_is_valid() -> None:
    graph = pipeline_from_dict(ppo())
    assert graph.nodes_of(UpdateNode) == ["train_actor", "train_critic"]
    assert graph.topological_order()[-2:] == ["train_actor", "train_critic"]


def test_ppo_rules() -> None:
    data = ppo()
    data["nodes"]["adv"]["inputs"] = ["reward"]
    data["nodes"]["train_critic"]["inputs"] = ["adv"]
    data["nodes"]["values"]["model"] = "actor"
    data["nodes"]["reward"]["model"] = "critic"
    assert issues(data) == [
        "nodes.reward.model: score needs a reward model; 'critic' is kind value (set models.critic.kind: reward if it is one)",
        "nodes.values.model: value needs a value model; 'actor' is kind policy (set models.actor.kind: value if it is one)",
        "nodes.adv.inputs: advantage needs values (gae): add a value node to inputs",
        "nodes.train_critic.inputs: update needs a rollout: add a generate node to inputs",
        "models.rm: no node uses model 'rm'; remove it or use it in a node",
    ]


def test_a_critic_without_kind_value_is_told_to_set_it() -> None:
    data = ppo()
    del data["models"]["critic"]["kind"]
    data["nodes"]["train_critic"]["inputs"] = ["rollout", "adv", "values"]
    assert issues(data) == [
        "nodes.values.model: value needs a value model; 'critic' is kind policy (set models.critic.kind: value if it is one)",
        "nodes.train_critic.model: update trains 'critic', which value node 'values' reads as a critic, but 'critic' "
        "is kind policy: set models.critic.kind: value",
    ]


def test_update_of_a_reward_model_is_refused() -> None:
    data = ppo()
    data["nodes"]["train_critic"]["model"] = "rm"
    assert (
        "nodes.train_critic.model: update trains a policy or value model; 'rm' is kind reward"
        in issues(data)
    )


def test_a_reward_model_named_as_a_function_says_to_write_model() -> None:
    data = ppo()
    data["nodes"]["reward"] = {"role": "score", "fn": "rm", "inputs": ["rollout"]}
    assert issues(data) == [
        "nodes.reward.fn: 'rm' is read as a reward function's name, and it is a model of this pipeline: to score "
        "with the model, write model: rm instead of fn: rm",
    ]


def test_a_pipeline_without_an_update_node_is_refused() -> None:
    # it would generate and score every step, train nothing and have no model to save
    data = grpo()
    del data["nodes"]["train"]
    assert issues(data) == [
        "nodes: a pipeline needs an update node: without one nothing is trained; add one (role: update) that trains "
        "the generating model on the rollout and its advantages",
    ]


def test_a_second_update_of_one_model_is_refused() -> None:
    # it would train the model twice on the rollout, and its numbers would overwrite the first's
    data = grpo()
    data["nodes"]["train_again"] = dict(data["nodes"]["train"], lr=1e-2)
    assert issues(data) == [
        "nodes.train_again.model: update node 'train' trains 'actor' already, and a model has one update node; "
        "remove 'train_again', or give it more passes over the rollout with ppo_epochs on 'train'",
    ]


def test_pipeline_without_generate() -> None:
    data = grpo()
    data["nodes"] = {"adv": {"role": "advantage", "inputs": []}}
    data["models"] = {}
    data["devices"] = {}
    assert issues(data) == [
        "nodes.adv.inputs: advantage needs scores: add a score node to inputs",
        "nodes: a pipeline needs a generate node to produce rollouts",
    ]


def test_a_critic_trained_on_advantages_without_returns_is_refused_by_validation() -> None:
    data = ppo()
    data["nodes"]["adv"]["estimator"] = "grpo"
    data["nodes"]["adv"]["inputs"] = ["reward"]
    assert issues(data) == [
        "nodes.train_critic.inputs: a value model's update learns returns, which advantage 'adv' computes "
        "only with estimator: gae (it has grpo); set estimator: gae there",
    ]


def test_a_node_s_rollout_is_the_generate_node_it_lists_first() -> None:
    data = grpo()
    # a second generate node, earlier in the file, and a score node that lists both rollouts
    data["nodes"] = {
        "probe": {"role": "generate", "model": "reference", "inputs": ["prompts"]},
        **data["nodes"],
        "both": {"role": "score", "fn": "digits", "inputs": ["rollout", "probe"]},
    }
    graph = pipeline_from_dict(data)
    # the executor splits this input by rows and the role reads it: they must agree
    assert graph.rollout_of("both") == "rollout"
    assert graph.rollout_of("probe") == "probe" and graph.rollout_of("adv") == "rollout"
    assert graph.producers("adv") == ["reward", "rollout"]


def test_adapters_on_the_trained_policy_are_valid() -> None:
    data = grpo()
    data["models"]["actor"]["lora"] = {"rank": 8, "target_modules": ["q_proj", "v_proj"]}
    assert issues(data) == []
    assert pipeline_from_dict(data).spec.models["actor"].lora is not None


def test_a_reference_of_the_trained_policy_needs_its_adapters() -> None:
    """Without adapters the trained policy's log-probs are its own (a KL to itself); with them
    the reference is its frozen weights, and the separate reference model can go."""
    data = grpo()
    data["nodes"]["ref"]["model"] = "actor"
    del data["models"]["reference"]
    assert issues(data) == [
        "nodes.ref.model: update node 'train' trains 'actor', so its log-probs are the policy's own, not a "
        "reference's; give the reference a model of its own (the same path, not trained), or train 'actor' with "
        "lora: its reference is then its frozen weights under the adapters"]
    data["models"]["actor"]["lora"] = {"rank": 8}
    assert issues(data) == []


@pytest.mark.parametrize(
    ("pipeline", "edit", "expected"),
    [
        (
            # a reference is never trained: its adapters would stay zero
            grpo, lambda d: d["models"]["reference"].update(lora={"rank": 8}),
            "models.reference.lora: no update node trains 'reference', so its adapters would stay zero; remove "
            "lora, or train the model",
        ),
        (
            ppo, lambda d: d["models"]["critic"].update(lora={}),
            "models.critic.lora: 'critic' is a value model, and adapters are trained on policies only; remove lora "
            "from it",
        ),
        (
            grpo, lambda d: d["models"]["actor"].update(lora={}, sharded=True),
            "models.actor.lora: 'actor' also trains sharded, and adapters train on whole copies (their gradients "
            "and optimizer state are small); set sharded: false, or remove lora",
        ),
    ],
)
def test_adapters_only_on_a_policy_an_update_trains_on_whole_copies(pipeline: Any, edit: Any, expected: str) -> None:
    data = pipeline()
    edit(data)
    assert issues(data) == [expected]
    with pytest.raises(SpecError, match=re.escape(expected.split(":")[0])):
        pipeline_from_dict(data)


def test_a_trained_model_named_like_the_adapter_folder_is_refused_beside_adapters() -> None:
    """final/adapter/ holds the policy's adapters; a trained critic's final weights would go
    to final/adapter/ too, and the end of the run could not write them."""
    data = ppo()
    data["models"]["actor"]["lora"] = {"rank": 8}
    data["models"]["adapter"] = data["models"].pop("critic")
    data["nodes"]["values"]["model"] = data["nodes"]["train_critic"]["model"] = "adapter"
    assert issues(data) == [
        "models.adapter: final/adapter/ holds the adapters of 'actor', and a trained model's final weights go to "
        "final/<name>/; give this model another name"]


def test_the_policy_itself_may_be_named_like_the_adapter_folder() -> None:
    """The one trained policy's weights are final/ itself and its adapters final/adapter/:
    nothing collides."""
    data = grpo()
    data["models"]["adapter"] = data["models"].pop("actor")
    data["models"]["adapter"]["lora"] = {"rank": 8}
    for node in data["nodes"].values():
        if node.get("model") == "actor":
            node["model"] = "adapter"
    assert issues(data) == []


@pytest.mark.parametrize(("lora", "message"), [
    ({"rank": 8, "dropout": 0.05}, "models.actor.lora.dropout: unknown field 'dropout'; allowed: rank, alpha, "
                                   "target_modules"),
    ({"rnak": 8}, "models.actor.lora.rnak: unknown field 'rnak' (did you mean 'rank'?)"),
    ({"rank": 0}, "models.actor.lora.rank: out of range: allowed rank >= 1, found 0"),
    ({"target_modules": "q_proj"}, "models.actor.lora.target_modules: expected all-linear or a list of module names "
                                   "such as [q_proj, v_proj], found 'q_proj' (a list: [q_proj])"),
    ({"target_modules": "all_linear"}, "found 'all_linear' (did you mean all-linear?)"),
])
def test_a_mistake_inside_lora_is_named_with_lora_s_own_fields(lora: dict[str, Any], message: str) -> None:
    """The section inside a model is followed down: its fields, not the model's, are offered."""
    data = grpo()
    data["models"]["actor"]["lora"] = lora
    with pytest.raises(SpecError) as caught:
        pipeline_from_dict(data)
    assert len(caught.value.issues) == 1 and message in str(caught.value)


def test_a_mini_batch_size_above_the_rollout_is_refused_and_an_uneven_one_is_warned_of() -> None:
    from flowrl.graph import uneven_mini_batches

    data = grpo()
    data["data"] = {"source": "builtin:digits", "batch_size": 4}
    data["nodes"]["rollout"]["n"] = 4  # 16 sequences
    data["nodes"]["train"]["mini_batch_size"] = 8
    assert issues(data) == [] and uneven_mini_batches(PipelineSpec.model_validate(data)) == []
    data["nodes"]["train"]["mini_batch_size"] = 5
    assert issues(data) == []
    assert uneven_mini_batches(PipelineSpec.model_validate(data)) == [
        "nodes.train.mini_batch_size: 5 does not divide the 16 sequences of a rollout (data.batch_size 4 x n 4): the "
        "last optimizer step of each epoch holds 1 sequence(s) with a whole step's weight; a divisor of 16 gives "
        "equal steps"]
    data["nodes"]["train"]["mini_batch_size"] = 64
    assert issues(data) == [
        "nodes.train.mini_batch_size: mini_batch_size 64 is more than the 16 sequences of a rollout (data.batch_size 4 "
        "x n 4); set at most 16, or remove it (one optimizer step over the whole rollout)"]


def test_a_mini_batch_beside_another_section_s_mistake_is_judged_or_left_never_a_traceback() -> None:
    """The graph rules run on what passed the schema: a mini-batch rule read data.batch_size
    from a spec built without its data section (AttributeError, exit 1)."""
    data = grpo()
    data["data"] = {"source": "builtin:digits", "batch_size": 4}
    data["nodes"]["rollout"]["n"] = 4
    data["nodes"]["train"]["mini_batch_size"] = 64
    data["trainer"] = {"steps": 0}
    with pytest.raises(SpecError) as raised:
        pipeline_from_dict(data)
    assert sorted(issue.path for issue in raised.value.issues) == ["nodes.train.mini_batch_size", "trainer.steps"]
    data["data"]["batch_size"] = 4
    data["nodes"]["rollout"]["n"] = 16.0  # n fails the schema: 64 is 4 x 16, not more than 4 x 8
    with pytest.raises(SpecError) as raised:
        pipeline_from_dict(data)
    assert sorted(issue.path for issue in raised.value.issues) == ["nodes.rollout.n", "trainer.steps"]
    data["nodes"]["rollout"]["n"] = 4
    data["data"]["batch_size"] = 0  # the rollout's size is unknown: the rule is left out
    with pytest.raises(SpecError) as raised:
        pipeline_from_dict(data)
    assert sorted(issue.path for issue in raised.value.issues) == ["data.batch_size", "trainer.steps"]


def test_a_node_whose_output_no_node_reads_is_refused() -> None:
    """A second advantage, a reference and a critic's values that feed nothing ran every step
    for nothing, accepted."""
    data = grpo()
    data["nodes"]["adv2"] = {"role": "advantage", "estimator": "rloo", "inputs": ["reward"]}
    data["nodes"]["train"]["kl_coef"] = 0.0
    data["nodes"]["train"]["inputs"] = ["rollout", "adv"]
    assert issues(data) == [
        "nodes.ref: no node reads reference_logprob node 'ref': it would run every step for nothing; list it in the "
        "inputs of an update or an advantage with kl_coef > 0, or remove it",
        "nodes.adv2: no node reads advantage node 'adv2': it would run every step for nothing; list it in the inputs "
        "of an update, or remove it"]
    data = ppo()
    data["nodes"]["values2"] = {"role": "value", "model": "critic", "inputs": ["rollout"]}
    assert issues(data) == [
        "nodes.values2: no node reads value node 'values2': it would run every step for nothing; list it in the "
        "inputs of an advantage (estimator: gae), or remove it"]
    # a score node no advantage reads only watches: allowed (validation and the run note it)
    data = grpo()
    data["nodes"]["watch"] = {"role": "score", "fn": "digits", "inputs": ["rollout"]}
    assert issues(data) == []


def test_inputs_an_update_never_reads_are_refused() -> None:
    # rewards reach an update through its advantages
    data = grpo()
    data["nodes"]["train"]["inputs"].append("reward")
    assert issues(data) == ["nodes.train.inputs: an update reads the rewards through its advantages, so score node "
                            "'reward' in its inputs is never read; drop it from inputs"]
    # a critic's update has no KL term
    data = ppo()
    data["models"]["ref"] = {"path": "builtin:tiny-llama"}
    data["nodes"]["ref"] = {"role": "reference_logprob", "model": "ref", "inputs": ["rollout"]}
    data["nodes"]["train_critic"]["inputs"].append("ref")
    assert issues(data) == ["nodes.train_critic.inputs: a value model's update has no KL term, so reference 'ref' "
                            "in its inputs is never read; drop it from inputs"]
