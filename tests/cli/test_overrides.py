"""``KEY=VALUE`` overrides after the pipeline file, and ``flowrl --version``."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from flowrl.cli import main as cli
from flowrl.errors import SpecError
from flowrl.spec.dump import to_yaml
from flowrl.spec.lines import parse_yaml
from flowrl.spec.loader import load_pipeline
from flowrl.spec.overrides import apply_overrides, parse_override, parse_overrides, parse_value

GOOD = """\
name: small
models:
  actor: {path: builtin:tiny-llama}
nodes:
  rollout: {role: generate, model: actor, inputs: [prompts]}
  reward:  {role: score, fn: digits, inputs: [rollout]}
  adv:     {role: advantage, inputs: [reward]}
  train:   {role: update, model: actor, inputs: [rollout, adv]}
data: {source: builtin:digits}
trainer: {steps: 10}
"""


def write(tmp_path: Path, text: str = GOOD) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(text)
    return path


def flowrl(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli.app, list(args))
    return result.exit_code, result.output


def assert_user_error(code: int, output: str, *expected: str) -> None:
    assert code == 2, output
    assert "Traceback" not in output, output
    for text in expected:
        assert text in output, (text, output)


@pytest.mark.parametrize(
    "text, value",
    [
        ("50", 50),
        ("-3", -3),
        ("0.5", 0.5),
        ("1e-5", 1e-5),
        ("3E8", 3e8),
        ("1.0e5", 1e5),
        ("-2.5e-3", -2.5e-3),
        ("true", True),
        ("false", False),
        ("null", None),
        ("", None),
        ("[a, b]", ["a", "b"]),
        ("[1e-5, 2]", [1e-5, 2]),
        ("{x: 1, y: [2]}", {"x": 1, "y": [2]}),
        ("other.jsonl", "other.jsonl"),
        ("builtin:digits", "builtin:digits"),
        ("'1e-5'", "1e-5"),
        ("'true'", "true"),
        ("a=b", "a=b"),
    ],
)
def test_values_are_read_as_yaml_with_numbers_as_meant(text: str, value: Any) -> None:
    parsed = parse_value(text)
    assert parsed == value
    assert type(parsed) is type(value)


def test_an_override_splits_at_the_first_equals_sign() -> None:
    override = parse_override("data.source=a=b.jsonl")
    assert (override.path, override.key) == (("data", "source"), "data.source")
    assert override.value == "a=b.jsonl"


def test_overrides_set_nested_fields_and_create_missing_mappings() -> None:
    data, lines, _ = parse_yaml(GOOD, "p.yaml")
    overrides = parse_overrides(
        [
            "trainer.steps=50",
            "nodes.train.lr=1e-5",
            "eval.every_steps=5",
            "models.critic.kind=value",
        ]
    )
    changed, changed_lines, origins, left_out = apply_overrides(data, lines, overrides)
    assert left_out == []
    assert changed["trainer"] == {"steps": 50}
    assert changed["nodes"]["train"]["lr"] == 1e-5
    assert changed["eval"] == {"every_steps": 5}
    assert changed["models"]["critic"] == {"kind": "value"}
    assert data["trainer"] == {"steps": 10} and "eval" not in data  # the input is left alone
    assert "trainer.steps" not in changed_lines and "trainer" in changed_lines
    assert origins["eval"] == origins["eval.every_steps"] == "eval.every_steps=5"
    assert origins["models.critic"] == "models.critic.kind=value"


def test_a_later_override_replaces_an_earlier_one() -> None:
    data, lines, _ = parse_yaml(GOOD, "p.yaml")
    overrides = parse_overrides(["trainer.steps=abc", "trainer={steps: 7}"])
    changed, _, origins, _ = apply_overrides(data, lines, overrides)
    assert changed["trainer"] == {"steps": 7}
    assert origins == {"trainer": "trainer={steps: 7}"}


def test_a_null_in_the_file_becomes_a_mapping(tmp_path: Path) -> None:
    graph = load_pipeline(write(tmp_path, GOOD + "eval:\n"), ["eval.every_steps=3"])
    assert graph.spec.eval is not None and graph.spec.eval.every_steps == 3


def test_overrides_reach_the_loaded_pipeline(tmp_path: Path) -> None:
    graph = load_pipeline(
        write(tmp_path),
        [
            "trainer.steps=50",
            "nodes.train.lr=1e-5",
            "data.source=other.jsonl",
            "eval.every_steps=5",
        ],
    )
    assert graph.spec.trainer.steps == 50
    assert graph.spec.nodes["train"].lr == 1e-5  # type: ignore[union-attr]
    assert graph.spec.data.source == "other.jsonl"
    assert graph.spec.eval is not None and graph.spec.eval.every_steps == 5


def test_an_override_can_fix_an_invalid_file(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD.replace("steps: 10", "steps: 0"))
    with pytest.raises(SpecError):
        load_pipeline(path)
    assert load_pipeline(path, ["trainer.steps=5"]).spec.trainer.steps == 5


def test_issues_name_the_override_and_come_after_the_files(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD.replace("inputs: [rollout, adv]", "inputs: [rollout, adv], lr: -1"))
    with pytest.raises(SpecError) as caught:
        load_pipeline(
            path, ["trainer.steps=abc", "models.critic.kind=value", "eval={every_steps: x}"]
        )
    assert [str(issue) for issue in caught.value.issues] == [
        f"{path}:8: nodes.train.lr: out of range: allowed lr > 0, found -1",
        "command line: trainer.steps=abc: expected an integer, found 'abc'",
        "command line: models.critic.kind=value: models.critic.path: "
        "required field 'path' is missing",
        "command line: eval={every_steps: x}: eval.every_steps: expected an integer, found 'x'",
    ]
    issue = caught.value.issues[1]
    assert (issue.path, issue.file, issue.line) == ("trainer.steps", "command line", None)


def test_a_check_of_a_whole_section_names_the_override_of_the_field_it_is_about(tmp_path: Path) -> None:
    """It named the first override that touched the section (every_steps, valid alone)."""
    with pytest.raises(SpecError) as caught:
        load_pipeline(write(tmp_path), ["scheduler.every_steps=5", "scheduler.min_gain=0.5"])
    [issue] = caught.value.issues
    assert issue.argument == "scheduler.min_gain=0.5" and "min_gain is read only by policy: dynamic" in issue.message


def test_a_path_through_a_value_that_is_not_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as caught:
        load_pipeline(write(tmp_path), ["name.x=1", "nodes.train.inputs.0=a"])
    assert [str(issue) for issue in caught.value.issues] == [
        "command line: name.x=1: 'name' is 'small', not a mapping, so it has no field 'x'; "
        "set 'name' itself instead",
        "command line: nodes.train.inputs.0=a: 'nodes.train.inputs' is a list, not a mapping, "
        "so it has no field '0'; set the whole list instead, such as nodes.train.inputs=[a, b]",
    ]


def test_validate_with_an_override_reports_success(tmp_path: Path) -> None:
    code, output = flowrl("validate", str(write(tmp_path)), "trainer.steps=5")
    assert code == 0, output
    assert "with trainer.steps=5: valid pipeline 'small'" in output


def test_a_bad_value_is_a_user_error_naming_the_override(tmp_path: Path) -> None:
    code, output = flowrl("validate", str(write(tmp_path)), "trainer.steps=abc")
    expected = "command line: trainer.steps=abc: expected an integer, found 'abc'"
    assert_user_error(code, output, expected)


def test_an_unknown_field_suggests_the_nearest(tmp_path: Path) -> None:
    code, output = flowrl("validate", str(write(tmp_path)), "trainer.stpes=3")
    expected = "command line: trainer.stpes=3: unknown field 'stpes' (did you mean 'steps'?)"
    assert_user_error(code, output, expected)


def test_a_misspelt_node_is_named_with_the_nearest_and_a_new_one_needs_its_role(tmp_path: Path) -> None:
    path = write(tmp_path)
    name = next(line.split(":")[0].strip() for line in GOOD.splitlines() if "role: generate" in line)
    misspelt = name[:-1]
    code, output = flowrl("validate", str(path), f"nodes.{misspelt}.n=3")
    assert_user_error(code, output, f"command line: nodes.{misspelt}.n=3: nodes.{misspelt}: no node '{misspelt}' in "
                                    f"the file (did you mean '{name}'?); a new node needs its role too")
    code, output = flowrl("validate", str(path), f"nodes.{misspelt}.role=generate", f"nodes.{misspelt}.n=3")
    assert "no node" not in output and "a new node needs its role" not in output


def test_overrides_that_cannot_apply_are_reported_with_every_other_problem(tmp_path: Path) -> None:
    path = write(tmp_path)
    name = next(line.split(":")[0].strip() for line in GOOD.splitlines() if "role: generate" in line)
    with pytest.raises(SpecError) as caught:
        load_pipeline(path, ["trainer.stpes=5", f"nodes.{name}.temprature=0.5", f"nodes.{name[:-1]}.n=2", "name.x=1"])
    assert sorted(issue.argument or "" for issue in caught.value.issues) == sorted(
        ["trainer.stpes=5", f"nodes.{name}.temprature=0.5", f"nodes.{name[:-1]}.n=2", "name.x=1"])


@pytest.mark.parametrize(
    "command, argument, expected",
    [
        ("validate", "trainer.steps", "found no '='"),
        ("validate", "=5", "expected a field name before '='"),
        ("validate", "trainer..steps=5", "empty name between dots"),
        ("validate", "x=[a", "the value is not valid YAML"),
        ("validate", "name.x=1", "not a mapping"),
        ("run", "trainer.steps", "found no '='"),
        ("run", "trainer.steps=abc", "expected an integer"),
        ("plan", "name.x=1", "not a mapping"),
    ],
)
def test_malformed_overrides_are_user_errors(
    tmp_path: Path, command: str, argument: str, expected: str
) -> None:
    code, output = flowrl(command, str(write(tmp_path)), argument)
    assert_user_error(code, output, f"command line: {argument}: ", expected)


def test_run_trains_the_overridden_pipeline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trained: list[Any] = []
    monkeypatch.setattr(cli, "_train", lambda graph, *_, **kwargs: trained.append((graph, kwargs)))
    pipeline = str(write(tmp_path))
    code, output = flowrl("run", pipeline, "trainer.steps=50", "nodes.train.lr=3e-5", "--seed", "3")
    assert code == 0, output
    ((graph, options),) = trained
    assert options["seed"] == 3
    saved = write(tmp_path, to_yaml(graph))  # what the run writes as its config.yaml
    assert load_pipeline(saved).spec == graph.spec
    assert graph.spec.trainer.steps == 50 and graph.spec.nodes["train"].lr == 3e-5


def test_version_prints_the_installed_version() -> None:
    code, output = flowrl("--version")
    assert code == 0, output
    assert output == f"flowrl {importlib.metadata.version('flowrl')}\n"


def test_an_empty_output_folder_is_refused() -> None:
    """"" would be the working directory, whose checkpoints/ and final/ --overwrite deletes."""
    pipeline = Path(__file__).resolve().parents[2] / "pipelines" / "grpo_tiny.yaml"
    with pytest.raises(SpecError, match=r"trainer.output_dir='': must not be empty"):
        load_pipeline(pipeline, ["trainer.output_dir=''"])
    result = CliRunner().invoke(cli.app, ["run", str(pipeline), "-o", "", "--steps", "1", "--plain"])
    assert result.exit_code == 2 and "--output-dir '': trainer.output_dir: must not be empty" in result.output


def test_force_without_resume_is_refused(tmp_path: Path) -> None:
    pipeline = Path(__file__).resolve().parents[2] / "pipelines" / "grpo_tiny.yaml"
    # in a folder whose earlier run a fresh one would be refused for: the flag is what is wrong
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "config.json").write_text("{}")
    result = CliRunner().invoke(cli.app, ["run", str(pipeline), "--force", "--steps", "1", "--plain", "-o", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert "--force (force=True) lets a resume go on with a changed pipeline: add --resume" in result.output


def test_validate_notes_a_logger_whose_package_this_machine_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The file is valid (exit 0), but a run started here would be refused: validate says so."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name == "wandb" else real(name, *rest))
    pipeline = Path(__file__).resolve().parents[2] / "pipelines" / "grpo_tiny.yaml"
    result = CliRunner().invoke(cli.app, ["validate", str(pipeline), "trainer.loggers=[wandb]"])
    assert result.exit_code == 0, result.output
    assert ("note: a run started on this machine would be refused: trainer.loggers: 'wandb' needs the wandb package, "
            "which is not installed; install it (pip install 'flowrl[wandb]')") in result.output


def test_an_empty_file_is_called_empty_whatever_the_overrides(tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(SpecError, match="the file is empty; a pipeline needs name, models, nodes and data"):
        load_pipeline(empty, ["trainer.steps=2"])


def _valid(pipeline: str, *overrides: str) -> str:
    """The output of ``flowrl validate`` of a shipped pipeline, which must pass."""
    path = Path(__file__).resolve().parents[2] / "pipelines" / pipeline
    result = CliRunner().invoke(cli.app, ["validate", str(path), *overrides])
    assert result.exit_code == 0, result.output
    return result.output


def test_validate_notes_a_setting_that_changes_nothing_where_the_pipeline_runs() -> None:
    """offload_to_cpu on a model of CPU slots: accepted (a pipeline may run on GPUs elsewhere),
    and said to change nothing here."""
    assert ("note: models.reference.offload_to_cpu pages a GPU model's weights, and 'reference' runs on CPU slots, "
            "where its weights are in host memory already: it changes nothing here") in _valid(
                "grpo_tiny.yaml", "models.reference.offload_to_cpu=true")
    assert "note:" not in _valid("grpo_0.4b_gpu.yaml", "models.reference.offload_to_cpu=true")


def test_validate_notes_sharding_over_one_device() -> None:
    """sharded: true with the update's group at one device: nothing to split the model over."""
    assert ("note: models.actor.sharded splits a trained model over its update's devices, and the update of 'actor' "
            "runs on one device (group actor_group): it changes nothing here; give the group count: 2 or more to "
            "shard") in _valid("grpo_sharded.yaml", "devices.actor_group.count=1")
    assert "note:" not in _valid("grpo_sharded.yaml")


