"""Search: obvious colocation and offload, memory, pinned groups, determinism, mixed GPUs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flowrl.devices.files import load_inventory
from flowrl.devices.groups import pipeline_groups
from flowrl.devices.inventory import GB_PER_GIB
from flowrl.devices.matching import match_groups
from flowrl.errors import PlacementError
from flowrl.planner.compiled import CompiledPlan, compile_plan
from flowrl.planner.costs import EstimatedCosts
from flowrl.planner.search import SearchOptions, fits
from flowrl.spec.loader import load_pipeline, pipeline_from_dict

from tests.planner.conftest import cpu, gpu, grpo, inventory

ROOT = Path(__file__).resolve().parents[2]
QWEN = "Qwen/Qwen2.5-0.5B"


def _fits(plan: CompiledPlan, reserve: float = 0.10) -> None:
    hosts: dict[str, float] = {}
    for device in plan.devices:
        if device.kind == "cpu":
            hosts[device.label] = device.peak_gb
        else:
            assert device.peak_gb * (1 + reserve) <= device.capacity_gb, device


def test_ppo_on_the_mixed_inventory() -> None:
    pipeline = load_pipeline(ROOT / "pipelines" / "ppo.yaml")
    plan = compile_plan(pipeline, load_inventory(ROOT / "devices" / "mixed-4gpu.yaml"))
    where = plan.node_devices
    # matched groups: actor H100 first then an A100; reward the V100 (arch v100/a100)
    assert where["rollout"] == ["gpu-3", "gpu-0"] and where["train_actor"] == ["gpu-3", "gpu-0"]
    assert where["reward"] == ["gpu-2"]
    # the critic's group runs on its own A100 or, sharing, on the actor's faster H100
    shared = plan.shared.get("critic_group") == "actor_group"
    assert where["values"] == where["train_critic"] == (["gpu-3"] if shared else ["gpu-1"])
    # the offloaded reference is paged onto a GPU: far faster than the CPU slot
    assert plan.offloaded == ["ref"] and where["ref"][0].startswith("gpu")
    assert plan.critical_path[0] == "rollout" and plan.iteration_s > 0
    assert len(plan.reasons) == len(pipeline.spec.nodes)
    _fits(plan)


def test_unpinned_inference_model_is_colocated_on_the_gpu() -> None:
    data = grpo({"path": "builtin:small-llama", "device_group": "actor_group"},
                {"path": "builtin:small-llama"},  # no group: the planner may put it anywhere
                {"actor_group": {"type": "gpu"}}, batch_size=16, n=8, max_new_tokens=64)
    plan = compile_plan(pipeline_from_dict(data),
                        inventory(gpu(0, "A100-40GB", 40, 312, 1555), cpu(0)))
    assert plan.node_devices["ref"] == ["gpu-0"]
    assert plan.colocations == {"gpu-0": ["actor", "reference"]}


def test_cpu_offload_when_the_gpu_is_full() -> None:
    data = grpo({"path": QWEN, "device_group": "actor_group", "dtype": "bf16"},
                {"path": QWEN, "device_group": "actor_group", "dtype": "bf16",
                 "offload_to_cpu": True},
                {"actor_group": {"type": "gpu"}}, batch_size=8, n=4, max_new_tokens=64,
                mini_batch_size=2)
    pipeline = pipeline_from_dict(data)
    costs = EstimatedCosts(pipeline)
    # size the card so the actor alone fits but paging the reference in does not
    actor = costs.memory("train", 1, gpu=True)
    generate = costs.memory("rollout", 1, gpu=True)
    ref = costs.memory("ref", 1, gpu=True)
    # 0.5 GB CUDA context; the decoder's cache stays between calls like the training state
    resident = actor.weights_gb + actor.state_gb + generate.cache_gb + 0.5
    alone = resident + max(actor.transient_gb, generate.transient_gb)
    paged = resident + ref.weights_gb + ref.transient_gb
    assert paged > alone
    capacity_gb = (alone * 1.1 + paged * 1.1) / 2
    plan = compile_plan(pipeline, inventory(gpu(0, "SMALL", capacity_gb / GB_PER_GIB, 312, 1555), cpu(0, 256)))
    assert plan.node_devices["ref"] == ["cpu-0"]
    assert "cpu offload" in next(p.reason for p in plan.nodes if p.node == "ref")
    _fits(plan)


def test_a_sharded_update_needs_less_memory_per_device_and_pays_for_its_gathers() -> None:
    def _three_cards(sharded: bool) -> EstimatedCosts:
        data = grpo({"path": QWEN, "device_group": "actor_group", "dtype": "bf16", "sharded": sharded},
                    {"path": QWEN, "device_group": "ref_group", "dtype": "bf16"},
                    {"actor_group": {"type": "gpu", "count": 4}, "ref_group": {"type": "cpu"}},
                    batch_size=8, n=4, max_new_tokens=64, mini_batch_size=8)
        return EstimatedCosts(pipeline_from_dict(data))

    whole, sharded = _three_cards(False), _three_cards(True)
    replicated = whole.memory("train", 4, gpu=True)
    split = sharded.memory("train", 4, gpu=True)
    assert split.weights_gb == replicated.weights_gb  # the whole copy for generation stays
    assert split.state_gb == pytest.approx((replicated.weights_gb + replicated.state_gb) / 4)
    # one layer and the outer unit gathered on top; the output head holds a whole copy's one
    # chunk of the fused head (the sharded pass stands it in for the model's own head)
    from flowrl.planner.cost import sharded_training_bytes
    from flowrl.planner.costs import GB

    work = sharded.work("train")
    assert work.shape is not None
    gathered = sharded_training_bytes(work.shape, work.kind, work.dtype, 4)[1]
    assert split.transient_gb == pytest.approx(replicated.transient_gb + gathered / GB)
    # on one device nothing is sharded
    assert sharded.memory("train", 1, gpu=True) == whole.memory("train", 1, gpu=True)
    cards = [gpu(index, "H100-80GB", 80, 989, 3350) for index in range(4)]
    assert sharded.compute_s("train", cards, False) > whole.compute_s("train", cards, False)


def test_a_sharded_update_pays_its_gathers_for_the_busiest_ranks_whole_passes() -> None:
    """8 sequences on 3 ranks at 2 rows a pass (micro_batch_tokens 160 of 80-token rows): the
    busiest rank holds 3 sequences in 2 passes, so each unit is gathered (2 x 2 + 1) x 1 + 1 = 6
    times a step: twice a pass, once more for the last pass's reduce-scatter, once after the
    update."""
    from flowrl.planner.costs import CALL_OVERHEAD_S, transfer_s

    data = grpo({"path": QWEN, "device_group": "actor_group", "dtype": "bf16", "sharded": True},
                {"path": QWEN, "device_group": "ref_group", "dtype": "bf16"},
                {"actor_group": {"type": "gpu", "count": 3}, "ref_group": {"type": "cpu"}},
                batch_size=2, n=4, max_new_tokens=64, micro_batch_tokens=160)
    costs = EstimatedCosts(pipeline_from_dict(data), prompt_tokens=16)
    work = costs.work("train")
    assert work.shape is not None and work.mini_batch_sequences == 8
    assert work.pass_sequences(3) == 2
    cards = [gpu(index, "H100-80GB", 80, 989, 3350) for index in range(3)]
    units = work.shape.num_layers + 1
    grads = work.trained_parameters * 2  # bf16
    gather = units * transfer_s(2 / 3 * grads / units, cards[:1], cards[1:])
    alone = max(costs._on_device(work, card, 3)[0] for card in cards)
    assert costs.compute_s("train", cards, False) == pytest.approx(CALL_OVERHEAD_S + alone + 6 * gather)


def _three_cards(batch_size: int, n: int) -> EstimatedCosts:
    """GRPO on one group of 3 GPUs: ``batch_size`` prompts of ``n`` samples."""
    data = grpo({"path": QWEN, "device_group": "actor_group", "dtype": "bf16"},
                {"path": QWEN, "device_group": "actor_group", "dtype": "bf16"},
                {"actor_group": {"type": "gpu", "count": 3}},
                batch_size=batch_size, n=n, max_new_tokens=64)
    return EstimatedCosts(pipeline_from_dict(data), prompt_tokens=16)


def test_each_rank_is_sized_for_the_busiest_ranks_rows() -> None:
    """8 sequences on 3 ranks put 3 on the busiest: its memory is that of 9 on 3 (3 each),
    for the update and a forward pass; on one device 8 take less. A generation's ranks hold
    whole prompts."""
    eight, nine, twelve = _three_cards(2, 4), _three_cards(3, 3), _three_cards(3, 4)
    assert eight.work("train").num_sequences == 8 and nine.work("train").num_sequences == 9
    for node in ("train", "ref"):
        assert eight.memory(node, 3, gpu=True) == nine.memory(node, 3, gpu=True), node
    for node in ("train", "rollout", "ref"):
        assert eight.memory(node, 1, gpu=True).transient_gb < nine.memory(node, 1, gpu=True).transient_gb, node
    # the generation's ranks hold whole prompts: 2 of 4 samples on 3 ranks is 4 rows, as 3 of 4
    assert eight.memory("rollout", 3, gpu=True) == twelve.memory("rollout", 3, gpu=True)


def test_each_rank_is_timed_for_the_busiest_ranks_rows() -> None:
    """8 sequences on 3 ranks take as long per rank as 9 (3 on the busiest rank): the
    reference pass and the update's work on one device are those of 3 rows."""
    eight, nine = _three_cards(2, 4), _three_cards(3, 3)
    card = gpu(0, "H100-80GB", 80, 989, 3350)
    for node in ("train", "ref"):
        assert eight._on_device(eight.work(node), card, 3) == pytest.approx(
            nine._on_device(nine.work(node), card, 3)), node
    # generation splits whole prompts: 2 prompts of 4 samples on 3 ranks put one prompt (4 rows)
    # on the busiest, as 3 prompts of 4 do
    twelve = _three_cards(3, 4)
    assert eight.work("rollout").rank_sequences(3) == twelve.work("rollout").rank_sequences(3) == 4
    assert eight._on_device(eight.work("rollout"), card, 3) == pytest.approx(
        twelve._on_device(twelve.work("rollout"), card, 3))


