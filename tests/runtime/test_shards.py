"""Data-parallel inference: a node split by rows over workers gives what one worker gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowrl.api.run import check_runnable
from flowrl.data import PromptSource
from flowrl.errors import FlowrlError
from flowrl.planner.placement import plan_for
from flowrl.roles.batch import Scores
from flowrl.roles import registry
from flowrl.roles.shards import shard_rows
from flowrl.spec.schema import ScoreNode, UpdateNode
from flowrl.runtime.cluster import Cluster
from flowrl.spec.loader import load_pipeline, pipeline_from_dict
from tests.integration.conftest import tiny_grpo
from tests.runtime.test_migration import ALL_ON_0, _train, started


def test_rows_are_split_in_order_the_first_shards_one_longer() -> None:
    assert [shard_rows(10, i, 3) for i in range(3)] == [slice(0, 4), slice(4, 7), slice(7, 10)]
    assert [shard_rows(2, i, 2) for i in range(2)] == [slice(0, 1), slice(1, 2)]
    with pytest.raises(ValueError):
        shard_rows(4, 2, 2)


def test_joined_scores_and_their_metrics_are_the_whole_batch_ones() -> None:
    # the second shard's batch call raised: the joined batch says so
    parts = [Scores(torch.tensor([0.5, 1.0]), 1), Scores(torch.tensor([0.0]), 0, batch_error="the call of ...")]
    scores, metrics = registry.role("score").join(parts, None, ScoreNode(fn="digits", inputs=["rollout"]))
    assert scores.values.tolist() == [0.5, 1.0, 0.0] and scores.num_failed == 1
    assert scores.batch_error == "the call of ..."
    assert metrics == {"critic/score/mean": 0.5, "critic/score/max": 1.0, "critic/score/min": 0.0, "reward/num_failed": 1.0,
                       "reward/failed_share": 1 / 3, "reward/num_none": 0.0, "reward/none_share": 0.0,
                       "reward/batch_failed": 1.0}
    with pytest.raises(ValueError, match="not split by rows"):
        registry.role("update").join([], None, UpdateNode(model="actor"))


def test_a_split_node_puts_its_model_on_every_part(tmp_path: Path) -> None:
    pipeline = tiny_grpo(tmp_path, steps=1).build()
    plan = plan_for(pipeline, ALL_ON_0, node_shards={"ref": ["cpu-1", "cpu-0"]})
    assert plan.node_slots["ref"] == "cpu-1"
    assert plan.slots_of("ref") == ["cpu-1", "cpu-0"]
    assert plan.model_slots == {"actor": ["cpu-0"], "reference": ["cpu-1", "cpu-0"]}


def test_groups_of_several_devices_run_every_node_with_a_model(tmp_path: Path) -> None:
    spec = tiny_grpo(tmp_path, steps=1).to_dict()
    spec["devices"]["ref_group"]["count"] = 2
    spec["devices"]["actor_group"]["count"] = 2
    check_runnable(pipeline_from_dict(spec))  # generate, reference_logprob and a policy update split: runs
    ppo = load_pipeline(Path(__file__).resolve().parents[2] / "pipelines" / "ppo_tiny.yaml").spec.model_dump(
        mode="json", exclude_unset=True
    )
    group = ppo["models"]["critic"]["device_group"]
    ppo["devices"][group]["count"] = 2
    check_runnable(pipeline_from_dict(ppo))  # the critic's value and update nodes split too
    ppo["nodes"]["adv"]["device_group"] = group
    with pytest.raises(FlowrlError, match=rf"devices.{group}.count: .* this group runs adv; set count: 1"):
        check_runnable(pipeline_from_dict(ppo))


@pytest.mark.integration
def test_reference_and_reward_split_over_two_workers_train_like_one(tmp_path: Path) -> None:
    pipeline = tiny_grpo(tmp_path / "out", steps=3).build()
    cluster = Cluster.start_local(2)
    try:
        whole = started(cluster, pipeline, plan_for(pipeline, ALL_ON_0))
        expected = _train(whole, pipeline, range(1, 4), {})
        split_plan = plan_for(pipeline, ALL_ON_0, node_shards={"ref": ["cpu-1", "cpu-0"], "reward": ["cpu-0", "cpu-1"]})
        split = started(cluster, pipeline, split_plan)
        curve = _train(split, pipeline, range(1, 4), {})
    finally:
        cluster.close()
    for step, (want, got) in enumerate(zip(expected, curve), start=1):
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), f"step {step}: {key}"


def test_rollout_parts_are_joined_with_common_padding_in_order() -> None:
    from flowrl.roles.batch import Rollout
    from flowrl.roles.shards import join_rollouts

    def part(prompt_width: int, completion_width: int, rows: int, tag: str) -> Rollout:
        return Rollout(
            prompt_ids=torch.full((rows, prompt_width), 5), prompt_mask=torch.ones(rows, prompt_width, dtype=torch.long),
            completion_ids=torch.full((rows, completion_width), 7), completion_mask=torch.ones(rows, completion_width, dtype=torch.long),
            group_size=2, prompts=[tag] * rows, completions=[tag] * rows, answers=[None] * rows,
            max_new_tokens=4, temperature=1.0, sampled_logprobs=torch.full((rows, completion_width), -1.0), pad_token_id=0,
        )

    joined = join_rollouts([part(3, 4, 2, "a"), part(1, 2, 2, "b")])
    assert joined.prompts == ["a", "a", "b", "b"]
    # prompts left-padded to width 3, completions right-padded to width 4
    assert joined.prompt_ids[2].tolist() == [0, 0, 5] and joined.prompt_mask[2].tolist() == [0, 0, 1]
    assert joined.completion_ids[3].tolist() == [7, 7, 0, 0] and joined.completion_mask[3].tolist() == [1, 1, 0, 0]
    assert joined.sampled_logprobs is not None and joined.sampled_logprobs[3].tolist() == [-1.0, -1.0, 0.0, 0.0]
    assert joined.num_completion_tokens == 2 * 4 + 2 * 2


@pytest.mark.integration
def test_generation_split_over_two_workers_learns_through_pushed_weights(tmp_path: Path) -> None:
    pipeline = tiny_grpo(tmp_path / "out", steps=30).build()
    cluster = Cluster.start_local(2)
    try:
        plan = plan_for(pipeline, ALL_ON_0, node_shards={"rollout": ["cpu-0", "cpu-1"]})
        session = started(cluster, pipeline, plan)
        # cpu-1 samples half the prompts with a copy that only pushed weights keep current
        assert plan.weight_peers("train", "actor") == ["cpu-1"]
        source = PromptSource("builtin:digits", batch_size=4, seed=0, base_dir=Path.cwd())
        rewards, lengths = [], []
        for step in range(1, 31):
            reports = session.run_step(step, source.next_batch(step - 1))
            rewards.append(reports["reward"].metrics["critic/score/mean"])
            rollout = reports["rollout"]
            assert len(rollout.shards) == 1 and rollout.tokens_out > 0 and rollout.shards[0].tokens_out > 0
            lengths.append(rollout.metrics["response_length/mean"])
    finally:
        cluster.close()
    assert sum(rewards[-6:]) / 6 > sum(rewards[:6]) / 6 + 0.1
