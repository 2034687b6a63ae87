"""Inventory files: the shipped ones load; mistakes are all reported with file:line."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.devices.files import load_inventory
from flowrl.errors import FlowrlError
from flowrl.spec.inventory_file import InventoryFileError

SHIPPED = sorted((Path(__file__).parents[2] / "devices").glob("*.yaml"))


def test_the_shipped_inventories_exist() -> None:
    assert {path.stem for path in SHIPPED} >= {
        "mixed-4gpu", "a100-4x40gb", "h200-8x", "cluster-2node", "cpu-2core"
    }


@pytest.mark.parametrize("path", SHIPPED, ids=lambda path: path.stem)
def test_every_shipped_inventory_loads(path: Path) -> None:
    inventory = load_inventory(path)
    assert inventory.devices and inventory.hosts
    assert inventory.cpus(), "every host offers at least one CPU slot"


def test_mixed_node_is_numbered_in_file_order() -> None:
    inventory = load_inventory(SHIPPED[0].parent / "mixed-4gpu.yaml")
    assert [(d.id, d.name, d.memory_gb, d.l2_cache_mib) for d in inventory.gpus()] == [
        ("gpu-0", "A100-40GB", 40, 40), ("gpu-1", "A100-40GB", 40, 40),
        ("gpu-2", "V100-32GB", 32, 6), ("gpu-3", "H100-80GB", 80, 50),
    ]


def test_two_node_cluster_numbers_across_hosts_and_keeps_nvlink_inside_a_node() -> None:
    inventory = load_inventory(SHIPPED[0].parent / "cluster-2node.yaml")
    gpus = inventory.gpus()
    assert len(gpus) == 16
    first = gpus[8]
    assert (first.id, first.host, first.index, first.name) == ("gpu-8", "node-1", 0, "A100-80GB")
    assert gpus[0].nvlink_peers == tuple(f"gpu-{i}" for i in range(1, 8))
    assert gpus[8].nvlink_peers == ()
    assert [d.id for d in inventory.cpus()] == ["cpu-0", "cpu-1", "cpu-2", "cpu-3"]


def test_the_cpu_machine_has_two_slots_and_no_gpu() -> None:
    inventory = load_inventory(SHIPPED[0].parent / "cpu-2core.yaml")
    assert inventory.gpus() == []
    assert [d.id for d in inventory.cpus()] == ["cpu-0", "cpu-1"]
    assert (inventory.hosts[0].cores, inventory.hosts[0].memory_gb) == (2, 24)


def test_a_card_not_in_the_table_is_described_by_its_memory(tmp_path: Path) -> None:
    path = tmp_path / "custom.yaml"
    path.write_text(
        "name: custom\n"
        "hosts:\n"
        "  box:\n"
        "    cpus: {cores: 8, memory_gb: 64}\n"
        "    gpus:\n"
        "      - {type: RTX-6000-Ada, memory_gb: 48, arch: ada}\n"
    )
    gpu = load_inventory(path).gpus()[0]
    expected = ("RTX-6000-Ada", 48, "ada", "rtx-6000-ada", None)  # L2 unknown: the planner counts 128 MiB
    assert (gpu.name, gpu.memory_gb, gpu.arch, gpu.family, gpu.l2_cache_mib) == expected


BROKEN = """\
name: broken
hosts:
  node-0:
    cpus: {cores: 0, memory_gb: 64}
    gpu:
      - {type: A100-40GB}
  node-1:
    cpus: {cores: 8, memory_gb: 64}
    gpus:
      - {type: A100-40G, count: 2}
      - {type: H100-80GB, count: -1}
      - {type: H100-80GB, arch: hoper}
  node-2:
    gpus: []
"""


def test_every_mistake_is_reported_at_once_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(BROKEN)
    with pytest.raises(InventoryFileError) as caught:
        load_inventory(path)
    lines = str(caught.value).splitlines()
    assert lines[0] == "6 problems in the device inventory:"
    assert lines[1:] == [
        f"  {path}:4: hosts.node-0.cpus.cores: out of range: allowed cores >= 1, found 0",
        f"  {path}:5: hosts.node-0.gpu: unknown field 'gpu' (did you mean 'gpus'?)",
        f"  {path}:10: hosts.node-1.gpus.0.type: unknown GPU type 'A100-40G' (did you mean "
        "'A100-40GB'?); use a known type (V100-16GB, V100-32GB, T4, A10, A10G, RTX-3090, "
        "A100-40GB, A100-80GB, L4, L40S, RTX-4090, H100-80GB, H100-80GB-PCIe, H100-94GB-NVL, "
        "H200-141GB, B200) or give memory_gb (and arch) for another card",
        f"  {path}:11: hosts.node-1.gpus.1.count: out of range: allowed count >= 1, found -1",
        f"  {path}:12: hosts.node-1.gpus.2.arch: unknown architecture 'hoper' (did you mean "
        "'hopper'?); known: pascal, volta, turing, ampere, ada, hopper, blackwell",
        f"  {path}:13: hosts.node-2.cpus: required field 'cpus' is missing",
    ]
    assert isinstance(caught.value, FlowrlError) and caught.value.exit_code == 2


def test_duplicate_keys_and_syntax_errors_have_lines(tmp_path: Path) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text("name: a\nname: b\nhosts:\n  h: {cpus: {cores: 1, memory_gb: 1}}\n")
    duplicate = r"dup.yaml:2: name: duplicate key 'name' \(first at line 1\)"
    with pytest.raises(InventoryFileError, match=duplicate):
        load_inventory(path)
    path.write_text("name: a\nhosts: [\n")
    with pytest.raises(InventoryFileError, match=r"dup.yaml:3: YAML syntax error"):
        load_inventory(path)


def test_missing_file_and_empty_file(tmp_path: Path) -> None:
    with pytest.raises(InventoryFileError, match="no such file"):
        load_inventory(tmp_path / "nope.yaml")
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    message = r"empty.yaml:1: expected a mapping with name and hosts; the file is empty"
    with pytest.raises(InventoryFileError, match=message):
        load_inventory(empty)
