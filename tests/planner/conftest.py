"""Small inventories and pipelines for planner tests, built in code."""

from __future__ import annotations

from typing import Any

from flowrl.devices.inventory import Device, Host, Inventory


def gpu(number: int, name: str, memory_gb: float, tflops: float, bandwidth_gbs: float,
        host: str = "node-0") -> Device:
    return Device(f"gpu-{number}", host, number, "gpu", name, "ampere", memory_gb,
                  family=name.lower(), tflops_bf16=tflops, bandwidth_gbs=bandwidth_gbs)


def cpu(number: int, memory_gb: float = 64.0, host: str = "node-0") -> Device:
    return Device(f"cpu-{number}", host, number, "cpu", "cpu", "cpu", memory_gb, family="cpu")


def inventory(*devices: Device) -> Inventory:
    hosts = sorted({device.host for device in devices})
    memory = {d.host: d.memory_gb for d in devices if d.kind == "cpu"}
    return Inventory(tuple(devices), tuple(Host(h, 16, memory.get(h, 64.0)) for h in hosts), "test")


def grpo(actor: dict[str, Any], reference: dict[str, Any], devices: dict[str, Any],
         batch_size: int = 4, n: int = 4, max_new_tokens: int = 16,
         **update: Any) -> dict[str, Any]:
    return {
        "name": "toy",
        "models": {"actor": actor, "reference": reference},
        "devices": devices,
        "nodes": {
            "rollout": {"role": "generate", "model": "actor", "inputs": ["prompts"], "n": n,
                        "max_new_tokens": max_new_tokens},
            "reward": {"role": "score", "fn": "digits", "inputs": ["rollout"]},
            "ref": {"role": "reference_logprob", "model": "reference", "inputs": ["rollout"]},
            "adv": {"role": "advantage", "inputs": ["reward"]},
            "train": {"role": "update", "model": "actor", "inputs": ["rollout", "adv", "ref"],
                      "kl_coef": 0.01, **update},
        },
        "data": {"source": "builtin:digits", "batch_size": batch_size},
    }
