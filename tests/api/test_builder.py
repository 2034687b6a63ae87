"""The Python builder gives the same pipeline as the equivalent YAML file."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from flowrl.api.builder import ModelRef, Pipeline
from flowrl.errors import SpecError
from flowrl.spec.loader import load_pipeline

# The YAML equivalent of the builder example in DESIGN.md section 1. The builder example
# names `actor_group` without describing it, which declares a default group.
DESIGN_YAML = """\
name: grpo-digits
models:
  actor:     {path: builtin:tiny-llama, device_group: actor_group}
  reference: {path: builtin:tiny-llama, offload_to_cpu: true}
devices:
  actor_group: {}
nodes:
  rollout: {role: generate, model: actor, inputs: [prompts], n: 8, max_new_tokens: 24}
  reward:  {role: score, fn: "flowrl.rewards:digit_match", inputs: [rollout]}
  ref:     {role: reference_logprob, model: reference, inputs: [rollout]}
  adv:     {role: advantage, estimator: grpo, inputs: [reward]}
  train:   {role: update, model: actor, inputs: [rollout, adv, ref], lr: 1.0e-4, kl_coef: 0.02}
data: {source: builtin:digits, batch_size: 16}
"""


def design_example() -> Pipeline:
    p = Pipeline("grpo-digits")
    actor = p.model("actor", path="builtin:tiny-llama", group="actor_group")
    ref = p.model("reference", path="builtin:tiny-llama", offload_to_cpu=True)
    prompts = p.source("builtin:digits", batch_size=16)
    roll = p.generate(actor, prompts, n=8, max_new_tokens=24)
    scores = p.score("flowrl.rewards:digit_match", roll)
    ref_lp = p.reference_logprob(ref, roll)
    adv = p.advantage("grpo", scores)
    p.update(actor, roll, adv, ref_lp, lr=1e-4, kl_coef=0.02)
    return p


def test_design_example_equals_yaml(tmp_path: Path) -> None:
    path = tmp_path / "grpo.yaml"
    path.write_text(DESIGN_YAML)
    assert design_example().build() == load_pipeline(path)


def test_handles_and_default_names() -> None:
    p = Pipeline("names")
    actor = p.model("actor", path="builtin:tiny-llama")
    assert isinstance(actor, ModelRef) and actor == "actor"
    prompts = p.source("builtin:digits")
    assert prompts == "prompts"
    first = p.generate(actor, prompts)
    second = p.generate(actor, prompts, n=2)
    named = p.generate(actor, prompts, name="greedy", temperature=0.1)
    assert (first, second, named) == ("rollout", "rollout_2", "greedy")
    critic = p.model("critic", path="builtin:tiny-llama", kind="value")
    assert p.value(critic, first) == "values"
    scores = p.score("digits", first, second)
    assert scores == "reward"
    adv = p.advantage("grpo", scores)
    train = p.update(actor, first, adv)
    assert (adv, train) == ("adv", "train")
    # a second update of another model is named by it; a second of the same model by number
    assert (p.update(critic, first, adv), p.update(actor, second, adv)) == ("train_critic", "train_2")
    spec = p.to_dict()
    assert spec["nodes"]["greedy"] == {
        "role": "generate",
        "inputs": ["prompts"],
        "model": "actor",
        "temperature": 0.1,
    }


def test_score_with_a_reward_model_and_sections() -> None:
    p = Pipeline("rm")
    actor = p.model("actor", path="builtin:tiny-llama")
    rm = p.model("rm", path="builtin:tiny-rm", kind="reward")
    roll = p.generate(actor, p.source("builtin:digits"))
    p.update(actor, roll, p.advantage("grpo", p.score(rm, roll)))
    p.devices("gpus", type="gpu", count=2)
    p.trainer(steps=5)
    p.trainer(seed=3)
    p.runtime(cpu_slots=1)
    p.scheduler(policy="dynamic")
    data = p.to_dict()
    assert data["nodes"]["reward"]["model"] == "rm" and "fn" not in data["nodes"]["reward"]
    assert data["trainer"] == {"steps": 5, "seed": 3}
    with pytest.raises(SpecError) as caught:
        p.build()  # gpus is declared but nothing uses it
    assert [str(issue) for issue in caught.value.issues] == [
        "devices.gpus: no model or node uses device group 'gpus'; remove it"
    ]


def test_build_reports_problems_by_path_without_file() -> None:
    p = Pipeline("bad")
    actor = p.model("actor", path="builtin:tiny-llama", dtype="fp64")
    roll = p.generate(actor, p.source("builtin:digits"), n=0)
    # a field the node does not have is refused by the call that gives it
    with pytest.raises(SpecError) as unknown:
        p.update(actor, roll, lrr=1.0)
    assert [str(issue) for issue in unknown.value.issues] == ["nodes.train.lrr: unknown field 'lrr' (did you mean 'lr'?)"]
    p.update(actor, roll, lr=1.0)
    with pytest.raises(SpecError) as caught:
        p.build()
    assert [str(issue) for issue in caught.value.issues] == [
        "models.actor.dtype: expected one of fp32, bf16, fp16, found 'fp64' (did you mean 'fp16'?)",
        "nodes.rollout.n: out of range: allowed n >= 1, found 0",
        "nodes.train.inputs: update needs advantages: add an advantage node to inputs",
    ]
    assert all(issue.file is None and issue.line is None for issue in caught.value.issues)
    for call, expected in ((lambda: p.model("critic", path="builtin:tiny-llama", dtyp="bf16"),
                            "models.critic.dtyp: unknown field 'dtyp' (did you mean 'dtype'?)"),
                           (lambda: p.trainer(stpes=3), "trainer.stpes: unknown field 'stpes' (did you mean 'steps'?)"),
                           (lambda: p.devices("g", cuont=2), "devices.g.cuont: unknown field 'cuont' (did you mean 'count'?)"),
                           (lambda: p.advantage("grpo", roll, lr=0.1),
                            "nodes.adv.lr: unknown field 'lr'")):
        with pytest.raises(SpecError) as refused:
            call()
        assert str(refused.value.issues[0]).startswith(expected), refused.value.issues


def test_duplicates_are_refused_at_once() -> None:
    p = Pipeline("dup")
    p.model("actor", path="builtin:tiny-llama")
    with pytest.raises(SpecError, match="a model named 'actor' already exists"):
        p.model("actor", path="builtin:small-llama")
    p.source("builtin:digits")
    with pytest.raises(SpecError, match="one data source"):
        p.source("builtin:first_letter")
    p.generate("actor", "prompts", name="roll")
    with pytest.raises(SpecError, match="a node named 'roll' already exists"):
        p.generate("actor", "prompts", name="roll")


def test_to_yaml_loads_back(tmp_path: Path) -> None:
    p = design_example()
    path = tmp_path / "out.yaml"
    path.write_text(p.to_yaml())
    assert load_pipeline(path) == p.build()


def _local_reward() -> Any:
    def score(completions: list[str], **_: Any) -> list[float]:
        return [0.0] * len(completions)

    return score


class _Scorer:
    def __call__(self, completions: list[str], **_: Any) -> list[float]:
        return [0.0] * len(completions)


@pytest.mark.parametrize(
    ("fn", "what"),
    [
        (lambda completions, **_: [0.0] * len(completions), "is a lambda"),
        (_local_reward(), "is a function defined inside another"),
        (functools.partial(_local_reward), "is not what its name functools:partial leads to"),
        (_Scorer(), "is not what its name .*:_Scorer leads to"),
    ],
)
def test_to_yaml_refuses_a_function_a_file_cannot_name(fn: Any, what: str) -> None:
    p = Pipeline("by-value")
    actor = p.model("actor", path="builtin:tiny-llama")
    roll = p.generate(actor, p.source("builtin:digits"))
    p.update(actor, roll, p.advantage("grpo", p.score(fn, roll)))
    p.build()  # it runs from Python
    with pytest.raises(SpecError, match=rf"nodes\.reward\.fn: the reward function '.*' {what}.*run\(p\)"):
        p.to_yaml()


def test_to_yaml_names_a_module_level_function() -> None:
    from flowrl.rewards import digit_match

    p = Pipeline("by-name")
    actor = p.model("actor", path="builtin:tiny-llama")
    roll = p.generate(actor, p.source("builtin:digits"))
    p.update(actor, roll, p.advantage("grpo", p.score(digit_match, roll)))
    assert "fn: flowrl.rewards.builtin:digit_match" in p.to_yaml()


def test_eval_and_profiler_sections_and_mistakes_refused_at_the_call(tmp_path: Path) -> None:
    p = Pipeline("sections")
    actor = p.model("actor", path="builtin:tiny-llama")
    rm = p.model("rm", path="builtin:tiny-rm", kind="reward")
    roll = p.generate(actor, p.source("builtin:digits"))
    scores = p.score("digits", roll)
    p.eval(every_steps=5, n=2, temperature=1.0)
    p.profiler(ewma_window=4)
    # a model's name as a string would be read as a reward function's name
    with pytest.raises(SpecError) as named:
        p.score("rm", roll)
    assert [str(issue) for issue in named.value.issues] == [
        "nodes: score('rm', ...): a name is read as a reward function's, and 'rm' is a model of this pipeline: pass "
        "what p.model() returned for it to score with the model"]
    with pytest.raises(SpecError) as listed:
        p.update(actor, [roll, p.advantage("grpo", scores, p.score(rm, roll))])  # type: ignore[arg-type]
    assert str(listed.value.issues[0]) == (
        "nodes.train.inputs: inputs are passed one by one (p.update(..., roll, adv)), not as list ['rollout', 'adv']")
    with pytest.raises(SpecError, match="two device groups given, group='a' and device_group='b': give one"):
        p.model("critic", path="builtin:tiny-llama", group="a", device_group="b")
    p.update(actor, roll, "adv")
    graph = p.build()
    assert graph.spec.eval is not None and (graph.spec.eval.every_steps, graph.spec.eval.n) == (5, 2)
    assert graph.spec.profiler.ewma_window == 4
    with pytest.raises(SpecError, match="eval.evry_steps: unknown field 'evry_steps'"):
        p.eval(evry_steps=3)


def test_validate_checks_the_data_and_the_reward_functions_as_the_command_does(tmp_path: Path) -> None:
    import flowrl as fr

    (tmp_path / "data.jsonl").write_text("".join(f'{{"question": "q{i}=", "solution": "{i}"}}\n' for i in range(4)))
    p = Pipeline("checked")
    actor = p.model("actor", path="builtin:tiny-llama")
    roll = p.generate(actor, p.source("data.jsonl", prompt_key="prompt"), n=2)
    p.update(actor, roll, p.advantage("grpo", p.score("digits", roll)))
    p.build()  # the structure is right: build() does not read the data
    with pytest.raises(SpecError) as caught:
        fr.validate(p, base_dir=tmp_path)
    assert [str(issue) for issue in caught.value.issues] == [
        "data.prompt_key: data.jsonl has no column 'prompt' (columns: question, solution); set data.prompt_key to "
        "the column that holds the prompts"]
    fixed = Pipeline("checked")
    actor = fixed.model("actor", path="builtin:tiny-llama")
    roll = fixed.generate(actor, fixed.source("data.jsonl", prompt_key="question"), n=2)
    fixed.update(actor, roll, fixed.advantage("grpo", fixed.score("digits", roll)))
    assert fr.validate(fixed, base_dir=tmp_path) == fixed.build()


def test_python_values_are_taken_as_a_file_would_give_them() -> None:
    """Validation is strict (no conversions); from Python a tuple is a list, a Path a string and
    a numpy number its number. A score node's params reach the function as given."""
    import numpy as np

    p = Pipeline("python-values")
    actor = p.model("actor", path="builtin:tiny-llama", group="g")
    p.devices("g", type="cpu", device_ids=(0,))
    rollout = p.generate(actor, p.source("builtin:digits", batch_size=np.int64(4)), n=np.int64(2),
                         temperature=np.float32(0.7))
    scores = p.score("digits", rollout, params={"bounds": (1, 2)})
    p.update(actor, rollout, p.advantage("grpo", scores), betas=(0.8, 0.9))
    p.trainer(output_dir=Path("out") / "run", loggers=("jsonl",))
    spec = p.build().spec
    assert spec.devices["g"].device_ids == [0] and spec.data.batch_size == 4 and spec.nodes["rollout"].n == 2
    assert spec.trainer.output_dir == str(Path("out") / "run") and spec.trainer.loggers == ("jsonl",)
    assert spec.nodes["reward"].params == {"bounds": (1, 2)}
    assert spec.nodes["rollout"].temperature == 0.7 and "temperature: 0.7" in p.to_yaml()


def test_a_table_given_where_a_path_is_expected_is_named_by_its_type_not_printed() -> None:
    import numpy as np
    import pandas as pd

    p = Pipeline("table")
    actor = p.model("actor", path="builtin:tiny-llama")
    rollout = p.generate(actor, p.source(pd.DataFrame({"prompt": ["ab="] * 100})))  # type: ignore[arg-type]
    p.update(actor, rollout, p.advantage("grpo", p.score("digits", rollout)))
    with pytest.raises(SpecError) as raised:
        p.build()
    assert str(raised.value) == "1 problem in the pipeline:\n  data.source: expected a string, found a pandas DataFrame"
    # a short value is still shown, with its type
    p = Pipeline("short")
    actor = p.model("actor", path="builtin:tiny-llama")
    p.generate(actor, p.source("builtin:digits"), temperature=np.array([0.5]))
    with pytest.raises(SpecError, match=r"found \[0\.5\] \(a numpy ndarray\)"):
        p.build()
