"""Where the planner's numbers come from: one ``CostSource`` interface, two sources.

``EstimatedCosts`` derives every number from the cost model (``flowrl.planner.cost``) and the
hardware tables; ``MeasuredCosts`` replaces node times with what the profiler measured
(an exponentially weighted moving average per node and device type) and falls back to
its estimate for anything not measured yet. The search and the simulator only see the
interface, so re-planning from measurements is the same code path as the first plan.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

from flowrl.devices.inventory import Device
from flowrl.graph import PipelineGraph
from flowrl.planner.cost import (
    CpuRates,
    Overheads,
    DTYPE_BYTES,
    activation_bytes,
    decoder_cache_bytes,
    forward_flops,
    inference_bytes,
    kv_cache_bytes,
    logits_bytes,
    shared_prompt_flops,
    optimizer_step_bytes,
    sharded_training_bytes,
    training_state_bytes,
    weight_bytes,
)
from flowrl.planner.work import NodeWork, node_work

GB = 1e9
GPU_MATMUL_EFFICIENCY = 0.5
"""Share of a GPU's peak tensor rate that dense training/prefill matmuls reach (MFU)."""
GPU_BANDWIDTH_EFFICIENCY = 0.8
"""Share of a GPU's data-sheet memory bandwidth that a decode step reaches."""
FP32_SLOWDOWN = 12.0
"""fp32 matmuls without TF32 run at 1/8 (V100) to 1/16 (A100/H100) of the bf16 tensor rate."""
GPU_LAYER_OVERHEAD_S = 4e-5
"""Kernel launches of one layer's forward in eager PyTorch (about ten kernels of ~4 us)."""
GPU_OVERHEADS = Overheads(forward_layer_s=GPU_LAYER_OVERHEAD_S, train_layer_s=3 * GPU_LAYER_OVERHEAD_S,
                          decode_layer_s=GPU_LAYER_OVERHEAD_S)
"""A GPU's overheads: a layer's launches per forward, three times that per forward and
backward. A CPU slot's are measured (``CpuRates.overheads``)."""
CALL_OVERHEAD_S = 1e-3
"""One node call on a worker (a Dask actor call: scheduling, (de)serialising arguments)."""
ADVANTAGE_S_PER_SEQUENCE = 1e-6
"""Advantage estimation per completion (a few vector operations)."""
DEFAULT_TFLOPS = 100.0
DEFAULT_BANDWIDTH_GBS = 900.0


@dataclass(frozen=True)
class Link:
    """How two devices exchange data."""

    kind: str
    """``same device``, ``nvlink``, ``pcie``, ``host`` (between worker processes of one
    machine, one of them a CPU slot) or ``network``."""
    bandwidth_gbs: float
    latency_s: float


_SAME = Link("same device", float("inf"), 0.0)


def link_between(source: Device, target: Device) -> Link:
    """The link data takes from ``source`` to ``target`` (conservative sustained rates)."""
    if source.id == target.id:
        return _SAME
    if source.host != target.host:
        return Link("network", 12.5, 1e-3)  # 100 Gb/s Ethernet/InfiniBand, one Dask hop
    if source.kind == "gpu" and target.id in source.nvlink_peers:
        return Link("nvlink", 300.0, 5e-4)
    if source.kind == "cpu" or target.kind == "cpu":
        # Between worker processes of one machine (a GPU worker's outputs are in its host
        # memory too): the batch is pickled and sent by the producer's worker while its next
        # node computes, on the same cores. Measured on 2 cores (grpo_tiny, score and
        # advantage moved to a second worker): the reference forward beside those two hops
        # took 15-18 ms instead of 10, the step 7 ms longer.
        return Link("host", 5.0, 3e-3)
    return Link("pcie", _pcie_gbs(source if source.kind == "gpu" else target), 5e-4)


