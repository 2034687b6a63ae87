"""Statistics and the printed table of ``vs_trl.py``: plain numbers in, plain numbers out."""

from __future__ import annotations

from typing import Any

import numpy as np

WARMUP_STEPS = 3
"""Steps left out of every timing statistic at the start of each run (imports, caches, allocator)."""

BOOTSTRAP_RESAMPLES = 1000
CURVE_WINDOW = 10
"""Steps averaged for the 'first' and 'last' reward of a curve."""


def timing_summary(values: list[float]) -> dict[str, float]:
    """Median and spread of per-step seconds (already without warm-up)."""
    if not values:
        return {"n": 0}
    x = np.asarray(values, dtype=float)
    p10, q25, median, q75, p90 = np.percentile(x, [10, 25, 50, 75, 90])
    return {
        "n": int(x.size),
        "median": float(median),
        "mean": float(x.mean()),
        "p10": float(p10),
        "p90": float(p90),
        "q25": float(q25),
        "q75": float(q75),
        "iqr": float(q75 - q25),
        "min": float(x.min()),
        "max": float(x.max()),
    }


def after_warmup(runs: list[dict[str, Any]], key: str) -> list[float]:
    """``key``'s per-step values of every run, pooled, each run without its warm-up steps."""
    pooled: list[float] = []
    for run in runs:
        values = run.get(key) or []
        pooled.extend(float(v) for v in values[WARMUP_STEPS:] if v is not None)
    return pooled


