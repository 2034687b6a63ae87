"""The README's quick start against TRL, whole process: the wall time a user waits.

    python benchmarks/quickstart.py --repeats 3

Alternates, ``--repeats`` times each, two commands on this machine (never two at once):

- flowrl: ``flowrl run pipelines/grpo_tiny.yaml --plain -o TMP``, the quick start's own
  command (120 steps of GRPO on ``builtin:tiny-llama``, 4 prompts x 8 completions of 16
  tokens), in a terminal-less child process;
- TRL: ``_trl_runner.py`` with the same job (``vs_trl.job_for("default", steps)``: same
  weights, tokenizer, prompts in the same order, reward and hyper-parameters), in one process.

Each run is timed from the start of its process to its exit (interpreter start, imports,
cluster or trainer, every step, saving, shutdown), with the peak PSS of its process tree.
Per pair the ratio flowrl / TRL; the summary gives the medians and the ratio of medians.
Writes JSON with the commit measured (and any uncommitted files).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_OUTPUT = HERE / "results" / "quickstart.json"
PIPELINE = "pipelines/grpo_tiny.yaml"


def flowrl_command(output_dir: str, steps: int) -> list[str]:
    """The quick start's command (``.venv/bin/flowrl run pipelines/grpo_tiny.yaml``) with a
    scratch output folder; ``--plain`` is what it prints without a terminal anyway."""
    executable = Path(sys.executable).parent / "flowrl"
    command = [str(executable), "run", PIPELINE, "--plain", "-o", output_dir]
    return command if steps == 120 else [*command, "--steps", str(steps)]


def timed(command: list[str], log_path: Path) -> dict[str, Any]:
    """Run ``command`` from the repository root; wall time to its exit and its tree's memory."""
    from _process_tree import TreeMemorySampler

    with log_path.open("w") as log:
        started = time.perf_counter()
        process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
        with TreeMemorySampler(process.pid) as sampler:
            _, status, usage = os.wait4(process.pid, 0)
        wall_s = time.perf_counter() - started
    sampler.finish(usage.ru_utime + usage.ru_stime)
    returncode = os.waitstatus_to_exitcode(status)
    result: dict[str, Any] = {"wall_s": wall_s, "returncode": returncode, "process_tree": sampler.to_dict()}
    if returncode != 0:
        result["error"] = f"exited with code {returncode}: {log_path.read_text()[-2000:]}"
    return result


def run_flowrl(steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="quickstart-flowrl-") as scratch:
        result = timed(flowrl_command(str(Path(scratch) / "out"), steps), Path(scratch) / "log.txt")
        lines = (Path(scratch) / "log.txt").read_text().splitlines() if "error" not in result else []
    result["last_lines"] = lines[-3:]
    return result


def run_trl(job: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="quickstart-trl-") as scratch:
        result_path = Path(scratch) / "result.json"
        command = [sys.executable, str(HERE / "_trl_runner.py"), json.dumps(job), str(result_path)]
        result = timed(command, Path(scratch) / "log.txt")
        if "error" not in result and result_path.exists():
            inner = json.loads(result_path.read_text())
            reward = inner.get("reward_mean") or []
            result["reward_first10_last10"] = [statistics.fmean(reward[:10]), statistics.fmean(reward[-10:])] if reward else None
    return result


def main(argv: list[str] | None = None) -> None:
    from _process_tree import wait_for_quiet
    from vs_trl import build_weights, job_for, machine

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each command, alternating (default 3)")
    parser.add_argument("--steps", type=int, default=120, help="training steps (default 120, the quick start's)")
    parser.add_argument("--max-wait-idle", type=float, default=300.0,
                        help="before each run, wait up to this many seconds for other work on the machine to stop")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON file to write")
    args = parser.parse_args(argv)

    job = job_for("default", args.steps, 0)
    build_weights([job["model"]])
    runs: dict[str, list[dict[str, Any]]] = {"flowrl": [], "trl": []}
    for repeat in range(args.repeats):
        # Alternate which goes first, so neither always follows the other's leftovers.
        order = ("flowrl", "trl") if repeat % 2 == 0 else ("trl", "flowrl")
        for framework in order:
            waited_s = wait_for_quiet(args.max_wait_idle)
            result = run_flowrl(args.steps) if framework == "flowrl" else run_trl(job)
            result["waited_for_idle_s"] = waited_s
            result["repeat"] = repeat
            runs[framework].append(result)
            state = result.get("error") or f"{result['wall_s']:.1f} s, PSS {result['process_tree']['peak_pss_mib']:,.0f} MiB"
            print(f"[{repeat + 1}/{args.repeats}] {framework}: {state}", flush=True)

    summary: dict[str, Any] = {}
    for framework, framework_runs in runs.items():
        good = [run for run in framework_runs if "error" not in run]
        summary[framework] = {
            "wall_s_median": statistics.median(run["wall_s"] for run in good) if good else None,
            "wall_s": [run["wall_s"] for run in good],
            "peak_pss_mib_median": statistics.median(run["process_tree"]["peak_pss_mib"] for run in good) if good else None,
        }
    pairs = [f["wall_s"] / t["wall_s"] for f, t in zip(runs["flowrl"], runs["trl"]) if "error" not in f and "error" not in t]
    if summary["flowrl"]["wall_s_median"] and summary["trl"]["wall_s_median"]:
        summary["ratio_of_medians"] = summary["flowrl"]["wall_s_median"] / summary["trl"]["wall_s_median"]
        summary["pss_ratio_of_medians"] = summary["flowrl"]["peak_pss_mib_median"] / summary["trl"]["peak_pss_mib_median"]
    summary["ratio_per_pair"] = pairs
    results = {
        "benchmark": "quickstart",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "flowrl_command": " ".join(flowrl_command("TMP", args.steps)),
        "trl_job": job,
        "steps": args.steps,
        "repeats": args.repeats,
        "machine": machine(),
        "summary": summary,
        "runs": runs,
        "notes": [
            "wall_s: start of the process to its exit, everything included (imports, start-up, steps, saving, shutdown).",
            "flowrl saves the final model (trainer.output_dir/final); the TRL runner saves nothing.",
            "peak PSS: the largest sum over the process tree of proportional set sizes, sampled every 0.2 s.",
        ],
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=1, default=str))
    flowrl, trl = summary["flowrl"], summary["trl"]
    if flowrl["wall_s_median"] and trl["wall_s_median"]:
        print(f"flowrl {flowrl['wall_s_median']:.1f} s, TRL {trl['wall_s_median']:.1f} s (medians): "
              f"ratio {summary['ratio_of_medians']:.2f}, per pair {', '.join(f'{r:.2f}' for r in pairs)}")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