def test_validate_notes_a_score_node_no_advantage_reads() -> None:
    assert ("note: nodes.watch: no advantage reads score node 'watch': its scores are logged (reward/watch/*), and "
            "evaluated where an eval section scores it, and nothing trains on them; list it in an advantage's inputs "
            "to train on it") in _valid("ppo_tiny.yaml", "nodes.watch={role: score, fn: digits, inputs: [rollout]}")


def test_validate_notes_an_evaluation_of_the_training_prompts(tmp_path: Path) -> None:
    """A single data file has one split: evaluated without eval.source, its prompts are the
    training ones (the run warned; validation said nothing)."""
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text((Path(__file__).resolve().parents[2] / "pipelines" / "grpo_tiny.yaml").read_text())
    (tmp_path / "prompts.jsonl").write_text("".join(f'{{"prompt": "abc{n}="}}\n' for n in range(8)))
    result = CliRunner().invoke(cli.app, ["validate", str(pipeline), "data.source=prompts.jsonl", "eval.every_steps=5"])
    assert result.exit_code == 0, result.output
    assert ("note: the evaluation's prompts are those of split 'train' of prompts.jsonl, the split training draws "
            "from, so they are not held out") in result.output, result.output
    held = tmp_path / "held.jsonl"
    held.write_text('{"prompt": "xyz="}\n')
    result = CliRunner().invoke(cli.app, ["validate", str(pipeline), "data.source=prompts.jsonl", "eval.every_steps=5",
                                          "eval.source=held.jsonl"])
    assert result.exit_code == 0 and "note:" not in result.output, result.output