def test_a_model_that_fits_only_sharded_is_refused_whole_with_the_hint_and_placed_sharded() -> None:
    def data(sharded: bool) -> dict:
        return grpo({"path": QWEN, "device_group": "actor_group", "dtype": "bf16", "sharded": sharded},
                    {"path": QWEN, "device_group": "ref_group", "dtype": "bf16"},
                    {"actor_group": {"type": "gpu", "count": 4}, "ref_group": {"type": "cpu"}},
                    batch_size=8, n=4, max_new_tokens=64, mini_batch_size=8)

    def peak(sharded: bool, memory_gb: float) -> float:
        cards = [gpu(index, "BIG", memory_gb, 989, 3350) for index in range(4)]
        plan = compile_plan(pipeline_from_dict(data(sharded)), inventory(*cards, cpu(0, 256)))
        return max(device.peak_gb for device in plan.devices if device.kind == "gpu")

    whole, sharded = peak(False, 1000), peak(True, 1000)
    assert sharded < whole
    between = (whole + sharded) * 1.1 / 2
    cards = [gpu(index, "MID", between, 989, 3350) for index in range(4)]
    with pytest.raises(PlacementError, match=r"models\.actor\.sharded: true \(training state split"):
        compile_plan(pipeline_from_dict(data(False)), inventory(*cards, cpu(0, 256)))
    plan = compile_plan(pipeline_from_dict(data(True)), inventory(*cards, cpu(0, 256)))
    assert len(plan.node_devices["train"]) == 4
    _fits(plan)