def mean_curve(runs: list[dict[str, Any]], key: str = "reward_mean") -> list[float]:
    """The per-step mean over repeats (repeats of one job have the same number of steps)."""
    curves = [run[key] for run in runs if run.get(key)]
    if not curves:
        return []
    length = min(len(c) for c in curves)
    return [float(np.mean([c[i] for c in curves])) for i in range(length)]


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Everything reported for one (framework, config) from its repeats."""
    step_s = after_warmup(runs, "step_s")
    tokens = after_warmup(runs, "completion_tokens")
    curve = mean_curve(runs)
    summary: dict[str, Any] = {
        "step_s": timing_summary(step_s),
        "loop_step_s": timing_summary(after_warmup(runs, "loop_step_s")),
        # tokens and times of the same steps (both lists drop the same warm-up steps)
        "completion_tokens_per_s": sum(tokens) / sum(step_s) if step_s and len(tokens) == len(step_s) else None,
        "completion_tokens_per_step": float(np.mean(tokens)) if tokens else None,
        "peak_rss_mib": max((run["process_tree"]["peak_rss_mib"] for run in runs), default=None),
        "peak_pss_mib": max((run["process_tree"]["peak_pss_mib"] for run in runs), default=None),
        "max_processes": max((run["process_tree"]["max_processes"] for run in runs), default=None),
        "foreign_cpu_share_max": max((run["process_tree"]["foreign_cpu_share"] for run in runs), default=None),
        "startup_s": float(np.median([run["startup_s"] for run in runs])),
        "launch_to_first_step_s": float(np.median([run.get("launch_to_first_step_s", np.nan) for run in runs])),
        "reward_curve": curve,
        "reward_first10": float(np.mean(curve[:CURVE_WINDOW])) if curve else None,
        "reward_last10": float(np.mean(curve[-CURVE_WINDOW:])) if curve else None,
        "step_medians_per_repeat": [timing_summary(run["step_s"][WARMUP_STEPS:]).get("median") for run in runs],
    }
    if runs and runs[0]["framework"] == "flowrl":
        summary["node_s_median"] = {
            name: timing_summary(after_warmup([r["metrics"] for r in runs], name)).get("median")
            for name in sorted(runs[0]["metrics"])
            if name.startswith("timing_s/") and name != "timing_s/step"
        }
        # The step's critical path is rollout -> max(ref, reward + adv) -> train; the rest of
        # timing_s/step is dispatch: Dask actor calls, batch transfers between workers.
        overhead = []
        for run in runs:
            m = run["metrics"]
            for i in range(WARMUP_STEPS, len(m["timing_s/step"])):
                path = m["timing_s/gen"][i] + max(m["timing_s/ref"][i], m["timing_s/reward"][i] + m["timing_s/adv"][i])
                overhead.append(m["timing_s/step"][i] - path - m["timing_s/update_actor"][i])
        summary["dispatch_overhead_s"] = timing_summary(overhead)
    if runs and runs[0]["framework"] == "trl":
        summary["generate_s_median"] = timing_summary(after_warmup(runs, "generate_s")).get("median")
        summary["ru_maxrss_mib"] = max(run["ru_maxrss_mib"] for run in runs)
    return summary


def ratio_of_medians(numerator: list[float], denominator: list[float], seed: int) -> dict[str, float] | None:
    """median(numerator) / median(denominator), with a bootstrap 95 % interval over steps."""
    if not numerator or not denominator:
        return None
    a = np.asarray(numerator, dtype=float)
    b = np.asarray(denominator, dtype=float)
    rng = np.random.default_rng(seed)
    draws_a = rng.choice(a, size=(BOOTSTRAP_RESAMPLES, a.size), replace=True)
    draws_b = rng.choice(b, size=(BOOTSTRAP_RESAMPLES, b.size), replace=True)
    ratios = np.median(draws_a, axis=1) / np.median(draws_b, axis=1)
    low, high = np.percentile(ratios, [2.5, 97.5])
    return {
        "ratio": float(np.median(a) / np.median(b)),
        "ci95_low": float(low),
        "ci95_high": float(high),
        "resamples": BOOTSTRAP_RESAMPLES,
        "seed": seed,
    }


def print_tables(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    def num(value: Any, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    table = Table(title=f"flowrl vs TRL GRPOTrainer ({results['steps']} steps, first {WARMUP_STEPS} left out of timings)")
    for column in ("config", "framework", "s/step med", "p10-p90", "IQR", "loop s/step", "tok/s",
                   "RSS MiB", "PSS MiB", "start s", "to 1st step s", "reward 1st10->last10", "other load"):
        table.add_column(column, justify="left" if column in ("config", "framework") else "right")
    for config, entry in results["configs"].items():
        for framework in ("flowrl", "trl"):
            s = entry.get(framework, {}).get("summary")
            if s is None:
                table.add_row(config, framework, "failed", *[""] * 11)
                continue
            t = s["step_s"]
            table.add_row(
                config, framework,
                num(t.get("median"), ".4f"),
                f"{num(t.get('p10'), '.4f')}-{num(t.get('p90'), '.4f')}",
                num(t.get("iqr"), ".4f"),
                num(s["loop_step_s"].get("median"), ".4f"),
                num(s["completion_tokens_per_s"], ",.0f"),
                num(s["peak_rss_mib"], ",.0f"),
                num(s["peak_pss_mib"], ",.0f"),
                num(s["startup_s"], ".1f"),
                num(s["launch_to_first_step_s"], ".1f"),
                f"{num(s['reward_first10'], '.3f')} -> {num(s['reward_last10'], '.3f')}",
                num(s["foreign_cpu_share_max"], ".0%"),
            )
    ratios = Table(title="flowrl / TRL, median seconds per step (bootstrap over steps, 95 %)")
    for column in ("config", "ratio", "2.5 %", "97.5 %"):
        ratios.add_column(column, justify="left" if column == "config" else "right")
    for config, entry in results["configs"].items():
        r = entry.get("ratio_flowrl_over_trl")
        if r is None:
            ratios.add_row(config, "-", "-", "-")
        else:
            ratios.add_row(config, f"{r['ratio']:.2f}", f"{r['ci95_low']:.2f}", f"{r['ci95_high']:.2f}")
    console = Console(width=max(Console().width, 180))
    console.print(table)
    console.print(ratios)
    for note in results.get("notes", []):
        console.print(f"- {note}")