def _pcie_gbs(device: Device) -> float:
    if device.pcie_gen and device.pcie_width:
        # about 2 GB/s per gen-4 lane after encoding; each generation doubles it
        return 2.0 * 2 ** (device.pcie_gen - 4) * device.pcie_width * 0.8
    return 25.0  # a gen-4 x16 link, sustained


def transfer_s(num_bytes: float, sources: Sequence[Device], targets: Sequence[Device]) -> float:
    """Time to move ``num_bytes`` to every target: the slowest link any target needs."""
    worst = 0.0
    source_ids = {device.id for device in sources}
    for target in targets:
        if target.id in source_ids or not sources:
            continue
        best = min((link_between(s, target) for s in sources), key=lambda l: l.latency_s + num_bytes / (l.bandwidth_gbs * GB))
        worst = max(worst, best.latency_s + num_bytes / (best.bandwidth_gbs * GB))
    return worst


@dataclass(frozen=True)
class NodeMemory:
    """Memory one node needs on each device it runs on, in GB."""

    weights_gb: float
    """The model's weights (0 for a node without a model)."""
    state_gb: float
    """Gradients and optimizer state (update nodes only); resident like the weights."""
    transient_gb: float
    """Activations and the output head's logits while the node runs."""
    cache_gb: float = 0.0
    """What generation keeps between its calls (the decoder's KV cache and stacked
    weights); resident like the weights, but rebuilt rather than moved with the model."""


class CostSource(Protocol):
    """Numbers the search and the simulator need; estimates and measurements alike."""

    def compute_s(self, node: str, devices: Sequence[Device], offloaded: bool) -> float:
        """Seconds ``node`` runs on ``devices`` (data-parallel over all of them)."""
        ...

    def fixed_s(self, node: str, devices: Sequence[Device], offloaded: bool) -> float:
        """The part of :meth:`compute_s` that the threads a call gets do not shorten (the
        call's and the model's overheads per layer, per token of a pass or row of a decode
        step, and per pass: Python, dispatch, small element-wise operations), so
        that sharing a machine's cores does not slow it (``planner.sharing.shared_time``)."""
        ...

    def memory(self, node: str, width: int, gpu: bool = False) -> NodeMemory:
        """Memory per device when ``node`` runs ``width`` ways data-parallel (on GPUs when
        ``gpu``: their training passes run compiled layers, which keep fewer activations)."""
        ...

    def output_bytes(self, node: str) -> float:
        """Bytes of the node's result that its consumers read."""
        ...

    def work(self, node: str) -> NodeWork:
        """The node's work (model, shape, sequences, lengths)."""
        ...


