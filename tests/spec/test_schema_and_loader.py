"""Schema and loader: every problem reported at once, with file:line and a useful message."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from flowrl.errors import FlowrlError, SpecError
from flowrl.spec.loader import load_pipeline, pipeline_from_dict
from flowrl.spec.schema import DeviceGroupSpec, GenerateNode, PipelineSpec, UpdateNode

BROKEN = Path(__file__).parent.parent / "fixtures" / "broken"

GOOD = """\
name: small
models:
  actor: {path: builtin:tiny-llama, device_group: actor_group}
devices:
  actor_group: {type: cpu}
nodes:
  rollout: {role: generate, model: actor, inputs: [prompts]}
  reward:  {role: score, fn: digits, inputs: [rollout]}
  adv:     {role: advantage, inputs: [reward]}
  train:   {role: update, model: actor, inputs: [rollout, adv]}
data: {source: builtin:digits}
"""


def write(tmp_path: Path, text: str, name: str = "pipeline.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def problems(path: Path) -> list[str]:
    with pytest.raises(SpecError) as caught:
        load_pipeline(path)
    return [str(issue) for issue in caught.value.issues]


def test_good_file_loads_with_defaults(tmp_path: Path) -> None:
    graph = load_pipeline(write(tmp_path, GOOD))
    rollout = graph.spec.nodes["rollout"]
    assert isinstance(rollout, GenerateNode)
    assert (rollout.n, rollout.max_new_tokens, rollout.temperature) == (8, 16, 1.0)
    train = graph.spec.nodes["train"]
    assert isinstance(train, UpdateNode)
    assert train.betas == (0.9, 0.999)
    assert graph.spec.trainer.steps == 100
    assert graph.spec.runtime.cpu_slots == 2
    assert list(graph.spec.nodes) == ["rollout", "reward", "adv", "train"]


def test_specs_are_frozen(tmp_path: Path) -> None:
    graph = load_pipeline(write(tmp_path, GOOD))
    with pytest.raises(ValidationError):
        graph.spec.data.batch_size = 3  # type: ignore[misc]


def test_field_docstrings_carry_the_default() -> None:
    description = GenerateNode.model_fields["max_new_tokens"].description
    assert description is not None and "Default 16" in description


def test_many_mistakes_are_all_reported_in_file_order() -> None:
    path = BROKEN / "many_mistakes.yaml"
    f = str(path)
    # Line numbers counted by hand in the fixture (line 1 is `name:`).
    expected = [
        f"{f}:3: models.actor.device_group: no device group 'Actor_Group' (did you mean "
        "'actor_group'?)",
        f"{f}:3: models.actor.dtype: expected one of fp32, bf16, fp16, found 'bf32' (did you mean "
        "'fp32'?)",
        f"{f}:4: models.reference.kind: expected one of policy, value, reward, found 'critic'",
        f"{f}:7: devices.actor_group.count: out of range: allowed count >= 1, found 0",
        f"{f}:9: nodes.rollout.model: no model 'actr' (did you mean 'actor'?)",
        f"{f}:9: nodes.rollout.max_new_tokens: out of range: allowed max_new_tokens >= 1, found 0",
        f"{f}:9: nodes.rollout.top_p: out of range: allowed 0 < top_p <= 1, found 1.5",
        f"{f}:10: nodes.reward.role: unknown role 'scor' (did you mean 'score'?); known roles: "
        "generate, score, reference_logprob, value, advantage, update",
        # a missing field is reported on the line of its parent
        f"{f}:12: nodes.values.model: required field 'model' is missing",
        f"{f}:13: nodes.adv.inputs: no node 'advv' (did you mean 'adv'?); inputs name other nodes "
        "or 'prompts'",
        f"{f}:17: nodes.train.inputs: update needs a rollout: add a generate node to inputs",
        f"{f}:18: nodes.train.lrr: unknown field 'lrr' (did you mean 'lr'?)",
        f"{f}:20: data.batch_size: out of range: allowed batch_size >= 1, found 0",
        f"{f}:20: data.shufle: unknown field 'shufle' (did you mean 'shuffle'?)",
        f"{f}:21: trainer.steps: expected an integer, found 'ten'",
    ]
    assert problems(path) == expected


def test_graph_mistakes_are_all_reported_in_file_order() -> None:
    path = BROKEN / "graph_mistakes.yaml"
    f = str(path)
    expected = [
        f"{f}:5: models.spare: no node uses model 'spare'; remove it or use it in a node",
        f"{f}:7: devices.gpus: no model or node uses device group 'gpus'; remove it",
        f"{f}:9: nodes.rollout.model: generate needs a policy model; 'critic' is kind value "
        "(set models.critic.kind: policy if it is one)",
        f"{f}:10: nodes.reward.inputs: cycle reward -> late -> reward; one iteration must flow "
        "one way",
        f"{f}:12: nodes.loop.inputs: 'loop' reads its own output; drop 'loop' from inputs",
        f"{f}:13: nodes.adv.inputs: advantage needs values (gae): add a value node to inputs",
        f"{f}:13: nodes.adv.device_group: no device group 'gpu' (did you mean 'gpus'?)",
        f"{f}:14: nodes.train.inputs: update needs a rollout: add a generate node to inputs",
        f"{f}:14: nodes.train.inputs: kl_coef is 0, so the reference is never used; "
        "set kl_coef > 0 or drop 'ref' from inputs",
    ]
    assert problems(path) == expected


def test_duplicate_keys_are_errors() -> None:
    path = BROKEN / "duplicate_keys.yaml"
    f = str(path)
    assert problems(path) == [
        f"{f}:9: nodes.rollout: duplicate key 'rollout' (first at line 5); "
        "YAML would keep only the last one, so remove one of them",
        f"{f}:10: data.batch_size: duplicate key 'batch_size'; "
        "YAML would keep only the last one, so remove one of them",
    ]


def test_syntax_error_names_the_line() -> None:
    path = BROKEN / "syntax_error.yaml"
    # line 3 opens `{path: ...` without closing it; YAML notices at the `:` on line 4
    assert problems(path) == [
        f"{path}:4: YAML syntax error: expected ',' or '}}', but got ':' "
        "(while parsing a flow mapping started at line 3); the '{' on line 3 is not closed on its line: "
        "close it with '}'"
    ]


@pytest.mark.parametrize("text", [
    "name: x\nnodes:\n  train:\n    inputs:\n      - a\n    - b\n",  # a list item at its key's column
    "name: x\na:\n  - x: 1\n   y: 2\n",  # a key of a list item's mapping, off its column
    "name: x\nitems:\n  - name: a\n      role: b\n",
])
def test_a_syntax_error_in_a_list_gets_no_hint_that_could_mislead(tmp_path: Path, text: str) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    (problem,) = problems(path)
    assert "YAML syntax error" in problem and "; " not in problem.split("YAML syntax error: ", 1)[1], problem


@pytest.mark.parametrize(("text", "line", "hint"), [
    # a key one space too far in: its siblings are at 2
    ("name: x\nmodels:\n  actor:\n    path: builtin:tiny-llama\n   reference:\n    path: builtin:tiny-llama\n", 5,
     "this line is indented by 3 spaces, the line above it by 4 spaces and the mapping that starts at line 3 by 2 "
     "spaces: the keys of one mapping start in one column"),
    ("name: x\ntrainer:\nsteps: 3\n  output_dir: out\n", 4,
     "this line is indented under 'steps: 3', which already has its value: give that key no value on its line, or "
     "indent this line like it"),
    ("name: x\nmodels:\n  actor:\n    path: builtin:tiny-llama\n\tdevice_group: g\n", 5,
     "YAML indents with spaces only: replace the tabs on this line with spaces"),
    ("name: x\nnotes: see: here\n", 2, "a ': ' inside an unquoted value: put the value in quotes"),
    ("name: x\nnodes:\n  reward: {role: score, fn: a: b}\n", 3,
     "a ':' inside an unquoted value of a {...} mapping: put the value in quotes"),
])
def test_a_syntax_error_says_what_usually_causes_it(tmp_path: Path, text: str, line: int, hint: str) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    (problem,) = problems(path)
    assert problem.startswith(f"{path}:{line}: YAML syntax error: ") and problem.endswith(f"; {hint}"), problem


@pytest.mark.parametrize(
    ("fixture", "message"),
    [
        ("not_a_mapping.yaml", "expected a mapping of pipeline sections"),
        ("empty.yaml", "the file is empty"),
    ],
)
def test_file_that_is_not_a_pipeline(fixture: str, message: str) -> None:
    (problem,) = problems(BROKEN / fixture)
    assert problem.startswith(f"{BROKEN / fixture}:1: {message}")


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(FlowrlError, match="no such file"):
        load_pipeline(tmp_path / "nope.yaml")
    with pytest.raises(FlowrlError, match="is a directory"):
        load_pipeline(tmp_path)


def test_python_tags_are_refused_not_executed(tmp_path: Path) -> None:
    text = GOOD.replace("name: small", "name: !!python/object/apply:os.system ['echo hi']")
    (problem,) = problems(write(tmp_path, text))
    assert problem.startswith(
        f"{tmp_path / 'pipeline.yaml'}:1: YAML error: could not determine a constructor for the tag"
    )


def test_unknown_field_without_close_match_lists_allowed_and_owner(tmp_path: Path) -> None:
    text = GOOD.replace("inputs: [prompts]}", "inputs: [prompts], kl_coef: 0.1}")
    (problem,) = problems(write(tmp_path, text))
    assert problem.startswith(
        f"{tmp_path / 'pipeline.yaml'}:7: nodes.rollout.kl_coef: unknown field"
    )
    assert "allowed: inputs, model, device_group, role, n, max_new_tokens" in problem
    assert "('kl_coef' belongs to advantage / update nodes, not generate)" in problem


def test_unknown_section_suggests_nearest(tmp_path: Path) -> None:
    (problem,) = problems(write(tmp_path, GOOD + "trainr: {steps: 3}\n"))
    assert problem.endswith(":12: trainr: unknown section 'trainr' (did you mean 'trainer'?)")


def test_missing_role_and_missing_section(tmp_path: Path) -> None:
    text = GOOD.replace("{role: score, fn: digits,", "{fn: digits,").replace(
        "data: {source: builtin:digits}\n", ""
    )
    found = problems(write(tmp_path, text))
    assert found == [
        f"{tmp_path / 'pipeline.yaml'}: data: required section 'data' is missing",
        f"{tmp_path / 'pipeline.yaml'}:8: nodes.reward.role: a node needs a role; known roles: "
        "generate, score, reference_logprob, value, advantage, update",
    ]


def test_wrong_types(tmp_path: Path) -> None:
    text = GOOD.replace("inputs: [prompts]}", "inputs: prompts, temperature: hot}").replace(
        "{type: cpu}", "{type: cpu, arch: a100}"
    )
    assert problems(write(tmp_path, text)) == [
        f"{tmp_path / 'pipeline.yaml'}:5: devices.actor_group.arch: expected a list, found 'a100'",
        f"{tmp_path / 'pipeline.yaml'}:7: nodes.rollout.inputs: expected a list, found 'prompts'",
        f"{tmp_path / 'pipeline.yaml'}:7: nodes.rollout.temperature: expected a number, found "
        "'hot'",
    ]


def test_values_of_another_type_are_refused_not_converted(tmp_path: Path) -> None:
    """YAML's yes is true, which lax validation took as 1.0; a quoted number or a float count
    would have become a number or an integer. A list still stands for a pair, an int for a float."""
    text = GOOD.replace("inputs: [rollout, adv]}", "inputs: [rollout, adv], lr: yes, betas: [0.8, 0.9]}").replace(
        "inputs: [prompts]}", "inputs: [prompts], n: '4', temperature: 1}").replace(
        "inputs: [reward]}", "inputs: [reward], scale_by_std: 0}")
    path = tmp_path / "pipeline.yaml"
    assert problems(write(tmp_path, text + "trainer: {steps: 10.0}\n")) == [
        f"{path}:7: nodes.rollout.n: expected an integer, found '4'",
        f"{path}:9: nodes.adv.scale_by_std: expected true or false, found 0",
        f"{path}:10: nodes.train.lr: expected a number, found true (a boolean; YAML reads yes, no, on and off "
        "as booleans too)",
        f"{path}:12: trainer.steps: expected an integer, found 10.0",
    ]
    spec = load_pipeline(write(tmp_path, text.replace("lr: yes", "lr: 1").replace("n: '4'", "n: 4")
                               .replace("scale_by_std: 0", "scale_by_std: false"))).spec
    assert spec.nodes["train"].lr == 1.0 and spec.nodes["train"].betas == (0.8, 0.9)
    # YAML 1.1 leaves 1e-5 (no dot) a string; a pipeline file reads it as the number meant
    spec = load_pipeline(write(tmp_path, GOOD.replace("inputs: [rollout, adv]}", "inputs: [rollout, adv], lr: 1e-5}"))).spec
    assert spec.nodes["train"].lr == 1e-5


def test_a_number_that_is_nan_or_infinite_is_refused(tmp_path: Path) -> None:
    """weight: .nan passed validation; every reward was then NaN and nothing trained, exit 0."""
    text = GOOD.replace("fn: digits,", "fn: digits, weight: .nan,").replace(
        "inputs: [rollout, adv]}", "inputs: [rollout, adv], max_grad_norm: .inf}")
    path = tmp_path / "pipeline.yaml"
    assert problems(write(tmp_path, text)) == [
        f"{path}:8: nodes.reward.weight: input should be a finite number, found nan",
        f"{path}:10: nodes.train.max_grad_norm: input should be a finite number, found inf",
    ]


def test_a_device_id_as_the_commands_print_it_says_which_number_to_write(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD.replace("{type: cpu}", "{type: cpu, device_ids: [cpu-1]}"))
    assert problems(path) == [
        f"{path}:5: devices.actor_group.device_ids.0: expected an integer, found 'cpu-1' (device_ids takes device "
        "numbers: write 1 for cpu-1)",
    ]


def test_score_needs_exactly_one_of_fn_and_model() -> None:
    with pytest.raises(ValidationError, match="needs 'fn'"):
        PipelineSpec.model_validate(
            {"name": "x", "models": {}, "nodes": {"r": {"role": "score"}}, "data": {"source": "s"}}
        )
    with pytest.raises(ValidationError, match="not both"):
        PipelineSpec.model_validate(
            {
                "name": "x",
                "models": {},
                "nodes": {"r": {"role": "score", "fn": "digits", "model": "rm"}},
                "data": {"source": "s"},
            }
        )


def test_device_group_counts() -> None:
    # no group is sized between two counts: refused, not ignored
    with pytest.raises(ValidationError, match="min_count and max_count: a device group's size is fixed for the run; "
                                              "give count: N"):
        DeviceGroupSpec(min_count=1, max_count=16)
    with pytest.raises(ValidationError, match="max_count: a device group's size is fixed"):
        DeviceGroupSpec(type="gpu", max_count=2)
    assert DeviceGroupSpec().effective_count == 1
    assert DeviceGroupSpec(type="gpu", device_ids=[2, 3]).effective_count == 2


def minimal() -> dict[str, Any]:
    return {
        "name": "d",
        "models": {"actor": {"path": "builtin:tiny-llama"}},
        "nodes": {
            "rollout": {"role": "generate", "model": "actor", "inputs": ["prompts"]},
            "reward": {"role": "score", "fn": "digits", "inputs": ["rollout"]},
            "adv": {"role": "advantage", "inputs": ["reward"]},
            "train": {"role": "update", "model": "actor", "inputs": ["rollout", "adv"], "lr": -1},
        },
        "data": {"source": "builtin:digits"},
    }


def test_pipeline_from_dict_without_file_has_no_lines() -> None:
    with pytest.raises(SpecError) as caught:
        pipeline_from_dict(minimal())
    (issue,) = caught.value.issues
    assert (issue.file, issue.line) == (None, None)
    assert str(issue) == "nodes.train.lr: out of range: allowed lr > 0, found -1"


def test_pipeline_from_dict_with_line_map() -> None:
    with pytest.raises(SpecError) as caught:
        pipeline_from_dict(minimal(), source_name="p.yaml", line_map={"nodes.train": 9})
    assert str(caught.value.issues[0]).startswith("p.yaml:9: nodes.train.lr:")


def test_error_message_counts_problems() -> None:
    with pytest.raises(SpecError) as caught:
        pipeline_from_dict(minimal())
    assert str(caught.value).splitlines()[0] == "1 problem in the pipeline:"


def test_sharding_a_model_no_update_trains_or_two_models_on_one_group_is_refused() -> None:
    import yaml

    ppo = yaml.safe_load((Path(__file__).resolve().parents[2] / "pipelines" / "ppo_tiny.yaml").read_text())
    ppo["models"]["reference"]["sharded"] = True
    ppo["models"]["actor"]["sharded"] = True
    ppo["models"]["critic"].update({"sharded": True, "device_group": "actor_group"})
    with pytest.raises(SpecError) as raised:
        pipeline_from_dict(ppo)
    # (critic_group, now unused, is an issue of its own)
    sharding = [issue for issue in raised.value.issues if issue.path.endswith(".sharded")]
    assert [issue.path for issue in sharding] == ["models.critic.sharded", "models.reference.sharded"]
    critic, reference = (issue.message for issue in sharding)
    assert "'actor' is trained sharded in device group 'actor_group' too" in critic
    assert "no update node trains 'reference'" in reference
    # each on a group of its own, actor and critic both train sharded
    ppo["models"]["reference"]["sharded"] = False
    ppo["models"]["critic"]["device_group"] = "critic_group"
    pipeline_from_dict(ppo)


ADV = "adv:     {role: advantage, inputs: [reward]}"
TRAIN = "train:   {role: update, model: actor, inputs: [rollout, adv]}"


@pytest.mark.parametrize(
    "old, new, message",
    [
        (ADV, "adv: {role: advantage, gamma: 0.9, inputs: [reward]}",
         "9: nodes.adv.gamma: estimator grpo does not read 'gamma' (only gae and reinforce_pp do); remove it, "
         "or choose one of them"),
        (ADV, "adv: {role: advantage, estimator: rloo, scale_by_std: false, inputs: [reward]}",
         "9: nodes.adv.scale_by_std: estimator rloo does not read 'scale_by_std' (only grpo does); remove it, "
         "or choose that estimator"),
        (TRAIN, "train: {role: update, model: actor, clip_range_value: 0.3, inputs: [rollout, adv]}",
         "10: nodes.train.clip_range_value: 'clip_range_value' is read by updates of value models only, and "
         "'actor' is a policy model; remove it"),
        (TRAIN, "train: {role: update, model: actor, min_lr_ratio: 0.1, inputs: [rollout, adv]}",
         "10: nodes.train.min_lr_ratio: 'min_lr_ratio' shapes a decaying schedule, and lr_schedule is constant; "
         "set lr_schedule: cosine or linear, or remove it"),
    ],
)
def test_a_field_the_node_s_estimator_or_model_kind_never_reads_is_an_error(
        tmp_path: Path, old: str, new: str, message: str) -> None:
    (problem,) = problems(write(tmp_path, GOOD.replace(old, new)))
    assert problem == f"{tmp_path / 'pipeline.yaml'}:{message}"


def test_fields_of_the_node_s_own_estimator_and_defaults_set_explicitly_load(tmp_path: Path) -> None:
    # gamma: 1.0 is its default, which a dump of the whole spec writes out (PipelineGraph.to_dict)
    text = GOOD.replace(ADV, "adv: {role: advantage, scale_by_std: false, epsilon: 0.001, gamma: 1.0, inputs: [reward]}")
    text = text.replace(TRAIN, "train: {role: update, model: actor, clip_eps: 0.3, clip_eps_high: 0.4, kl_estimator: k1, "
                               "lr_schedule: cosine, lr_warmup_steps: 3, min_lr_ratio: 0.1, lr_decay_steps: 20, "
                               "inputs: [rollout, adv]}")
    graph = load_pipeline(write(tmp_path, text))
    assert graph.spec.nodes["adv"].epsilon == 0.001  # type: ignore[union-attr]
    assert graph.spec.nodes["train"].lr_decay_steps == 20  # type: ignore[union-attr]


def test_grpo_over_one_sample_per_prompt_is_refused_at_the_rollout(tmp_path: Path) -> None:
    text = GOOD.replace("inputs: [prompts]}", "inputs: [prompts], n: 1}")
    (problem,) = problems(write(tmp_path, text))
    assert problem.startswith(
        f"{tmp_path / 'pipeline.yaml'}:7: nodes.rollout.n: advantage 'adv' uses grpo, which compares the n samples "
        "of each prompt, and 'rollout' draws n: 1: every advantage would be 0")
    rloo = text.replace("{role: advantage, inputs", "{role: advantage, estimator: rloo, inputs")
    (problem,) = problems(write(tmp_path, rloo))
    assert "uses rloo, which compares the n samples of each prompt, and 'rollout' draws n: 1: a sample's baseline " \
           "is the mean of the other samples of its prompt, and there are none" in problem
    # reinforce_pp needs no groups
    load_pipeline(write(tmp_path, text.replace("{role: advantage, inputs", "{role: advantage, estimator: reinforce_pp, inputs")))


def test_function_fields_on_a_reward_model_score_are_refused() -> None:
    from flowrl.spec.schema import ScoreNode

    with pytest.raises(ValidationError, match=r"params and on_error apply to a reward function \('fn'\); this "
                                              r"score runs a reward model: leave them out"):
        ScoreNode(model="rm", inputs=["rollout"], params={"x": 1}, on_error="strict")
    ScoreNode(model="rm", inputs=["rollout"], on_error="zero")  # the default, as a whole dump writes it


def test_several_greedy_completions_per_held_out_prompt_are_refused() -> None:
    from flowrl.spec.schema import EvalSpec

    with pytest.raises(ValidationError, match="at temperature 0 \\(greedy\\) the 2 completions per prompt of n: 2 are "
                                              "all the same"):
        EvalSpec(n=2)
    assert EvalSpec(n=2, temperature=1.0).n == 2 and EvalSpec(n=1).temperature == 0


def test_the_samples_cadence_without_samples_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "pipeline.yaml"
    (problem,) = problems(write(tmp_path, GOOD + "trainer: {log_samples: 0, log_samples_every: 5}\n"))
    assert problem.startswith(f"{path}:12: trainer: log_samples_every is read only when log_samples is above 0")
    spec = load_pipeline(write(tmp_path, GOOD + "trainer: {log_samples: 2, log_samples_every: 5}\n")).spec
    assert (spec.trainer.log_samples, spec.trainer.log_samples_every) == (2, 5)


def test_a_model_an_update_trains_is_not_fp16(tmp_path: Path) -> None:
    text = GOOD.replace("device_group: actor_group}", "device_group: actor_group, dtype: fp16}")
    (problem,) = problems(write(tmp_path, text))
    assert problem.startswith(f"{tmp_path / 'pipeline.yaml'}:3: models.actor.dtype: an update node trains 'actor', "
                              "and fp16 gradients underflow and overflow without loss scaling")
    # bf16 trains; fp16 serves a model that only scores or gives reference log-probs
    load_pipeline(write(tmp_path, text.replace("fp16", "bf16")))


def _ppo(**adv: Any) -> dict[str, Any]:
    return {
        "name": "p",
        "models": {"actor": {"path": "builtin:tiny-llama"}, "critic": {"path": "builtin:tiny-llama", "kind": "value"},
                   "reference": {"path": "builtin:tiny-llama"}},
        "nodes": {
            "rollout": {"role": "generate", "model": "actor", "inputs": ["prompts"]},
            "reward": {"role": "score", "fn": "digits", "inputs": ["rollout"]},
            "ref": {"role": "reference_logprob", "model": "reference", "inputs": ["rollout"]},
            "values": {"role": "value", "model": "critic", "inputs": ["rollout"]},
            "adv": {"role": "advantage", "estimator": "gae", "inputs": ["reward", "values", "ref"], **adv},
            "train_actor": {"role": "update", "model": "actor", "inputs": ["rollout", "adv"]},
            "train_critic": {"role": "update", "model": "critic", "inputs": ["rollout", "adv", "values"]},
        },
        "data": {"source": "builtin:digits"},
    }


def test_an_advantage_whose_kl_settings_would_do_nothing_is_refused() -> None:
    pipeline_from_dict(_ppo(kl_coef=0.02, kl_target=0.1, kl_horizon=100))
    # the reference is computed every step and read by nothing
    with pytest.raises(SpecError, match="nodes.adv.inputs: kl_coef is 0, so the KL reward penalty is off and the "
                                        "reference log-probs of 'ref' are never used here"):
        pipeline_from_dict(_ppo())
    # an adaptive coefficient that starts at 0 stays 0
    with pytest.raises(SpecError, match="nodes.adv.kl_target: kl_target adapts kl_coef"):
        pipeline_from_dict(_ppo(kl_target=0.1))
    with pytest.raises(SpecError, match="nodes.adv.kl_horizon: kl_horizon is read only by the adaptive KL controller"):
        pipeline_from_dict(_ppo(kl_coef=0.02, kl_horizon=100))


def test_a_profiled_step_past_the_run_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "pipeline.yaml"
    (problem,) = problems(write(tmp_path, GOOD + "trainer: {steps: 4, torch_profile: [2, 9]}\n"))
    assert problem.startswith(f"{path}:12: trainer: torch_profile names step 9, past the run's 4 steps; name steps "
                              "from 1 to 4")
    (problem,) = problems(write(tmp_path, GOOD + "trainer: {steps: 4, torch_profile: [0]}\n"))
    assert problem == f"{path}:12: trainer.torch_profile.0: out of range: allowed torch_profile >= 1, found 0"


def test_the_dynamic_policys_settings_under_the_static_policy_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "pipeline.yaml"
    (problem,) = problems(write(tmp_path, GOOD + "scheduler: {low_util: 0.9, min_gain: 0.2, every_steps: 3}\n"))
    assert problem.startswith(f"{path}:12: scheduler: low_util, min_gain are read only by policy: dynamic (static "
                              "keeps the first plan); set policy: dynamic, or remove them")
    # every_steps paces the status line and the rows of split nodes under either policy
    spec = load_pipeline(write(tmp_path, GOOD + "scheduler: {policy: dynamic, low_util: 0.9}\n")).spec
    assert spec.scheduler.low_util == 0.9
    assert load_pipeline(write(tmp_path, GOOD + "scheduler: {every_steps: 3}\n")).spec.scheduler.every_steps == 3