def test_two_sharded_models_on_devices_the_match_shares_are_refused_with_the_fix() -> None:
    import yaml

    spec = yaml.safe_load((ROOT / "pipelines" / "ppo_tiny.yaml").read_text())
    spec["models"]["actor"]["sharded"] = spec["models"]["critic"]["sharded"] = True
    spec["devices"]["actor_group"]["count"] = spec["devices"]["critic_group"]["count"] = 2
    # two CPU slots for four groups: every group time-shares both
    with pytest.raises(PlacementError, match="models 'actor' and 'critic' train sharded over actor_group and "
                                             "critic_group, which share cpu-0, cpu-1 here"):
        compile_plan(pipeline_from_dict(spec), inventory(cpu(0), cpu(1)))
    # with four slots each pair of groups has its own
    compile_plan(pipeline_from_dict(spec), inventory(cpu(0), cpu(1), cpu(2), cpu(3)))


def test_no_placement_fits_raises_with_the_numbers() -> None:
    data = grpo({"path": "Qwen/Qwen2.5-7B", "device_group": "actor_group"},
                {"path": "Qwen/Qwen2.5-7B", "device_group": "ref_group"},
                {"actor_group": {"type": "gpu"}, "ref_group": {"type": "cpu"}})
    with pytest.raises(PlacementError, match=r"gpu-0 SMALL needs .* GB \+ 10% reserve of 42.9 GB \(40 GiB") as raised:
        compile_plan(pipeline_from_dict(data), inventory(gpu(0, "SMALL", 40, 312, 1555), cpu(0, 512)))
    # bf16 is suggested for the fp32 models on the device, and not once they are bf16
    assert "Use bf16 for actor, gradient_checkpointing" in str(raised.value)
    data["models"]["actor"]["dtype"] = "bf16"
    with pytest.raises(PlacementError) as again:
        compile_plan(pipeline_from_dict(data), inventory(gpu(0, "SMALL", 20, 312, 1555), cpu(0, 512)))
    assert "bf16" not in str(again.value) and "Use gradient_checkpointing" in str(again.value)
    assert "offload_to_cpu for inference-only models" in str(again.value)