def test_a_subset_of_a_local_data_file_is_refused_not_ignored(tmp_path: Path) -> None:
    text = (Path(__file__).resolve().parents[2] / "pipelines" / "grpo_tiny.yaml").read_text()
    (tmp_path / "q.jsonl").write_text('{"prompt": "ab=", "answer": "1"}\n')
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(text.replace("builtin:digits", "q.jsonl"))
    result = CliRunner().invoke(cli.app, ["validate", str(pipeline), "data.subset=main"])
    assert result.exit_code == 2
    assert ("command line: data.subset=main: a subset is a configuration of a hub dataset, and q.jsonl is a single "
            "file, which has none, so 'main' would be ignored; remove it") in result.output


def test_a_data_file_without_the_prompt_and_the_answer_column_gets_both_reported_at_once(tmp_path: Path) -> None:
    text = (Path(__file__).resolve().parents[2] / "pipelines" / "grpo_tiny.yaml").read_text()
    (tmp_path / "q.jsonl").write_text('{"prompt": "ab=", "answer": "1"}\n')
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(text.replace("builtin:digits", "q.jsonl"))
    result = CliRunner().invoke(cli.app, ["validate", str(pipeline), "data.prompt_key=question",
                                          "data.answer_key=gold"])
    assert result.exit_code == 2
    assert "2 problems" in result.output
    assert ("command line: data.prompt_key=question: q.jsonl has no column 'question' (columns: prompt, answer); "
            "set data.prompt_key to the column that holds the prompts") in result.output
    assert "command line: data.answer_key=gold: q.jsonl has no column 'gold' (data.answer_key;" in result.output
