"""flowrl vs TRL's GRPOTrainer: the same GRPO job, one after the other, on this machine.

    python benchmarks/vs_trl.py --steps 60 --configs default,small-32tok --repeats 1

Each run is a child process started from here, one at a time (never two at once: the
numbers are wall-clock times on a small machine): ``_flowrl_runner.py`` calls
``flowrl.api.run.run`` with its default local Dask cluster, ``_trl_runner.py`` runs
``trl.GRPOTrainer``. Both get the same builtin Llama weights and character tokenizer, the
same prompts in the same order (flowrl's ``PromptSource`` for ``builtin:digits``), the
``digits`` reward and the same hyper-parameters (see ``job_for``). While a child runs, a
thread here sums the resident memory of the child and all its descendants (for flowrl:
the driver and every Dask worker) every 0.2 s.

Reported per framework and config: seconds per step (median, p10-p90, IQR; the first
``WARMUP_STEPS`` steps of each run left out), completion tokens per second, peak memory,
start-up time, the mean-reward curve; per config the ratio flowrl / TRL of the median
seconds per step with a bootstrap interval. The table is printed; everything, with the
machine's description, is written as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_OUTPUT = HERE / "results" / "vs_trl.json"

CONFIGS: dict[str, dict[str, Any]] = {
    "default": {"model": "tiny-llama", "max_new_tokens": 16},
    "small-32tok": {"model": "small-llama", "max_new_tokens": 32},
}
"""Config name -> builtin model (``builtin_model_dir`` name) and completion length in tokens."""


def job_for(config: str, steps: int, seed: int, layout: str = "planned") -> dict[str, Any]:
    """Everything both runners need to run the same job."""
    return {
        "config": config,
        **CONFIGS[config],
        "steps": steps,
        "seed": seed,
        "prompts_per_step": 4,
        "num_generations": 8,
        "temperature": 1.0,
        "top_p": 1.0,
        "lr": 5e-4,
        "betas": [0.9, 0.999],
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "epsilon": 0.2,
        "beta": 0.02,
        "advantage_epsilon": 1e-4,
        "cpu_slots": 2,
        "layout": layout,
    }


def run_child(framework: str, job: dict[str, Any]) -> dict[str, Any]:
    """Run one job in a child process; its result dict, or one with an ``error``."""
    from _process_tree import TreeMemorySampler

    runner = HERE / f"_{framework}_runner.py"
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as scratch:
        result_path = Path(scratch) / "result.json"
        started = time.perf_counter()
        launched_unix = time.time()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        process = subprocess.Popen([sys.executable, str(runner), json.dumps(job), str(result_path)], cwd=REPO, env=env)
        with TreeMemorySampler(process.pid) as sampler:
            # wait4 (not wait) for the rusage: CPU time of the child and of every descendant
            # it reaped (the Dask workers), the measured tree's share of the machine.
            _, status, usage = os.wait4(process.pid, 0)
            process.returncode = returncode = os.waitstatus_to_exitcode(status)
        sampler.finish(usage.ru_utime + usage.ru_stime)
        wall_s = time.perf_counter() - started
        if returncode != 0 or not result_path.exists():
            return {"framework": framework, "error": f"{runner.name} exited with code {returncode}", "wall_s": wall_s}
        result = json.loads(result_path.read_text())
    result["process_tree"] = sampler.to_dict()
    result["process_wall_s"] = wall_s
    # Launch of the child to its first step: interpreter, imports, models, cluster.
    if result.get("first_step_start_unix"):
        result["launch_to_first_step_s"] = result["first_step_start_unix"] - launched_unix
    return result


def build_weights(models: list[str]) -> None:
    """Write the builtin models' cached weights before any timed run, in a process of its
    own: neither runner then builds them, and neither this process nor flowrl's driver
    imports transformers for it."""
    code = "import sys\nfrom flowrl.backends.builtin import builtin_model_dir\nfor name in sys.argv[1:]: builtin_model_dir(name)"
    subprocess.run([sys.executable, "-c", code, *models], cwd=REPO, check=True)


def machine() -> dict[str, Any]:
    import psutil

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    cpu_model = None
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    commit, dirty = commit_state()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": cpu_model,
        "cpu_count_logical": os.cpu_count(),
        "cpu_count_physical": psutil.cpu_count(logical=False),
        "memory_total_gib": psutil.virtual_memory().total / 2**30,
        "versions": {name: version(name) for name in ("flowrl", "torch", "transformers", "trl", "accelerate", "peft", "datasets", "dask", "distributed")},
        "flowrl_commit": commit or None,
        "flowrl_uncommitted_files": dirty,
    }


def commit_state() -> tuple[str | None, list[str]]:
    """The commit checked out and the files of flowrl/ and benchmarks/ that differ from it.

    ``FLOWRL_GIT_DIR`` names a copy of the repository's git folder, for a copy of the
    working tree that travelled without its own (or with a stale one).
    """
    git = ["git"]
    if os.environ.get("FLOWRL_GIT_DIR"):
        git += [f"--git-dir={os.environ['FLOWRL_GIT_DIR']}", f"--work-tree={REPO}"]
    commit = subprocess.run([*git, "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    # Uncommitted changes: the numbers belong to the working tree, not the commit.
    status = subprocess.run([*git, "status", "--porcelain", "--", "flowrl", "benchmarks"], cwd=REPO,
                            capture_output=True, text=True).stdout.splitlines()
    dirty = [line[3:] for line in status if not line[3:].startswith("benchmarks/results/")]
    return commit or None, dirty


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="training steps per run (default 60)")
    parser.add_argument("--configs", default="default,small-32tok", help=f"comma-separated, from: {', '.join(CONFIGS)}")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each framework and config (default 1)")
    parser.add_argument("--flowrl-layout", choices=["planned", "separate", "colocated"], default="planned",
                        help="flowrl's placement: the planner's choice for the default pipeline's two groups "
                             "(default), the reference forced onto a worker of its own, or one group for both")
    parser.add_argument("--trl-threads", type=int, default=None,
                        help="torch threads of the TRL process (default: torch's, one per core)")
    parser.add_argument("--seed", type=int, default=0, help="seed of both frameworks and of the bootstrap (default 0)")
    parser.add_argument("--max-wait-idle", type=float, default=300.0,
                        help="before each run, wait up to this many seconds for other work on the machine to stop (default 300)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON file to write (default benchmarks/results/vs_trl.json)")
    args = parser.parse_args(argv)
    args.configs = [name.strip() for name in args.configs.split(",") if name.strip()]
    unknown = [name for name in args.configs if name not in CONFIGS]
    if unknown:
        parser.error(f"unknown config(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    if args.steps <= 3:
        parser.error("--steps must be more than the 3 warm-up steps")
    return args


def main(argv: list[str] | None = None) -> None:
    from _process_tree import wait_for_quiet
    from _vs_trl_report import WARMUP_STEPS, after_warmup, print_tables, ratio_of_medians, summarize

    args = parse_args(argv)
    results: dict[str, Any] = {
        "benchmark": "vs_trl",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "steps": args.steps,
        "repeats": args.repeats,
        "warmup_steps": WARMUP_STEPS,
        "machine": machine(),
        "configs": {},
        "notes": [],
    }
    build_weights(sorted({CONFIGS[config]["model"] for config in args.configs}))
    total = len(args.configs) * args.repeats * 2
    done = 0
    for config in args.configs:
        job = {**job_for(config, args.steps, args.seed, args.flowrl_layout), "trl_threads": args.trl_threads}
        runs: dict[str, list[dict[str, Any]]] = {"flowrl": [], "trl": []}
        for repeat in range(args.repeats):
            for framework in ("flowrl", "trl"):
                done += 1
                print(f"[{done}/{total}] {framework} {config} (repeat {repeat + 1}/{args.repeats}, {args.steps} steps) ...", flush=True)
                waited_s = wait_for_quiet(args.max_wait_idle)
                result = run_child(framework, job)
                result["waited_for_idle_s"] = waited_s
                if "error" in result:
                    print(f"    failed: {result['error']}", flush=True)
                    results["notes"].append(f"{framework} {config} repeat {repeat + 1}: {result['error']}")
                else:
                    print(f"    done in {result['process_wall_s']:.1f} s", flush=True)
                runs[framework].append(result)
        entry: dict[str, Any] = {"job": job}
        for framework, framework_runs in runs.items():
            good = [run for run in framework_runs if "error" not in run]
            entry[framework] = {"summary": summarize(good) if good else None, "runs": framework_runs}
        good_flowrl = [run for run in runs["flowrl"] if "error" not in run]
        good_trl = [run for run in runs["trl"] if "error" not in run]
        entry["ratio_flowrl_over_trl"] = ratio_of_medians(
            after_warmup(good_flowrl, "step_s"), after_warmup(good_trl, "step_s"), args.seed
        )
        for run in good_trl:
            if not run["settings"].get("prompt_order_matches_flowrl"):
                results["notes"].append(f"trl {config}: the prompts TRL scored are not flowrl's, in flowrl's order")
        results["configs"][config] = entry

    results["notes"].extend(NOTES)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=1, default=str))
    print_tables(results)
    print(f"wrote {args.output}")


NOTES = [
    "s/step: flowrl timing_s/step (run_step wall time: all nodes of one step); "
    "TRL on_step_begin -> on_step_end (generation, reward, reference, loss, backward, optimizer step).",
    "loop s/step: end of one step to the end of the next (adds flowrl's device sampling and metric files, TRL's logging).",
    "TRL loss_type='bnpo' = sum of per-token loss (policy + beta*k3) over the batch / number of completion tokens "
    "in the batch; with one process and gradient_accumulation_steps=1 that is flowrl's token_mean.",
    "KL: TRL runs with use_bias_correction_kl=False (its 1.16 default True multiplies k3 by the importance ratio, "
    "which changes the KL gradient even on-policy); with it off, both apply plain k3 (on one batch the two "
    "gradients agree to 1e-7 relative).",
    "KL: flowrl clamps the k3 log-ratio to [-20, 20]; TRL does not clamp. Sampling RNG streams differ, "
    "so the completions (and reward curves) are not identical draws.",
    "other load: CPU time used by processes outside the measured ones during the run, as a share of "
    "all CPUs' wall time; above a few percent the times are inflated by other work on the machine.",
    "peak RSS sums processes (shared library pages counted once per process); PSS splits shared pages.",
]


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