def test_a_host_too_small_for_any_placement_is_said_in_its_own_small_numbers() -> None:
    # 0.0005 GiB of host memory (537 kB) against the tiny models' megabytes; paging weights to
    # host memory is no help to CPU slots, whose weights are there already
    data = grpo({"path": "builtin:tiny-llama", "device_group": "actor_group"},
                {"path": "builtin:tiny-llama", "device_group": "actor_group"}, {"actor_group": {"type": "cpu"}})
    with pytest.raises(PlacementError) as raised:
        compile_plan(pipeline_from_dict(data), inventory(cpu(0, 0.0005)))
    message = str(raised.value)
    assert re.search(r"cpu-0 needs 0\.0\d{3} GB \+ 10% reserve of 0\.000537 GB \(0\.0005 GiB; runs ", message), message
    assert "offload_to_cpu" not in message and message.endswith("or larger devices")


@pytest.mark.parametrize("inventory_file", ["mixed-4gpu", "a100-4x40gb", "cluster-2node"])
def test_pinned_groups_respected_and_memory_never_exceeded(inventory_file: str) -> None:
    pipeline = load_pipeline(ROOT / "pipelines" / "ppo.yaml")
    devices = load_inventory(ROOT / "devices" / f"{inventory_file}.yaml")
    match = match_groups(pipeline_groups(pipeline.spec), devices)
    assert match.ok
    plan = compile_plan(pipeline, devices, match)
    _fits(plan)
    groups = {"rollout": "actor_group", "train_actor": "actor_group", "reward": "reward_group",
              "values": "critic_group", "train_critic": "critic_group"}
    for node, group in groups.items():
        # a group runs on its own devices, or on those of the group it shares
        assert set(plan.node_devices[node]) <= set(match.assignment[plan.shared.get(group, group)])


def test_h200_node_cannot_serve_a_group_that_asks_for_v100_or_a100() -> None:
    pipeline = load_pipeline(ROOT / "pipelines" / "ppo.yaml")
    devices = load_inventory(ROOT / "devices" / "h200-8x.yaml")
    match = match_groups(pipeline_groups(pipeline.spec), devices)
    assert list(match.unsatisfied) == ["reward_group"]


def test_plans_are_deterministic_and_greedy_agrees_with_exact() -> None:
    pipeline = load_pipeline(ROOT / "pipelines" / "ppo.yaml")
    devices = load_inventory(ROOT / "devices" / "mixed-4gpu.yaml")
    first = compile_plan(pipeline, devices)
    assert first.to_dict() == compile_plan(pipeline, devices).to_dict()
    greedy = compile_plan(pipeline, devices, options=SearchOptions(exact_limit=0))
    assert greedy.method == "greedy+local" and first.method == "exact"
    assert greedy.iteration_s == pytest.approx(first.iteration_s)