class EstimatedCosts:
    """Every number from the analytic cost model; nothing measured except ``cpu_rates``."""

    def __init__(
        self,
        pipeline: PipelineGraph,
        cpu_rates: CpuRates | None = None,
        base_dir: Path | None = None,
        prompt_tokens: int | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.cpu_rates = cpu_rates or CpuRates()
        self._work = {
            node: node_work(pipeline, node, base_dir, prompt_tokens)
            for node in pipeline.topological_order()
        }

    def work(self, node: str) -> NodeWork:
        return self._work[node]

    def with_work(self, node: str, work: NodeWork) -> EstimatedCosts:
        """A copy in which ``node`` does ``work`` (the same rates and estimates otherwise)."""
        other = copy.copy(self)
        other._work = {**self._work, node: work}
        return other

    def for_pipeline(self, pipeline: PipelineGraph) -> EstimatedCosts:
        """A copy that belongs to ``pipeline``, whose nodes do this copy's work (no estimate
        made again)."""
        other = copy.copy(self)
        other.pipeline = pipeline
        return other

    def compute_s(self, node: str, devices: Sequence[Device], offloaded: bool) -> float:
        work = self._work[node]
        width = max(1, len(devices))
        slowest = max((self._on_device(work, device, width)[0] for device in devices), default=0.0)
        if work.shape is not None and width > 1 and work.work == "train":
            grads = work.trained_parameters * DTYPE_BYTES[work.dtype]
            steps = work.num_mini_batches * work.ppo_epochs
            if work.sharded:
                # sharded: each pass gathers the parameters for its forward and again for its
                # backward, the last one reduce-scatters the gradients; one more gather
                # refreshes the whole copy after the update. Each of these is one collective
                # per unit (a decoder layer, or the outer unit), each paying the link's latency.
                # the busiest rank's whole passes: 8 sequences on 3 ranks at 2 a pass is 3 rows
                # there, 2 passes (a fraction would price 1.33)
                passes = _update_passes(work, width)
                units = work.shape.num_layers + 1
                gather = units * transfer_s((width - 1) / width * grads / units, devices[:1], devices[1:])
                slowest += gather * ((2 * passes + 1) * steps + 1)
            else:
                # a ring all-reduce of the gradients per optimizer step
                slowest += transfer_s(2 * (width - 1) / width * grads, devices[:1], devices[1:]) * steps
        if offloaded and work.shape is not None:
            weights = weight_bytes(work.shape, work.kind, work.dtype)
            slowest += max(weights / (_pcie_gbs(d) * GB) for d in devices if d.kind == "gpu") if any(
                d.kind == "gpu" for d in devices
            ) else 0.0
        return CALL_OVERHEAD_S + slowest

    def fixed_s(self, node: str, devices: Sequence[Device], offloaded: bool) -> float:
        work = self._work[node]
        width = max(1, len(devices))
        return CALL_OVERHEAD_S + max((self._on_device(work, device, width)[1] for device in devices), default=0.0)

    def _on_device(self, work: NodeWork, device: Device, width: int) -> tuple[float, float]:
        """(seconds, the part of them that is overheads) of ``work`` on one of ``width`` devices."""
        if work.work == "function":
            return work.num_sequences * self.cpu_rates.reward_s_per_sequence, 0.0
        if work.work == "elementwise":
            return work.num_sequences * ADVANTAGE_S_PER_SEQUENCE, 0.0
        assert work.shape is not None, f"{work.work} node without a model shape"
        flops_per_s, bytes_per_s, overheads = self._rates(device, work.dtype)
        shape, kind, dtype = work.shape, work.kind, work.dtype
        share = work.rank_sequences(width)  # the busiest rank sets the step (ranks hold whole rows)
        prompt, response = work.prompt_tokens, work.response_tokens
        weights = weight_bytes(shape, kind, dtype)
        layers = shape.num_layers
        forward_overhead = layers * overheads.forward_layer_s + overheads.forward_pass_s
        if work.work == "decode":
            # a prompt repeated for its group's samples is prefilled once
            prompts = share / work.group_size
            prefill_overhead = forward_overhead + layers * prompts * prompt * overheads.forward_token_s
            prefill = forward_flops(shape, kind, prompts, prompt) / flops_per_s + prefill_overhead
            context = prompt + (response + 1) / 2  # mean context over the decode steps
            step_bytes = weights + kv_cache_bytes(shape, dtype, share, 1) * context
            step_flops = forward_flops(shape, kind, share, 1) + (
                4 * layers * shape.hidden_size * context * share
            )
            step_overhead = layers * (overheads.decode_layer_s + share * overheads.decode_row_s) + overheads.decode_step_s
            step = max(step_bytes / bytes_per_s, step_flops / flops_per_s) + step_overhead
            return prefill + response * step, prefill_overhead + response * step_overhead
        seq_len = prompt + response

        def pass_work(sharing: bool) -> tuple[float, float]:
            """(FLOPs, tokens) of one pass over the share: each prompt once where ``sharing``."""
            if sharing:
                return (shared_prompt_flops(shape, kind, share, work.group_size, prompt, response),
                        share / work.group_size * prompt + share * response)
            return forward_flops(shape, kind, share, seq_len), share * seq_len

        def no_grad_forward(sharing: bool) -> tuple[float, float]:
            """(seconds, overheads among them) of a no-grad forward over the share in passes."""
            flops, tokens = pass_work(sharing)
            fixed = _passes(share, work.pass_sequences(share)) * forward_overhead + layers * tokens * overheads.forward_token_s
            return flops / flops_per_s + weights / bytes_per_s + fixed, fixed

        on_cpu = device.kind == "cpu"
        if work.work == "train":
            pass_flops, tokens = pass_work(work.shares_prompts(on_cpu))
            # forward + backward (+ recompute); a frozen model's backward (adapters) computes
            # the input gradients only, one forward's FLOPs instead of two
            backward = 1 if work.adapter_parameters else 2
            recompute = 1 if work.checkpointing else 0
            compute = (1 + backward + recompute) * pass_flops / flops_per_s
            optimizer = optimizer_step_bytes(work.trained_parameters, dtype) / bytes_per_s
            # the overheads of each pass of a mini-batch (its micro-batches of micro_batch_tokens)
            passes = _update_passes(work, width)
            per_pass = layers * (overheads.train_layer_s * (1 + backward) / 3 + recompute * overheads.forward_layer_s)
            launches = passes * (per_pass + overheads.train_pass_s)
            # and per token, over the whole batch once per epoch (whatever its mini-batches);
            # a frozen model's backward skips the weights' gradients (FLOPs), not the small
            # element-wise steps that carry the input gradients, so the token part stays whole
            per_token = layers * (overheads.train_token_s + recompute * overheads.forward_token_s)
            token_overhead = tokens * per_token
            # the old log-probs (or values) first: a no-grad forward in the rollout's order
            old_s, old_fixed = (no_grad_forward(replace(work, work="forward").shares_prompts(on_cpu))
                                if work.old_outputs_pass else (0.0, 0.0))
            return (old_s + work.ppo_epochs * (compute + token_overhead + work.num_mini_batches * (optimizer + launches)),
                    old_fixed + work.ppo_epochs * (token_overhead + work.num_mini_batches * launches))
        # score with a reward model, reference_logprob, value: one no-grad forward per pass
        return no_grad_forward(work.shares_prompts(on_cpu))

    def _rates(self, device: Device, dtype: str) -> tuple[float, float, Overheads]:
        """(FLOP/s, bytes/s, overheads) that ``device`` achieves for ``dtype``."""
        if device.kind == "cpu":
            slow = 1.0 if dtype == "fp32" else 4.0  # CPUs lack fast 16-bit matmuls
            rates = self.cpu_rates
            return rates.flops_per_s / slow, rates.bandwidth_gbs * GB, rates.overheads
        tflops = device.tflops_bf16 or DEFAULT_TFLOPS
        flops = tflops * 1e12 * GPU_MATMUL_EFFICIENCY
        if dtype == "fp32":
            flops /= FP32_SLOWDOWN
        bandwidth = (device.bandwidth_gbs or DEFAULT_BANDWIDTH_GBS) * GB * GPU_BANDWIDTH_EFFICIENCY
        return flops, bandwidth, GPU_OVERHEADS

    def memory(self, node: str, width: int, gpu: bool = False) -> NodeMemory:
        work = self._work[node]
        if work.shape is None:
            return NodeMemory(0.0, 0.0, 0.0)
        shape, kind, dtype = work.shape, work.kind, work.dtype
        share = work.rank_sequences(width)  # the busiest rank's rows set the peak
        seq_len = work.prompt_tokens + work.response_tokens
        weights = weight_bytes(shape, kind, dtype)
        if work.work == "decode":
            cache = decoder_cache_bytes(shape, kind, dtype, share, seq_len)
            # the static decoder reads merged copies of the adapted layers' weights
            cache += work.adapted_parameters * DTYPE_BYTES[dtype]
            return NodeMemory(weights / GB, 0.0, logits_bytes(shape, kind, share, dtype) / GB, cache / GB)
        if work.work == "train":
            micro = work.pass_sequences(work.rank_sequences(width, mini_batch=True))
            sharded = work.sharded and width > 1
            transient = activation_bytes(shape, dtype, micro, seq_len, work.checkpointing, compiled=gpu)
            transient += logits_bytes(shape, kind, micro * seq_len, dtype, training=True)
            if sharded:
                resident, gathered = sharded_training_bytes(shape, kind, dtype, width)
                return NodeMemory(weights / GB, resident / GB, (transient + gathered) / GB)
            trained = training_state_bytes(work.trained_parameters, dtype, adapters=work.adapter_parameters > 0)
            return NodeMemory(weights / GB, trained / GB, transient / GB)
        transient = inference_bytes(shape, kind, dtype, work.pass_sequences(share), seq_len)
        return NodeMemory(weights / GB, 0.0, transient / GB)

    def output_bytes(self, node: str) -> float:
        work = self._work[node]
        sequences, response = work.num_sequences, work.response_tokens
        if work.output == "rollout":
            # token ids and attention mask (int64) of prompt + completion, fp32 logprobs
            return sequences * (work.prompt_tokens + response) * 16 + sequences * response * 4
        if work.output == "per_sequence":
            return sequences * 4.0
        if work.output == "per_token":
            return sequences * response * 4.0
        return 0.0  # metrics only


@dataclass
class MeasuredCosts:
    """Measured node times where the profiler has them, ``fallback`` everywhere else.

    Times are kept per (node, device type, width) as an exponentially weighted moving
    average, so one slow step moves the estimate by ``alpha`` of the difference.
    """

    fallback: CostSource
    alpha: float = 0.3
    """Weight of the newest measurement in the moving average (0..1). Default 0.3."""
    times_s: dict[tuple[str, str, int], float] = field(default_factory=dict)

    def observe(self, node: str, devices: Sequence[Device], seconds: float) -> None:
        key = (node, _device_type(devices), len(devices))
        old = self.times_s.get(key)
        self.times_s[key] = seconds if old is None else old + self.alpha * (seconds - old)

    def compute_s(self, node: str, devices: Sequence[Device], offloaded: bool) -> float:
        key = (node, _device_type(devices), len(devices))
        if key in self.times_s:
            return self.times_s[key]
        return self.fallback.compute_s(node, devices, offloaded)

    def fixed_s(self, node: str, devices: Sequence[Device], offloaded: bool) -> float:
        # a measured time keeps the estimate's share of overheads
        fixed = self.fallback.fixed_s(node, devices, offloaded)
        key = (node, _device_type(devices), len(devices))
        if key not in self.times_s:
            return fixed
        estimate = self.fallback.compute_s(node, devices, offloaded)
        return self.times_s[key] * min(1.0, fixed / estimate) if estimate > 0 else 0.0

    def memory(self, node: str, width: int, gpu: bool = False) -> NodeMemory:
        return self.fallback.memory(node, width, gpu)

    def output_bytes(self, node: str) -> float:
        return self.fallback.output_bytes(node)

    def work(self, node: str) -> NodeWork:
        return self.fallback.work(node)


def _passes(sequences: float, per_pass: float) -> int:
    """Passes that ``sequences`` take at ``per_pass`` sequences each (at least one)."""
    return max(1, math.ceil(sequences / max(per_pass, 1e-9) - 1e-9))


def _update_passes(work: NodeWork, width: int) -> int:
    """Passes of one optimizer step on the busiest of ``width`` ranks (its whole rows of a
    mini-batch, ``micro_batch_tokens`` at a time)."""
    rows = work.rank_sequences(width, mini_batch=True)
    return _passes(rows, work.pass_sequences(rows))


def _device_type(devices: Sequence[Device]) -> str:
    return "+".join(sorted({device.name for device in devices}))


__all__ = [
    "CostSource",
    "DTYPE_BYTES",
    "EstimatedCosts",
    "Link",
    "MeasuredCosts",
    "NodeMemory",
    "link_between",
    "transfer_s",
]
