"""User mistakes at the command line: one clear message, exit code 2, never a traceback."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FLOWRL = str(Path(sys.executable).parent / "flowrl")


def _flowrl(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([FLOWRL, *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def _assert_user_error(result: subprocess.CompletedProcess[str], *expected: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output, output
    for text in expected:
        assert text in output, (text, output)


def test_validate_lists_every_error_with_its_line() -> None:
    broken = ROOT / "tests" / "fixtures" / "broken" / "many_mistakes.yaml"
    result = _flowrl("validate", str(broken))
    _assert_user_error(result, f"{broken}:")
    assert result.stderr.count(f"{broken}:") >= 10


def test_validate_accepts_every_shipped_pipeline() -> None:
    # The command in this process (typer's runner): a process per file would import torch
    # nine times; the console script itself is exercised by every other test here.
    from typer.testing import CliRunner

    from flowrl.cli.main import app

    for path in sorted((ROOT / "pipelines").glob("*.yaml")):
        result = CliRunner().invoke(app, ["validate", str(path)])
        assert result.exit_code == 0, result.output
        assert "valid pipeline" in result.output


@pytest.mark.parametrize(
    "args, expected",
    [
        (("validate", "no/such/file.yaml"), ("no/such/file.yaml",)),
        (("run", "no/such/file.yaml"), ("no/such/file.yaml",)),
        (("run", "pipelines/grpo_tiny.yaml", "--steps", "0"), ("--steps",)),
        (("run", "pipelines/grpo_tiny.yaml", "--stpes", "3"), ("--stpes",)),
        (("frobnicate",), ("frobnicate",)),
        (("run", "pipelines/grpo_tiny.yaml", "--scheduler", "tcp://localhost:99999"),
         ("runtime.scheduler_address: expected a Dask scheduler address", "'tcp://localhost:99999'")),
        # printed as given (rich would read ':abc:' as an emoji code)
        # an evaluation of a task of random prompts has nothing held out: refused before a run starts
        (("run", "pipelines/grpo_tiny.yaml", "eval.every_steps=5"),
         ("command line: eval.every_steps=5: eval.source: builtin:digits is a task of endless random prompts",
          "give eval.source a dataset of held-out prompts")),
        # a built-in task of random prompts reads no data columns, split or order: refused, not ignored
        (("run", "pipelines/grpo_tiny.yaml", "data.prompt_key=question", "data.shuffle=false"),
         ("command line: data.prompt_key=question: builtin:digits makes a new random prompt "
          "per row and has no prompt column, so data.prompt_key would be ignored",
          "data.shuffle=false: builtin:digits makes a new random prompt per row and has no order to shuffle")),
        # an architecture no GPU has: found by validation, before any device is matched
        (("validate", "pipelines/grpo_tiny.yaml", "devices.actor_group.type=gpu", "devices.actor_group.arch=[hoper]"),
         ("command line: devices.actor_group.arch=[hoper]: unknown architecture 'hoper' (did you mean 'hopper'?)",)),
        (("validate", "pipelines/grpo_tiny.yaml", "devices.actor_group.type=gpu",
          "devices.actor_group.preferred_arch=[amprere]"),
         ("command line: devices.actor_group.preferred_arch=[amprere]: unknown architecture 'amprere' (did you mean "
          "'ampere'?)",)),
        # a mistyped file or folder name: the one beside it that is meant
        (("validate", "pipelines/grpo_tiny.yml"),
         ("pipelines/grpo_tiny.yml: no such file (did you mean 'pipelines/grpo_tiny.yaml'?)",)),
        (("resume", "pipelines/nowhere/run"), ("pipelines/nowhere/run: no such folder; give the output folder",)),
        (("resume", "benchmark"), ("benchmark: no such folder (did you mean benchmarks?)",)),
        # an option and an override of the same field: refused, not one silently dropped
        (("run", "pipelines/grpo_tiny.yaml", "--steps", "2", "trainer.steps=3"),
         ("--steps and the override trainer.steps=... both set trainer.steps: give one of them",)),
        # a model path from an override is the override's mistake, not the file's
        (("validate", "pipelines/grpo_tiny.yaml", "models.actor.path=builtin:tiny-lama"),
         ("command line: models.actor.path=builtin:tiny-lama: unknown builtin model 'tiny-lama'",)),
        (("validate", "pipelines/grpo_tiny.yaml", "runtime.scheduler_address=localhost:abc"),
         ("runtime.scheduler_address=localhost:abc: expected a Dask scheduler address", "found 'localhost:abc'")),
        # a data field set on the command line is the override's mistake
        (("validate", "pipelines/grpo_arith.yaml", "data.prompt_key=question"),
         ("command line: data.prompt_key=question: builtin:arith (split train) has no column 'question'",)),
        (("plan", "pipelines/grpo_tiny.yaml", "--scheduler", "localhost:abc"),
         ("--scheduler: expected a Dask scheduler address", "found 'localhost:abc'")),
        (("devices", "--devices", "devices/h200-8x.yaml", "--scheduler", "tcp://127.0.0.1:8786"),
         ("give --devices (an inventory file) or --scheduler (a running cluster), not both",)),
        # nothing listens there: said at once, not planned for this machine instead
        (("plan", "pipelines/grpo_tiny.yaml", "runtime.scheduler_address=tcp://127.0.0.1:9"),
         ("cannot reach the Dask scheduler at tcp://127.0.0.1:9",)),
    ],
)
def test_bad_command_lines(args: tuple[str, ...], expected: tuple[str, ...], tmp_path: Path) -> None:
    # a run writes into a folder of its own: the repository's outputs/ may hold an earlier run
    output = ("-o", str(tmp_path / "out")) if args[0] == "run" and "--stpes" not in args else ()
    _assert_user_error(_flowrl(*args, *output), *expected)


def test_run_refuses_a_valid_pipeline_it_cannot_run_yet_before_starting_anything() -> None:
    result = _flowrl("run", "pipelines/ppo.yaml")
    _assert_user_error(result, "cannot run")


def test_missing_dataset_file_is_a_user_error(tmp_path: Path) -> None:
    text = (ROOT / "pipelines" / "grpo_tiny.yaml").read_text().replace("builtin:digits", "prompts.jsonl")
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(text)
    _assert_user_error(_flowrl("run", str(pipeline), "-o", str(tmp_path / "out")), "prompts.jsonl")


def test_bad_dataset_line_is_reported_with_its_line(tmp_path: Path) -> None:
    text = (ROOT / "pipelines" / "grpo_tiny.yaml").read_text().replace("builtin:digits", "prompts.jsonl")
    (tmp_path / "p.yaml").write_text(text)
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "abc="}\n{"prompt": 3}\nnot json\n')
    result = _flowrl("run", str(tmp_path / "p.yaml"), "-o", str(tmp_path / "out"))
    _assert_user_error(result, "prompts.jsonl:3: expected a JSON object")
    # once every line parses, the rows' contents are checked: row 2's prompt is a number
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "abc="}\n{"prompt": 3}\n')
    result = _flowrl("run", str(tmp_path / "p.yaml"), "-o", str(tmp_path / "out"))
    _assert_user_error(result, "prompts.jsonl: row 2: 'prompt' is int 3")


def test_unknown_reward_function_is_a_user_error(tmp_path: Path) -> None:
    text = (ROOT / "pipelines" / "grpo_tiny.yaml").read_text().replace("fn: digits", "fn: digitz")
    (tmp_path / "p.yaml").write_text(text)
    _assert_user_error(_flowrl("run", str(tmp_path / "p.yaml"), "-o", str(tmp_path / "out"), "--steps", "1"), "digitz")


def test_strict_reward_failure_stops_the_run_with_a_clear_message(tmp_path: Path) -> None:
    (tmp_path / "my_rewards.py").write_text(
        "def picky(completions, **kwargs):\n"
        "    raise ValueError('picky cannot score this')\n"
    )
    text = (ROOT / "pipelines" / "grpo_tiny.yaml").read_text().replace(
        "fn: digits,", "fn: 'my_rewards:picky', on_error: strict,"
    )
    (tmp_path / "p.yaml").write_text(text)
    result = _flowrl("run", str(tmp_path / "p.yaml"), "-o", str(tmp_path / "out"), "--steps", "2", "--plain")
    _assert_user_error(result, "picky", "on_error")


def _run_until(prefix: str, *arguments: str) -> tuple[subprocess.Popen[str], list[str]]:
    """``flowrl run grpo_tiny.yaml --plain ARGUMENTS`` in a session of its own, read until a
    line starting with ``prefix`` (or two minutes), with Ctrl-C as in a terminal even where the
    tests were started with SIGINT ignored."""
    import signal
    import time

    process = subprocess.Popen(
        [FLOWRL, "run", str(ROOT / "pipelines" / "grpo_tiny.yaml"), "--plain", *arguments],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    assert process.stdout is not None
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith(prefix) or time.monotonic() > deadline:
            break
    return process, lines


def _rest(process: subprocess.Popen[str]) -> str:
    """What the process writes until it ends (killed after two minutes). Read through the
    stream the lines came from: ``communicate(timeout=...)`` reads the pipe itself and misses
    what the stream's buffer already holds."""
    import threading

    assert process.stdout is not None
    watchdog = threading.Timer(120, process.kill)
    watchdog.start()
    try:
        rest = process.stdout.read()
        process.wait()
    finally:
        watchdog.cancel()
    return rest