def test_data_parallel_width_of_an_inference_node() -> None:
    data = grpo({"path": "Qwen/Qwen2.5-1.5B", "device_group": "actor_group", "dtype": "bf16"},
                {"path": "Qwen/Qwen2.5-1.5B", "device_group": "ref_group", "dtype": "bf16"},
                {"actor_group": {"type": "gpu", "count": 2}, "ref_group": {"type": "gpu", "count": 2}},
                batch_size=32, n=8, max_new_tokens=256, mini_batch_size=4)
    devices = inventory(*(gpu(i, "H100-80GB", 80, 989, 3350) for i in range(4)), cpu(0, 512))
    plan = compile_plan(pipeline_from_dict(data), devices)
    # a large reference pass: splitting it over both of its GPUs halves its time
    assert len(plan.node_devices["ref"]) == 2
    assert "width 2 of 2" in next(p.reason for p in plan.nodes if p.node == "ref")


@pytest.mark.parametrize("inventory_file", ["h100-1x", "a100-4x40gb"])
def test_the_04b_gpu_job_fits_one_80_or_40_gb_card(inventory_file: str) -> None:
    # measured on one GPU at about 22.4 GB (benchmarks/results/planner_accuracy_h100.json);
    # the plan must accept it on one H100-80GB, and on one A100-40GB of the four
    pipeline = load_pipeline(ROOT / "pipelines" / "grpo_0.4b_gpu.yaml")
    plan = compile_plan(pipeline, load_inventory(ROOT / "devices" / f"{inventory_file}.yaml"))
    _fits(plan)
    (card,) = {device for devices in plan.node_devices.values() for device in devices if device.startswith("gpu")}
    peak = next(device.peak_gb for device in plan.devices if device.device == card)
    assert 20.0 < peak < 30.0


def test_beside_one_gpu_the_first_cpu_slot_takes_work_the_prediction_says_overlaps() -> None:
    # grpo_0.4b_gpu on one H100 and two CPU slots: the reward and the advantage on cpu-0 (a
    # process of its own) run while the reference forward holds the GPU, off the critical
    # path; the first CPU slot of the machine shares its cores with no other slot, so the
    # tie-break towards fewer slots does not hold them back.
    pipeline = load_pipeline(ROOT / "pipelines" / "grpo_0.4b_gpu.yaml")
    plan = compile_plan(pipeline, load_inventory(ROOT / "devices" / "h100-1x.yaml"))
    assert plan.node_devices["reward"] == ["cpu-0"] and plan.node_devices["adv"] == ["cpu-0"]
    assert plan.critical_path == ["rollout", "ref", "train"]
    # the tiny GPU job's reward is shorter than the two process hops: it stays on the GPU
    tiny = compile_plan(load_pipeline(ROOT / "pipelines" / "grpo_tiny_gpu.yaml"),
                        load_inventory(ROOT / "devices" / "h100-1x.yaml"))
    assert {device for devices in tiny.node_devices.values() for device in devices} == {"gpu-0"}


def test_on_a_cpu_only_cluster_every_slot_counts_towards_fewer_slots() -> None:
    # two hosts of CPU slots and no GPU in use: a slot on the second host would be judged as
    # free beside GPUs only; here every slot counts, and the data-parallel job keeps to the
    # first host's two slots
    pipeline = load_pipeline(ROOT / "pipelines" / "grpo_data_parallel.yaml")
    plan = compile_plan(pipeline, load_inventory(ROOT / "devices" / "cluster-2node.yaml"))
    used = {device for devices in plan.node_devices.values() for device in devices}
    assert used == {"cpu-0", "cpu-1"}


def test_a_cards_gib_are_compared_with_predicted_gb_in_one_unit() -> None:
    # an 80 GiB card holds 85.90 GB: a 75 GB peak plus the 10 % reserve (82.5 GB) fits,
    # 79 GB (86.9 GB) does not; on two CPU slots of one 16 GiB host (17.18 GB) the slots' 7.5 GB
    # and 8.0 GB add up to 15.5 GB, 17.05 GB with the reserve
    card = inventory(gpu(0, "A100-80GB", 80, 312, 2039))
    assert fits({"gpu-0": 75.0}, card, 0.10) == (True, pytest.approx(1 - 75.0 / (80 * 2**30 / 1e9)))
    assert fits({"gpu-0": 79.0}, card, 0.10)[0] is False
    slots = inventory(cpu(0, 16.0), cpu(1, 16.0))
    assert fits({"cpu-0": 7.5, "cpu-1": 8.0}, slots, 0.10)[0] is True
    assert fits({"cpu-0": 7.5, "cpu-1": 8.2}, slots, 0.10)[0] is False
