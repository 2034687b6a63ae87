"""A pipeline's update through a one-rank NCCL group against the same update without a group.

    python benchmarks/nccl_one_rank.py --pipelines pipelines/grpo_tiny_gpu.yaml,pipelines/grpo_0.4b_gpu.yaml \
        --output benchmarks/results/nccl_one_rank_h200.json

What a data-parallel update over GPUs adds to a step, measured where only one GPU is: per
pipeline, its actor is loaded as a run loads it (``ModelState.load``: its path, dtype and
gradient checkpointing, on ``cuda``), and its ``train`` node's update (``update_policy``: the
node's learning rate, micro-batches, KL term) runs on a rollout of the pipeline's shape
(``data.batch_size`` prompts x the generate node's ``n``, prompts of ``--prompt-tokens``
random tokens, ``max_new_tokens`` completion tokens each, every token real), alternately
without a group and as rank 0 of a one-rank NCCL group (``DeviceGroup``: the gradient
buckets all-reduced over NCCL while the last backward runs, the numbers summed through it
too). Each of the two trains its own copy of the actor, loaded alike: as in a run, the group's
copy keeps its buckets from one update to the next, and the other never carries them (the
peak memory holds both). One warm-up update of each, then ``--repeats`` rounds of one sample of each, the two taking
turns at going first; a sample is as many updates in a row as take about ``--min-sample-s``
(one for the 0.4B model; a few-millisecond update alone is mostly noise). ``--device cpu`` runs
the same over gloo, to check the program on a machine without a GPU. Reported: seconds
per update of each (median and all), the ratio of the medians and each round's own ratio
(with their median), and the group's own time (blocked_s).

Writes JSON with the commit measured; never asserts.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from vs_trl import machine  # noqa: E402


def rollout_of(pipeline: Any, prompt_tokens: int, vocab: int, seed: int) -> Any:
    import torch

    from flowrl.roles.batch import Rollout
    from flowrl.spec.schema import GenerateNode

    spec = pipeline.spec
    generate = next(node for node in spec.nodes.values() if isinstance(node, GenerateNode))
    rows = spec.data.batch_size * generate.n
    generator = torch.Generator().manual_seed(seed)
    completion = torch.randint(3, vocab, (rows, generate.max_new_tokens), generator=generator)
    return Rollout(
        prompt_ids=torch.randint(3, vocab, (rows, prompt_tokens), generator=generator),
        prompt_mask=torch.ones(rows, prompt_tokens, dtype=torch.long),
        completion_ids=completion, completion_mask=torch.ones_like(completion),
        group_size=generate.n, prompts=[""] * rows, completions=[""] * rows, answers=[None] * rows,
        max_new_tokens=generate.max_new_tokens, temperature=generate.temperature,
    )


def measure(path: Path, repeats: int, prompt_tokens: int, device: str, min_sample_s: float) -> dict[str, Any]:
    import torch

    from flowrl.roles.data_parallel import DataParallel
    from flowrl.roles.state import ModelState
    from flowrl.roles.update import update_policy
    from flowrl.runtime.collective import DeviceGroup, free_port
    from flowrl.spec.loader import load_pipeline
    from flowrl.spec.schema import UpdateNode

    pipeline = load_pipeline(path)
    spec = pipeline.spec
    name, node = next((n, node) for n, node in spec.nodes.items() if isinstance(node, UpdateNode))
    model = spec.models[node.model]
    states = {variant: ModelState.load(node.model, model.path, dtype=model.dtype, device=device, seed=0,
                                       base_dir=path.parent, gradient_checkpointing=model.gradient_checkpointing)
              for variant in ("no_group", "one_rank_group")}
    vocab = int(states["no_group"].module.get_input_embeddings().weight.shape[0])
    rollout = rollout_of(pipeline, prompt_tokens, vocab, seed=0)
    rows = rollout.num_sequences
    advantages = torch.randn(rows, generator=torch.Generator().manual_seed(1))
    reference = torch.zeros(rollout.completion_ids.shape) if node.kl_coef > 0 else None
    group = DeviceGroup("127.0.0.1", free_port("127.0.0.1"), 0, 1, timeout_s=120, device=device)
    cuda = device == "cuda"
    times: dict[str, list[float]] = {"no_group": [], "one_rank_group": []}
    blocked: list[float] = []
    def sample(variant: str, updates: int) -> tuple[float, float]:
        """Seconds per update and seconds blocked in the group per update, over ``updates``
        updates in a row."""
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        waited = 0.0
        for _ in range(updates):
            # one DataParallel per update, as a run makes one per call of the node
            dp = DataParallel(group, (1.0,)) if variant == "one_rank_group" else None
            update_policy(states[variant], rollout, advantages, reference, node, seed=0, dp=dp)
            waited += dp.blocked_s if dp is not None else 0.0
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - started) / updates, waited / updates

    inner = 1
    for round_ in range(repeats + 1):
        # the two variants take turns at going first, so that neither always follows the other
        order = list(times) if round_ % 2 == 0 else list(reversed(times))
        for variant in order:
            elapsed, waited = sample(variant, inner)
            if round_ > 0:  # round 0 warms both up (compilation, the optimizer's state)
                times[variant].append(elapsed)
                if variant == "one_rank_group":
                    blocked.append(waited)
        if round_ == 0:
            # A short update is timed over several in a row (one of a few ms is mostly noise),
            # as many as the faster variant takes about min_sample_s for, sized from one more
            # update of each after the warm-up (whose first one sets up kernels and NCCL).
            settled = min(sample(variant, 1)[0] for variant in times)
            inner = max(1, math.ceil(min_sample_s / max(settled, 1e-6)))
    medians = {variant: statistics.median(values) for variant, values in times.items()}
    # each round's own ratio: slow drifts of the machine cancel within a round
    per_round = [grouped / plain for grouped, plain in zip(times["one_rank_group"], times["no_group"])]
    return {
        "pipeline": str(path.relative_to(HERE.parent)) if path.is_relative_to(HERE.parent) else str(path),
        "update_node": name,
        "model": model.path,
        "dtype": model.dtype,
        "rows": rows,
        "tokens_per_row": prompt_tokens + rollout.max_new_tokens,
        "updates_per_sample": inner,
        "backend": group.backend,
        "seconds_per_update": times,
        "median_s": medians,
        "group_over_no_group": medians["one_rank_group"] / medians["no_group"],
        "group_over_no_group_per_round": per_round,
        "median_of_round_ratios": statistics.median(per_round),
        "group_blocked_s": blocked,
        "peak_gpu_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipelines", default="pipelines/grpo_tiny_gpu.yaml,pipelines/grpo_0.4b_gpu.yaml")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--prompt-tokens", type=int, default=9)
    parser.add_argument("--min-sample-s", type=float, default=0.25,
                        help="each timed sample runs as many updates in a row as take about this long")
    parser.add_argument("--device", default="cuda", help="cuda (an NCCL group), or cpu (gloo: checks the program)")
    parser.add_argument("--output", type=Path, default=HERE / "results" / "nccl_one_rank.json")
    args = parser.parse_args()
    results = []
    for item in args.pipelines.split(","):
        path = Path(item) if Path(item).is_absolute() else HERE.parent / item
        result = measure(path, args.repeats, args.prompt_tokens, args.device, args.min_sample_s)
        results.append(result)
        shown = ("pipeline", "backend", "median_s", "group_over_no_group", "median_of_round_ratios")
        print(json.dumps({key: result[key] for key in shown}), flush=True)
    report = {"benchmark": "nccl_one_rank", "machine": machine(), "repeats": args.repeats, "results": results}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1) + "\n")
    print(f"written: {args.output}")


if __name__ == "__main__":
    main()
