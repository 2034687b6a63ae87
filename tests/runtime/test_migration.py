"""Moving roles between workers mid-run: what is sent, and that training does not notice."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowrl.graph import PipelineGraph
from flowrl.planner.placement import Plan, plan_for
from flowrl.runtime.cluster import Cluster
from flowrl.runtime.migration import Transfer, plan_transfers
from flowrl.runtime.session import Session
from flowrl.data import PromptSource
from tests.integration.conftest import tiny_grpo

ALL_ON_0 = {"rollout": "cpu-0", "reward": "cpu-0", "ref": "cpu-1", "adv": "cpu-0", "train": "cpu-0"}
SPLIT = {"rollout": "cpu-1", "reward": "cpu-1", "ref": "cpu-0", "adv": "cpu-0", "train": "cpu-0"}
SWAPPED = {"rollout": "cpu-1", "reward": "cpu-1", "ref": "cpu-0", "adv": "cpu-1", "train": "cpu-1"}


def graph(tmp_path: Path, lora: bool = False) -> PipelineGraph:
    pipeline = tiny_grpo(tmp_path / "out", steps=6, lr=5e-3 if lora else 5e-4)
    if not lora:
        return pipeline.build()
    spec = pipeline.to_dict()
    spec["models"]["actor"]["lora"] = {"rank": 4}  # moves carry the adapters alone
    from flowrl.spec.loader import pipeline_from_dict

    return pipeline_from_dict(spec)


def test_moving_the_whole_actor_pulls_weights_optimizer_and_rng_from_its_old_worker(tmp_path: Path) -> None:
    pipeline = graph(tmp_path)
    transfers = plan_transfers(pipeline, plan_for(pipeline, ALL_ON_0), plan_for(pipeline, SWAPPED))
    assert transfers == [
        Transfer("actor", "cpu-1", (("cpu-0", ("weights", "optimizer", "generator")),)),
        # never trained: loaded from its path on the new worker, nothing sent
        Transfer("reference", "cpu-0", ()),
    ]


def test_splitting_generate_from_update_sends_only_what_each_side_lacks(tmp_path: Path) -> None:
    pipeline = graph(tmp_path)
    transfers = plan_transfers(pipeline, plan_for(pipeline, ALL_ON_0), plan_for(pipeline, SPLIT))
    # cpu-0 keeps the actor and its update: nothing to send there. cpu-1 gets a generating
    # copy: current weights and the sampling RNG, no optimizer.
    assert transfers == [
        Transfer("actor", "cpu-1", (("cpu-0", ("weights", "generator")),)),
        Transfer("reference", "cpu-0", ()),
    ]
    # and back from the split to both on cpu-1: cpu-1 already holds current weights (pushed
    # after each update) and the RNG; it lacks only the optimizer
    back = plan_transfers(pipeline, plan_for(pipeline, SPLIT), plan_for(pipeline, SWAPPED))
    assert back == [Transfer("actor", "cpu-1", (("cpu-0", ("optimizer",)),))]


def test_an_unchanged_plan_sends_nothing(tmp_path: Path) -> None:
    pipeline = graph(tmp_path)
    assert plan_transfers(pipeline, plan_for(pipeline, ALL_ON_0), plan_for(pipeline, ALL_ON_0)) == []


COMPARED = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/kl_loss", "actor/loss", "actor/grad_norm")


def started(cluster: Cluster, pipeline: PipelineGraph, plan: Plan) -> Session:
    """A session on ``plan`` with its models loaded."""
    session = Session(cluster, pipeline, plan, None)
    session.load_models()
    return session


def _train(session: Session, pipeline: PipelineGraph, steps: range, moves: dict[int, dict[str, str]]) -> list[dict[str, float]]:
    source = PromptSource("builtin:digits", batch_size=4, seed=0, base_dir=Path.cwd())
    curve = []
    for step in steps:
        if step in moves:
            result = session.apply_plan(plan_for(pipeline, moves[step], step))
            assert result.seconds > 0
        reports = session.run_step(step, source.next_batch(step - 1))
        metrics: dict[str, float] = {}
        for report in reports.values():
            metrics.update(report.metrics)
        curve.append({key: metrics[key] for key in COMPARED})
    return curve


def _weights(session: Session, directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    session.save_models(directory, with_state=False)
    return load_file(str(directory / "actor" / "model.safetensors"))


@pytest.mark.integration
@pytest.mark.parametrize("lora", [False, True], ids=["whole", "adapters"])
def test_a_run_that_moves_its_roles_twice_trains_exactly_like_one_that_never_moves(tmp_path: Path, lora: bool) -> None:
    pipeline = graph(tmp_path, lora)
    cluster = Cluster.start_local(2)
    try:
        still = started(cluster, pipeline, plan_for(pipeline, ALL_ON_0))
        expected = _train(still, pipeline, range(1, 7), {})
        expected_weights = _weights(still, tmp_path / "still")

        moving = started(cluster, pipeline, plan_for(pipeline, ALL_ON_0))
        # steps 3-4: sampling moves to cpu-1 (weights + RNG), the update stays;
        # steps 5-6: the update follows it (optimizer state), the reference goes to cpu-0
        curve = _train(moving, pipeline, range(1, 7), {3: SPLIT, 5: SWAPPED})
        assert moving.plan.node_slots == SWAPPED
        moved_weights = _weights(moving, tmp_path / "moved")
        # the update goes back to cpu-0 while cpu-1 keeps generating: cpu-1 forgets the
        # optimizer it no longer steps, cpu-0 has it
        moving.apply_plan(plan_for(pipeline, SPLIT, 7))
        kept = {slot: moving.hosts[slot].export_state("actor", ("optimizer",)).result()["optimizer"]
                for slot in ("cpu-0", "cpu-1")}
        assert kept["cpu-1"] is None and kept["cpu-0"] is not None
    finally:
        cluster.close()

    for step, (want, got) in enumerate(zip(expected, curve), start=1):
        for key in COMPARED:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), f"step {step}: {key}"
    assert expected_weights.keys() == moved_weights.keys()
    for name, tensor in expected_weights.items():
        torch.testing.assert_close(moved_weights[name], tensor, rtol=1e-5, atol=1e-6)


def test_a_lost_rank_sends_nothing_and_each_generation_part_keeps_its_stream(tmp_path: Path) -> None:
    pipeline = graph(tmp_path)
    both = {"rollout": ["cpu-0", "cpu-1"], "train": ["cpu-0", "cpu-1"]}
    old = plan_for(pipeline, ALL_ON_0 | {"ref": "cpu-2"}, node_shards=both)
    # cpu-0 died before step 7; cpu-2 takes a place
    new = plan_for(pipeline, ALL_ON_0 | {"ref": "cpu-1"}, 7, node_shards={"rollout": ["cpu-1", "cpu-2"], "train": ["cpu-1", "cpu-2"]})
    transfers = plan_transfers(pipeline, old, new, alive={"cpu-1", "cpu-2"})
    actor = {t.slot: t for t in transfers if t.model == "actor"}
    # weights and optimizer from the live rank cpu-1. Part 0's stream died with cpu-0, so
    # cpu-1 (now part 0) restarts at a fresh stream (1000 x 7 + 0) instead of keeping part
    # 1's, which cpu-2 (now part 1) takes over
    assert actor["cpu-1"] == Transfer("actor", "cpu-1", (), 7000, reseed=True)
    assert actor["cpu-2"] == Transfer("actor", "cpu-2", (("cpu-1", ("weights", "optimizer", "generator")),), 1)
    # all alive: part 0's stream moves from cpu-0 to cpu-1, part 1's from cpu-1 to cpu-2
    everyone = {t.slot: t for t in plan_transfers(pipeline, old, new) if t.model == "actor"}
    assert everyone["cpu-1"].sources == (("cpu-0", ("generator",)),)
    assert everyone["cpu-2"].sources == (("cpu-0", ("weights", "optimizer")), ("cpu-1", ("generator",)))
    assert not any(t.reseed for t in everyone.values())
