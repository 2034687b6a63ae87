"""Group matching on the shipped inventories: exact, deterministic, and clear when it fails."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from flowrl.devices.files import load_inventory
from flowrl.devices.inventory import Device, Inventory
from flowrl.devices.matching import match_groups
from flowrl.errors import PlacementError
from flowrl.spec.loader import load_pipeline
from flowrl.spec.schema import DeviceGroupSpec

ROOT = Path(__file__).parents[2]
# gpu-0, gpu-1 A100-40GB; gpu-2 V100-32GB; gpu-3 H100-80GB; cpu-0, cpu-1
MIXED = load_inventory(ROOT / "devices" / "mixed-4gpu.yaml")
CPU_MACHINE = load_inventory(ROOT / "devices" / "cpu-2core.yaml")
PPO_GROUPS = load_pipeline(ROOT / "pipelines" / "ppo.yaml").spec.devices


def gpu(**fields: object) -> DeviceGroupSpec:
    return DeviceGroupSpec(type="gpu", **fields)  # type: ignore[arg-type]


def first_fit(
    groups: dict[str, DeviceGroupSpec], inventory: Inventory
) -> dict[str, list[str]] | None:
    """The greedy baseline: each group in file order takes the first devices that fit."""
    taken: set[str] = set()
    result: dict[str, list[str]] = {}
    for name, spec in groups.items():
        fitting = [
            d for d in inventory.devices
            if d.kind == spec.type and d.id not in taken
            and (spec.min_memory_gb is None or d.memory_gb >= spec.min_memory_gb)
            and (spec.arch is None or d.family in spec.arch or d.arch in spec.arch)
        ][: spec.effective_count]
        if len(fitting) < spec.effective_count:
            return None
        taken.update(d.id for d in fitting)
        result[name] = [d.id for d in fitting]
    return result


def test_first_fit_fails_where_the_exact_match_succeeds() -> None:
    # First fit gives actor_group both A100s (gpu-0, gpu-1) and critic_group the V100;
    # reward_group (v100 or a100) is then left with only the H100 and fails.
    assert first_fit(dict(PPO_GROUPS), MIXED) is None
    match = match_groups(PPO_GROUPS, MIXED)
    assert match.ok
    # actor prefers h100 > a100: gets the H100 and one A100; the V100 is the only card
    # besides an A100 that reward_group accepts, and critic_group takes the other A100
    assert match.assignment == {
        "actor_group": ["gpu-3", "gpu-0"],
        "critic_group": ["gpu-1"],
        "reward_group": ["gpu-2"],
        "reference_group": ["cpu-0"],
    }
    # headroom: smallest card minus min_memory_gb: 40-40, 40-24, 32-24
    assert match.headroom_gb["actor_group"] == 0
    assert match.headroom_gb["critic_group"] == 16
    assert match.headroom_gb["reward_group"] == 8


def test_matching_is_deterministic() -> None:
    first = match_groups(PPO_GROUPS, MIXED)
    assert all(match_groups(PPO_GROUPS, MIXED) == first for _ in range(3))


def test_biggest_cards_go_to_the_group_that_needs_memory_most() -> None:
    # big (>= 41 GiB) fits only the H100, so small (declared first) takes an A100
    groups = {"small": gpu(count=1), "big": gpu(count=1, min_memory_gb=41)}
    assert match_groups(groups, MIXED).assignment == {"small": ["gpu-0"], "big": ["gpu-3"]}
    # with no hard constraint either way, the group asking for more memory still gets
    # the bigger card: medium (>= 16 GiB) outranks small (no minimum)
    groups = {"small": gpu(count=1), "medium": gpu(count=1, min_memory_gb=16)}
    assert match_groups(groups, MIXED).assignment == {"small": ["gpu-0"], "medium": ["gpu-3"]}


def test_pinned_group_keeps_its_devices_and_the_rest_match_around_it() -> None:
    groups = {"pinned": gpu(device_ids=[3]), "other": gpu(count=1, min_memory_gb=60)}
    match = match_groups(groups, MIXED)
    assert match.assignment["pinned"] == ["gpu-3"]
    assert match.reasons["pinned"] == "pinned by device_ids (matching is off for this group)"
    # the only card >= 60 GiB is pinned away
    assert match.unsatisfied["other"] == (
        "other needs 1 gpu with >= 60 GiB; closest: gpu-0 A100-40GB (40 GiB): "
        "lower min_memory_gb to 40"
    )


def test_pin_to_a_missing_device_or_one_too_small_is_explained() -> None:
    groups = {"a": gpu(device_ids=[7]), "b": gpu(device_ids=[2], min_memory_gb=40)}
    match = match_groups(groups, MIXED)
    assert match.unsatisfied == {
        "a": "device_ids: no gpu-7 in this inventory (gpus: gpu-0 .. gpu-3); pin existing "
        "devices or drop device_ids to let flowrl choose",
        "b": "pinned to gpu-2 V100-32GB (32 GiB), which breaks its own requirement (1 gpu "
        "with >= 40 GiB): drop device_ids, or relax min_memory_gb/arch",
    }


def test_preferred_arch_falls_back_when_the_first_choice_is_taken() -> None:
    # one H100 only: fast takes it (first choice); also_fast falls back to its second choice
    groups = {
        "fast": gpu(count=1, preferred_arch=["hopper"], min_memory_gb=60),
        "also_fast": gpu(count=1, preferred_arch=["h100", "a100"]),
    }
    match = match_groups(groups, MIXED)
    assert match.assignment == {"fast": ["gpu-3"], "also_fast": ["gpu-0"]}
    assert match.reasons["also_fast"] == (
        "needs 1 gpu; preferred h100 > a100: got gpu-0 a100 "
        "(fell back: too few preferred devices free)"
    )


def test_unsatisfiable_group_says_what_failed_and_what_fixes_it() -> None:
    match = match_groups({"actor_group": gpu(count=2, min_memory_gb=80)}, MIXED)
    assert match.assignment["actor_group"] == []
    assert match.unsatisfied["actor_group"] == (
        "actor_group needs 2 gpus with >= 80 GiB; closest: gpu-3 H100-80GB (80 GiB), "
        "gpu-0 A100-40GB (40 GiB): lower min_memory_gb to 40 or set count: 1"
    )
    header = r"1 device group cannot be matched:\n  devices.actor_group: "
    with pytest.raises(PlacementError, match=header):
        match.raise_if_unsatisfied()


def test_arch_filter_failure_suggests_the_architectures_to_add() -> None:
    match = match_groups({"old": gpu(count=2, arch=["volta"])}, MIXED)
    assert match.unsatisfied["old"] == (
        "old needs 2 gpus of arch volta; closest: gpu-2 V100-32GB (32 GiB, v100), "
        "gpu-3 H100-80GB (80 GiB, h100): add h100 to arch or set count: 1"
    )


def test_groups_that_fit_alone_but_not_together_are_named_together() -> None:
    groups = {  # exclusive: not shared where the devices are too few
        "a": gpu(count=2, min_memory_gb=40, exclusive=True),
        "b": gpu(count=2, min_memory_gb=40, exclusive=True),
        "c": gpu(count=1),
    }
    match = match_groups(groups, MIXED)
    message = (
        "a and b together need 4 gpus (a: 2 gpus with >= 40 GiB; b: 2 gpus with >= 40 GiB), "
        "but only 3 fit them: gpu-0 A100-40GB, gpu-1 A100-40GB, gpu-3 H100-80GB; lower a "
        "count, relax min_memory_gb or arch so more devices fit, let a and b share devices (drop exclusive: true), "
        "or match against a larger inventory"
    )
    assert match.unsatisfied == {"a": message, "b": message}
    assert match.assignment["c"] == ["gpu-3"]  # c is not to blame and still gets a card


def test_groups_the_pipeline_lets_share_may_use_the_same_devices() -> None:
    groups = {"a": gpu(count=2, min_memory_gb=40), "b": gpu(count=2, min_memory_gb=40)}
    match = match_groups(groups, MIXED, shared={frozenset({"a", "b"})})
    assert match.ok
    assert match.assignment["a"] == match.assignment["b"] == ["gpu-3", "gpu-0"]
    assert match.shared_with == {"a": ["b"], "b": ["a"]}
    # without permission they do not share
    groups_fit = {"a": gpu(count=2), "b": gpu(count=2)}
    match = match_groups(groups_fit, MIXED, shared={frozenset({"a", "b"})})
    assert not set(match.assignment["a"]) & set(match.assignment["b"])


def test_cpu_groups_share_slots_round_robin_on_the_cpu_machine() -> None:
    groups = {name: DeviceGroupSpec() for name in ("actor", "reference", "critic", "reward")}
    match = match_groups(groups, CPU_MACHINE)
    assert match.assignment == {
        "actor": ["cpu-0"], "reference": ["cpu-1"], "critic": ["cpu-0"], "reward": ["cpu-1"]
    }
    assert match.reasons["critic"] == (
        "cpu-0: shared round-robin (4 cpu groups need 4 cpu slots, the inventory has 2)"
    )
    assert match.shared_with["actor"] == ["critic"]


def test_cpu_group_larger_than_the_machine() -> None:
    match = match_groups({"actor": DeviceGroupSpec(count=3)}, CPU_MACHINE)
    assert match.unsatisfied["actor"] == (
        "actor needs 3 cpu slots; the inventory has 2 cpu slots (cpu-0, cpu-1): "
        "set count: 2, or raise runtime.cpu_slots to 3 (on a joined Dask cluster: start more CPU workers)"
    )


def test_too_many_gpus_for_the_inventory() -> None:
    one_gpu = load_inventory(ROOT / "devices" / "mixed-4gpu.yaml")
    one_gpu = replace(one_gpu, devices=(*one_gpu.gpus()[3:], *one_gpu.cpus()))
    match = match_groups({"actor_group": gpu(count=2)}, one_gpu)
    assert match.unsatisfied["actor_group"] == (
        "actor_group needs 2 gpus; the inventory has 1 gpu (gpu-3): set count: 1"
    )


def test_gpu_group_on_a_machine_without_gpus() -> None:
    match = match_groups(PPO_GROUPS, CPU_MACHINE)
    assert match.unsatisfied["critic_group"] == (
        "critic_group needs 1 gpu with >= 24 GiB; this inventory has no gpus: set type: cpu, run where GPUs "
        "are (on a joined Dask cluster: start GPU workers), or plan for an inventory with gpus "
        "(flowrl plan PIPELINE --devices devices/FILE.yaml)"
    )
    assert match.assignment["reference_group"] == ["cpu-0"]


def test_unknown_architecture_word_is_a_typo_not_a_shortage() -> None:
    match = match_groups({"a": gpu(arch=["a1000"])}, MIXED)
    assert match.unsatisfied["a"].startswith(
        "arch: unknown architecture 'a1000' (did you mean 'a100'?); known: pascal, volta"
    )


def test_a_new_device_that_fits_is_used_by_the_next_match() -> None:
    groups = {"actor_group": gpu(count=2, min_memory_gb=80)}
    assert not match_groups(groups, MIXED).ok
    h100 = MIXED.by_id("gpu-3")
    assert h100 is not None
    added: Device = replace(h100, id="gpu-4", index=4)
    grown = replace(MIXED, devices=(*MIXED.gpus(), added, *MIXED.cpus()))
    match = match_groups(groups, grown)
    assert match.assignment["actor_group"] == ["gpu-3", "gpu-4"]


def test_a_thousand_devices_are_matched() -> None:
    # 125 hosts of 8 identical GPUs; host h has type h % 4 (A100-80GB, H100-80GB, L40S, A100-40GB)
    kinds = [("A100-80GB", "ampere", 80.0, "a100"), ("H100-80GB", "hopper", 80.0, "h100"),
             ("L40S", "ada", 48.0, "l40s"), ("A100-40GB", "ampere", 40.0, "a100")]
    devices = []
    for number in range(1000):
        name, arch, memory_gb, family = kinds[(number // 8) % 4]
        devices.append(
            Device(f"gpu-{number}", f"node-{number // 8}", number % 8, "gpu", name, arch, memory_gb,
                   family=family)
        )
    inventory = Inventory(tuple(devices), ())
    groups = {
        "actor": gpu(count=256, min_memory_gb=80, preferred_arch=["hopper"]),
        "critic": gpu(count=200, min_memory_gb=48),
        "reward": gpu(count=300, arch=["ampere", "ada"]),
    }
    match = match_groups(groups, inventory)
    assert match.ok
    # hosts 1, 5, ..., 121 hold H100s: 31 hosts x 8 = 248; the actor takes all of them
    # (its first choice) and 8 A100-80GB for the rest of its 256
    names = [inventory.by_id(i).name for i in match.assignment["actor"]]  # type: ignore[union-attr]
    assert (names.count("H100-80GB"), names.count("A100-80GB")) == (248, 8)


def test_too_few_gpus_for_one_each_are_shared_by_groups_that_are_not_exclusive() -> None:
    """One GPU, a PPO pipeline's three GPU groups: they share it (the planner then checks
    their memory); an exclusive group keeps its device to itself and so cannot be matched."""
    one_gpu = load_inventory(ROOT / "devices" / "h100-1x.yaml")
    groups = {"actor": gpu(), "critic": gpu(), "reward": gpu()}
    match = match_groups(groups, one_gpu)
    assert match.ok and match.assignment == {"actor": ["gpu-0"], "critic": ["gpu-0"], "reward": ["gpu-0"]}
    assert match.shared_with["actor"] == ["critic", "reward"]
    assert "shares devices with critic, reward (too few GPUs for one each" in match.reasons["actor"]
    # two GPUs for three groups: the fewest sharings (two groups on one card, one alone)
    two = replace(MIXED, devices=[d for d in MIXED.devices if d.id in ("gpu-0", "gpu-1") or d.kind == "cpu"])
    spread = match_groups(groups, two)
    assert spread.ok and sorted(len(ids) for ids in spread.assignment.values()) == [1, 1, 1]
    assert sorted(len(others) for others in spread.shared_with.values()) == [0, 1, 1]
    # four groups on two GPUs: as few sharings, the most even (two and two, not three and one)
    four = match_groups({**groups, "reference": gpu()}, two)
    assert four.ok and sorted(len(others) for others in four.shared_with.values()) == [1, 1, 1, 1]
    alone = match_groups({**groups, "reward": gpu(exclusive=True)}, one_gpu)
    assert not alone.ok and set(alone.unsatisfied) == {"actor", "critic"}


def test_too_few_gpus_are_shared_where_the_fewest_devices_serve_two_groups() -> None:
    # 6 GPUs for groups of 4, 2 and 1: one sharing is needed; the 1 shares a GPU with the 4
    # or the 2 and every GPU serves, where the 4 and the 2 would share two GPUs and leave one idle
    devices = [Device(f"gpu-{number}", "node-0", number, "gpu", "A100-80GB", "ampere", 80.0, family="a100")
               for number in range(6)]
    groups = {"actor": gpu(count=4), "critic": gpu(count=2), "ref": gpu()}
    match = match_groups(groups, Inventory(tuple(devices), ()))
    assert match.ok
    assert sorted(set(sum(match.assignment.values(), []))) == [f"gpu-{number}" for number in range(6)]
    assert match.shared_with["ref"] in (["actor"], ["critic"])
    assert set(match.assignment["ref"]) < set(match.assignment[match.shared_with["ref"][0]])
    assert not set(match.assignment["actor"]) & set(match.assignment["critic"])


def test_the_shipped_gpu_ppo_pipeline_matches_one_gpu() -> None:
    from flowrl.devices.groups import pipeline_groups

    spec = load_pipeline(ROOT / "pipelines" / "ppo_tiny_gpu.yaml").spec
    match = match_groups(pipeline_groups(spec), load_inventory(ROOT / "devices" / "h100-1x.yaml"))
    assert match.ok and set(map(tuple, match.assignment.values())) == {("gpu-0",)}