STOPPED_IN_A_STEP = re.compile(r"interrupted \(SIGINT\) (during|after) step \d+")
"""Where a run stopped by Ctrl-C says it stopped: during a step, or after one whose record
was written (the signal came while the step's line was written)."""


def test_ctrl_c_to_the_whole_process_group_stops_cleanly(tmp_path: Path) -> None:
    import os
    import signal

    process, lines = _run_until("step 2/", "-o", str(tmp_path / "out"))
    # training has started: interrupt driver and workers together, as a terminal does
    os.killpg(process.pid, signal.SIGINT)
    rest = _rest(process)
    output = "".join(lines) + rest
    assert process.returncode == 130, output
    assert STOPPED_IN_A_STEP.search(output), output
    # grpo_tiny writes no checkpoints: the message says what a resume would do
    assert "no checkpoint was written yet (trainer.checkpoint_every: 0, none at all), so a resume would start " \
           "over at step 1" in output
    assert "Traceback" not in output, output
    # the output folder says why the run ended too
    events = [json.loads(line) for line in (tmp_path / "out" / "events.jsonl").read_text().splitlines()]
    assert any(e["kind"] == "stopped" and STOPPED_IN_A_STEP.search(e["message"]) for e in events), events


@pytest.mark.parametrize(("name", "code"), [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_stop_signal_while_the_run_starts_says_so(tmp_path: Path, name: str, code: int) -> None:
    import os
    import signal

    # the data is read before the cluster starts: the stop comes seconds before step 1
    process, lines = _run_until("[event] data:", "-o", str(tmp_path / "out"))
    os.killpg(process.pid, getattr(signal, name))
    output = "".join(lines) + _rest(process)
    assert process.returncode == code, output
    assert "stopped while the run started, before step 1; no checkpoint was written, so a rerun starts from " \
           "step 1" in output, output
    assert "Traceback" not in output and "step 1/" not in output, output


def test_a_second_sigint_while_the_run_stops_leaves_the_stop_alone(tmp_path: Path) -> None:
    """A wrapper (timeout, srun, uv run) forwards the Ctrl-C the terminal also sent to the
    process group, or the user presses it twice: the second SIGINT comes while the first one's
    stop cleans up. It ended the clean-up with a bare 'interrupted' or a traceback, without
    the checkpoint to resume from."""
    import os
    import signal

    out = tmp_path / "out"
    process, lines = _run_until("step 3/", "-o", str(out), "trainer.steps=400", "trainer.checkpoint_every=1")
    os.killpg(process.pid, signal.SIGINT)
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line)
        if line.startswith("[event] stopped"):
            # the stop is under way (the driver's loop has ended): Ctrl-C once more
            try:
                os.kill(process.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
            break
    rest = _rest(process)
    output = "".join(lines) + rest
    assert process.returncode == 130, output
    assert "Traceback" not in output and "Exception ignored" not in output, output
    assert STOPPED_IN_A_STEP.search(output), output
    assert f"the newest checkpoint is {out / 'checkpoints'}/step-" in output, output
    assert f"Resume it with `flowrl resume {out}`" in output, output
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    stops = [e["message"] for e in events if e["kind"] == "stopped"]
    assert len(stops) == 1 and STOPPED_IN_A_STEP.search(stops[0]), stops


def test_the_command_line_exits_with_its_output_written() -> None:
    # main() leaves without tearing the interpreter down: what was printed still arrives
    result = _flowrl("validate", "pipelines/grpo_tiny.yaml", "trainer.steps=7")
    assert result.returncode == 0, result.stderr
    assert "valid pipeline 'grpo-tiny'" in result.stdout


@pytest.mark.parametrize("command", ["validate", "run"])
def test_a_model_path_that_names_nothing_is_refused_at_its_line(tmp_path: Path, command: str) -> None:
    text = (ROOT / "pipelines" / "grpo_tiny.yaml").read_text()
    line = next(number for number, row in enumerate(text.splitlines(), 1) if "builtin:tiny-llama" in row)
    (tmp_path / "not-a-model").mkdir()
    for path, expected in [
        ("builtin:tiny-lama", "unknown builtin model 'tiny-lama' (did you mean 'tiny-llama'?)"),
        ("no/such/dir/", "model directory 'no/such/dir/' not found"),
        ("not-a-model", f"model directory {tmp_path / 'not-a-model'} has no config.json"),
    ]:
        pipeline = tmp_path / "pipeline.yaml"
        pipeline.write_text(text.replace("builtin:tiny-llama", path, 1))
        result = _flowrl(command, str(pipeline), cwd=tmp_path)
        _assert_user_error(result, f"{pipeline}:{line}: models.", f".path: {expected}")


def test_plan_refuses_a_model_it_cannot_size_at_its_line(tmp_path: Path) -> None:
    text = (ROOT / "pipelines" / "grpo_tiny.yaml").read_text()
    line = next(number for number, row in enumerate(text.splitlines(), 1) if "builtin:tiny-llama" in row)
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(text.replace("builtin:tiny-llama", "no/such/dir", 1))
    result = _flowrl("plan", str(pipeline), "--devices", str(ROOT / "devices" / "h200-8x.yaml"), cwd=tmp_path)
    _assert_user_error(result, f"{pipeline}:{line}: models.", ".path: cannot size model 'no/such/dir' for planning",
                       f"looked at {tmp_path / 'no/such/dir/config.json'}")


def test_data_a_run_refuses_as_it_starts_is_placed_at_its_field_and_plan_still_plans(tmp_path: Path) -> None:
    """The run reads the data after its workers start: the error still names the field's line
    (the data section's, for the default prompt key the file does not set), and the log does
    not say a step ran. A plan needs only the prompts' length: it plans with a default."""
    text = (ROOT / "pipelines" / "grpo_tiny.yaml").read_text().replace("builtin:digits", "q.jsonl")
    line = next(number for number, row in enumerate(text.splitlines(), 1) if "q.jsonl" in row)
    (tmp_path / "q.jsonl").write_text('{"question": "ab=", "answer": "1"}\n')
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(text)
    result = _flowrl("run", str(pipeline), "--plain", "-o", str(tmp_path / "out"), cwd=tmp_path)
    _assert_user_error(result, "[event] stopped before any step finished (the reason follows)",
                       f"{pipeline}:{line}: data.prompt_key: q.jsonl has no column 'prompt' (columns: question, answer)")
    planned = _flowrl("plan", str(pipeline), "--devices", str(ROOT / "devices" / "h200-8x.yaml"), "--json", cwd=tmp_path)
    assert planned.returncode == 0, planned.stdout + planned.stderr
    assert json.loads(planned.stdout)["iteration_s"] > 0


def test_a_reader_that_goes_away_does_not_stop_the_run(tmp_path: Path) -> None:
    """`flowrl run ... | head -3`: the pipe closes after three lines; the run trains on, its
    files keep every step."""
    output = tmp_path / "out"
    process = subprocess.Popen([FLOWRL, "run", str(ROOT / "pipelines" / "grpo_tiny.yaml"), "--steps", "6", "-o", str(output)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    process.stdout.readline()
    process.stdout.close()
    _, errors = process.communicate(timeout=120)
    assert process.returncode == 0, errors
    assert "Traceback" not in errors and "BrokenPipe" not in errors, errors
    assert len((output / "metrics.jsonl").read_text().splitlines()) == 6
    assert (output / "final" / "model.safetensors").is_file()


def test_a_run_s_config_yaml_validates_from_any_folder(tmp_path: Path) -> None:
    """Its relative data and reward paths are read from the pipeline file's folder, which
    run.json records."""
    project, output, elsewhere = tmp_path / "project", tmp_path / "out", tmp_path / "elsewhere"
    for folder in (project, output, elsewhere):
        folder.mkdir()
    (project / "train.jsonl").write_text('{"prompt": "ab=", "answer": "1"}\n')
    (project / "my_rewards.py").write_text("def correct(completions, **kwargs):\n    return [0.0] * len(completions)\n")
    text = (ROOT / "pipelines" / "grpo_tiny.yaml").read_text()
    text = text.replace("fn: digits,", "fn: 'my_rewards:correct',").replace("builtin:digits", "train.jsonl")
    assert "train.jsonl" in text and "my_rewards:correct" in text
    (output / "config.yaml").write_text(text)
    result = _flowrl("validate", str(output / "config.yaml"), cwd=elsewhere)
    _assert_user_error(result, "data source 'train.jsonl' not found")  # no run.json: the file's own folder
    (output / "run.json").write_text(json.dumps({"base_dir": str(project), "finished_steps": None}))
    result = _flowrl("validate", str(output / "config.yaml"), cwd=elsewhere)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_column_missing_from_data_named_on_the_command_line_is_placed_at_that_argument(tmp_path: Path) -> None:
    """No key was set for the column (the default 'prompt'): the override that named the data
    is the mistake's place, not the file's eval section."""
    held_out = tmp_path / "held.jsonl"
    held_out.write_text('{"question": "2+2="}\n')
    result = _flowrl("validate", "pipelines/grpo_arith.yaml", f"eval.source={held_out}", "eval.split=train")
    _assert_user_error(result, f"command line: eval.source={held_out}: eval.prompt_key: {held_out} has no column "
                               "'prompt' (columns: question)")


def test_adapter_targets_the_model_lacks_are_found_by_validate_at_their_line(tmp_path: Path) -> None:
    """The targets are checked on the model built from its config (no weights), before any
    worker starts: a typo beside a right name, the output head, a norm."""
    text = (ROOT / "pipelines" / "grpo_tiny.yaml").read_text().replace(
        "  actor:     {path: builtin:tiny-llama, device_group: actor_group}",
        "  actor:     {path: builtin:tiny-llama, device_group: actor_group, lora: {target_modules: [q_proj, vproj]}}")
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(text)
    line = 1 + text.splitlines().index(next(row for row in text.splitlines() if "vproj" in row))
    _assert_user_error(_flowrl("validate", str(pipeline)),
                       f"{pipeline}:{line}: models.actor.lora.target_modules: ['vproj'] match no module of 'actor'; its "
                       "linear layers are named ['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', "
                       "'v_proj'], or write all-linear")
    _assert_user_error(_flowrl("run", str(pipeline), "models.actor.lora.target_modules=[lm_head]", "-o",
                               str(tmp_path / "out")), "'lm_head' is the output head of 'actor'")


def test_the_help_shows_on_off_options_without_a_value() -> None:
    """typer wrote `--plain <bool>`, which reads as if the option took a value."""
    from typer.testing import CliRunner

    from flowrl.cli import main as cli

    result = CliRunner().invoke(cli.app, ["run", "--help"], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    rows = {line.split()[1]: line for line in result.output.splitlines() if line.startswith("│ --")}
    for flag in ("--plain", "--resume", "--force", "--overwrite"):
        assert "<bool>" not in rows[flag], rows[flag]
    assert "<int range>" in rows["--steps"]  # options that take a value still say what
