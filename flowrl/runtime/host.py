"""The Dask actor that owns one device slot's models and runs their node calls.

One ``RoleHost`` lives on each worker for the whole run. The driver sends every node call
of a step at once; each call waits here, on the worker's event loop, until its inputs
exist (in this host's store, or fetched from another host), then computes on the host's
single compute thread, so node calls on one device never overlap and their order follows
the data. Waiting never holds the compute thread, so no arrival order can deadlock, and
another worker can fetch a finished batch while this host computes.

    driver --run_node(call) x all nodes--> host B
        host B (event loop): await inputs: local event, or host A.fetch(key) (A's event loop)
        host B (compute thread): role function -> output stored under "step:node", event set
        host B --NodeReport (numbers only)--> driver
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import replace
from concurrent.futures import ThreadPoolExecutor
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import torch

from flowrl.profiler import DeviceSampler
from flowrl.records import DeviceSample
from flowrl.rewards import RewardCache
from flowrl.roles.batch import NodeOutput, Rollout, Scores
from flowrl.roles.data_parallel import DataParallel, weighted_rows
from flowrl.roles.samples import sample_rows
from flowrl.roles.shards import shard_of
from flowrl.runtime.collective import DeviceGroup, free_port, weights_group
from flowrl.runtime.calls import EVAL_KEY, EvalCall, HeldOutScoreCall, NodeCall, NodeReport, key_step, store_key
from flowrl.runtime.malloc import undo_nanny_malloc_trim
from flowrl.runtime.packing import Packed, pack
from flowrl.runtime.serialization import register
from flowrl.runtime.torch_profile import file_stem, profiled

if TYPE_CHECKING:
    from flowrl.roles.state import ModelState

# The role modules (and with them transformers) are imported where a worker first needs
# them, not here: the driver imports this module for the actor's class only, and a worker
# has them already (it preloads ``flowrl.runtime.warm``).


class RoleHost:
    def __init__(
        self,
        device_name: str,
        device: str,
        torch_threads: int,
        seed: int,
        base_dir: str | None,
        cores: tuple[int, ...] | None = None,
        sample_interval_s: float = 0.5,
        gpu_index: int | None = None,
    ) -> None:
        register()
        undo_nanny_malloc_trim()
        if cores:
            _pin_process(cores)
        from transformers.utils import logging as hf_logging

        # Shard progress bars and info logs from workers only clutter the driver's view.
        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
        torch.set_num_threads(max(1, torch_threads))
        self.torch_threads = max(1, torch_threads)
        """The worker's own setting: calls that name no thread count run with it."""
        self.device_name = device_name
        self.device = device
        self.seed = seed
        self.base_dir = Path(base_dir) if base_dir else None
        self.models: dict[str, ModelState] = {}
        self.store: dict[str, Any] = {}
        self._staged: dict[str, Packed] = {}
        """Model -> state copied aside by ``stage_state``, until ``take_staged`` hands it over."""
        self._ready: dict[str, asyncio.Event] = {}
        self._rewards = RewardCache(self.base_dir)
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flowrl-compute")
        self._groups: dict[str, DeviceGroup] = {}
        usable = len(cores) if cores else (os.cpu_count() or 1)
        self._sampler = DeviceSampler(device_name, min(max(1, torch_threads), usable), sample_interval_s, gpu_index)
        # a joined cluster's workers outlive the run: the host's threads end with it, however
        # it ends (dropped by its session, or forgotten by Dask with the run's client)
        self._threads = weakref.finalize(self, _stop_threads, self._sampler, self._compute)

    async def _computed(self, work: Any, *args: Any) -> Any:
        """Run ``work(*args)`` on the compute thread. Every tensor operation of this host goes
        there, one at a time, never beside a node call: torch's parallel CPU kernels keep a
        pool of threads per calling thread, and a second pool in the worker (made by a
        snapshot's copy of the weights on another thread) changed how the first one waited
        for work (with OpenMP's spinning on, each later update took 1.4x as long)."""
        return await asyncio.get_running_loop().run_in_executor(self._compute, work, *args)

    # ---- models -------------------------------------------------------------------
    async def load_model(self, name: str, spec: Any, seed: int, adapter_seed: int = 0) -> dict[str, Any]:
        return await self._computed(self._load_model, name, spec, seed, adapter_seed)

    def _load_model(self, name: str, spec: Any, seed: int, adapter_seed: int = 0) -> dict[str, Any]:
        """``seed``: this copy's sampling RNG; ``adapter_seed``: the run's, for the initial
        adapters (``spec.lora``), the same in every copy."""
        from flowrl.backends.hf import HubOptions
        from flowrl.roles.state import ModelState

        state = ModelState.load(
            name,
            spec.path,
            dtype=spec.dtype,
            device=self.device,
            seed=seed,
            base_dir=self.base_dir,
            gradient_checkpointing=spec.gradient_checkpointing,
            kind=spec.kind,
            options=HubOptions(revision=spec.revision, trust_remote_code=spec.trust_remote_code),
            lora=spec.lora,
            adapter_seed=adapter_seed,
        )
        state.shards_training = spec.sharded
        if spec.offload_to_cpu:
            state.page_out()
        self.models[name] = state
        num_parameters = sum(p.numel() for p in state.module.parameters())
        # with adapters, the model's own weights are frozen: what an update trains is smaller
        trained = sum(p.numel() for p in state.module.parameters() if p.requires_grad)
        return {"model": name, "device": self.device_name, "num_parameters": num_parameters,
                "trained_parameters": trained}

    async def receive_weights(self, model: str, weights: dict[str, torch.Tensor]) -> None:
        await self._computed(self.models[model].load_weights, weights)

    async def receive_broadcast(self, model: str, group: str) -> None:
        """Receive ``model``'s new weights from the trainer over process group ``group``."""
        await self._computed(_broadcast_weights, self.models[model], self._groups[group])

    # ---- process groups (data-parallel training) -----------------------------------
    def free_port(self, address: str) -> int:
        return free_port(address)

    def form_group(self, name: str, rank: int, world: int, address: str, port: int, timeout_s: float,
                   sharding: bool = False) -> None:
        """Join the process group ``name`` (blocks until every member has joined); with
        ``sharding``, the group the update ``name`` trains its model sharded over."""
        self._leave_group(name)
        self._groups[name] = DeviceGroup(address, port, rank, world, timeout_s, self.device, sharding)

    async def leave_group(self, name: str) -> None:
        group = self._groups.get(name)
        if group is not None and group.sharding:
            await self._computed(self._leave_group, name)  # its gathers are tensor work
        else:
            self._leave_group(name)  # nothing to compute: never queued behind a node call

    def _leave_group(self, name: str) -> None:
        """Leave group ``name``. Models trained sharded over it gather their whole optimizer
        state first (every member leaves at once, so the gathers meet) and train whole until
        a new group shards them again."""
        group = self._groups.pop(name, None)
        if group is None:
            return
        try:
            if group.sharding:
                for state in self.models.values():
                    state.unshard_training()  # a gather; on failure the shards are dropped
        finally:
            group.close()

    # ---- migration ----------------------------------------------------------------
    async def export_state(self, model: str, parts: tuple[str, ...]) -> dict[str, Any]:
        return await self._computed(self._export_state, model, parts)

    def _export_state(self, model: str, parts: tuple[str, ...]) -> dict[str, Any]:
        """Parts of a model's state for another host: ``weights``, ``optimizer`` (with the
        update count) and ``generator`` (the sampling RNG). ``optimizer_peer``: this rank of
        a sharded model takes part in gathering the whole optimizer state that another rank
        exports (or saves) at the same time, and returns nothing of it."""
        state = self.models[model]
        exported: dict[str, Any] = {}
        if "weights" in parts:
            exported["weights"] = state.weights()
        if "optimizer" in parts:
            # whole tensors: for a sharded model, every rank exports at once (a gather)
            exported["optimizer"] = state.optimizer_state()
            exported["num_updates"] = state.num_updates
        if "optimizer_peer" in parts:
            state.optimizer_state()
        if "generator" in parts:
            exported["generator"] = state.generator.get_state()
        return exported

    async def stage_state(self, model: str, parts: tuple[str, ...]) -> None:
        """Copy ``export_state``'s parts aside, packed (``runtime.packing``: one buffer per
        dtype, so the optimizer's tensors, which the next update changes in place, are copied
        too), for ``take_staged`` to hand over while later calls run: a snapshot holds the
        next step up for the copy only, not for the transfer."""
        self._staged[model] = await self._computed(self._packed_state, model, parts)

    def _packed_state(self, model: str, parts: tuple[str, ...]) -> Packed:
        return pack(self._export_state(model, parts))

    async def take_staged(self, model: str) -> Packed:
        """The state ``stage_state`` copied aside (once)."""
        return self._staged.pop(model)

    async def adopt_model(
        self, name: str, spec: Any, seed: int, sources: tuple[tuple[Any, tuple[str, ...]], ...], reseed: bool = False,
        adapter_seed: int = 0,
    ) -> dict[str, float]:
        """Take over (part of) a model's state from other hosts: load the model here if this
        host lacks it, then pull each listed part straight from the host that has it.

        Async, so that two hosts adopting from each other (a swap) never wait on each other:
        the pulls are awaited on the event loop, the loading runs on the compute thread.
        """
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        if name not in self.models:
            await loop.run_in_executor(self._compute, self._load_model, name, spec, seed, adapter_seed)
        num_bytes = 0
        for source, parts in sources:
            exported = await source.export_state(name, parts)
            num_bytes += _state_bytes(exported)
            await loop.run_in_executor(self._compute, self.models[name].restore, exported)
        if reseed:
            self.models[name].generator.manual_seed(seed)
        return {"seconds": time.perf_counter() - started, "bytes": float(num_bytes)}

    def drop_all(self) -> None:
        """Forget every model, stored output and process group, and end the host's threads
        (this host's session is over; its peers may be gone, so nothing is gathered)."""
        self.models.clear()
        self.store.clear()
        self._staged.clear()
        for group in set(self._groups.values()):
            group.close()
        self._groups.clear()
        self._threads()  # no call comes after this one

    def drop_model(self, name: str) -> None:
        """Forget a model whose nodes all moved away (its memory goes back to the worker)."""
        self.models.pop(name, None)

    def drop_training(self, name: str) -> None:
        """Forget a model's optimizer (its moments, a bf16 model's masters) and sharded copy
        where its update moved away and only its other nodes stay."""
        state = self.models.get(name)
        if state is not None:
            state.optimizer = state.pending_optimizer = state.sharded = None

    # ---- node calls ---------------------------------------------------------------
    async def run_node(self, call: NodeCall) -> NodeReport:
        arrived, arrived_at = time.perf_counter(), time.time()
        self._forget_before(call.step)
        index, count = call.shard
        key = store_key(call.step, call.node, index)
        try:
            inputs: dict[str, Any] = {}
            for ref in call.inputs:
                inputs[ref.name] = await (self._stored(ref.key) if ref.host is None else ref.host.fetch(ref.key))
            for name, value in inputs.items():
                if isinstance(value, _Failed):
                    raise UpstreamFailed(f"node '{call.node}' did not run: its input '{name}' failed ({value.message})")
            # A node split by rows computes its rows of the rollout, generation its share of
            # whole prompts (so each prompt's samples stay together); a data-parallel update's
            # ranks all read the whole rollout and divide it themselves (``DataParallel``).
            how = call.spec.split if count > 1 else "none"
            whole = _rollout_input(call, inputs) if how == "rows" else None
            split = how in ("rows", "prompts")
            rows = slice(0, 0)
            if whole is not None:
                rows = weighted_rows(whole[1].num_sequences, index, call.part_shares)
                inputs = {**inputs, whole[0]: shard_of(whole[1], index, call.part_shares)}
            elif how == "prompts":
                rows = weighted_rows(len(call.prompts), index, call.part_shares)
                call = replace(call, prompts=call.prompts[rows])
            loop = asyncio.get_running_loop()
            if split and rows.stop == rows.start:
                # a share too small for a single row: nothing to compute, an empty part
                output, compute_s, waited_s = NodeOutput(value=None), 0.0, time.perf_counter() - arrived
            else:
                output, compute_s, waited_s = await loop.run_in_executor(self._compute, self._timed, call, inputs, arrived)
            if split and index == 0:
                output = await self._join(call, output, whole[1] if whole is not None else None)
        except BaseException as error:
            # Consumers waiting for this output must not wait forever.
            self._publish(key, _Failed(f"{type(error).__name__}: {error}"))
            raise
        self._publish(key, output.value)
        return NodeReport(
            node=call.node,
            role=call.role,
            device=self.device_name,
            key=key,
            wall_s=time.perf_counter() - arrived,
            compute_s=compute_s,
            wait_s=waited_s,
            tokens_in=output.tokens_in,
            tokens_out=output.tokens_out,
            metrics=output.metrics,
            peak_memory_gb=output.peak_memory_gb,
            device_memory_gb=output.device_memory_gb,
            arrived_at=arrived_at,
            messages=output.messages,
        )

    async def evaluate(self, call: EvalCall) -> NodeReport:
        """Generate for the held-out prompts and score them, on the compute thread (between
        two steps, so it never overlaps a node call)."""
        from flowrl.roles.evaluate import EvalScorer, run_evaluation

        arrived = time.perf_counter()
        scorers = tuple(
            EvalScorer(node, self._rewards.get(fn), fn if isinstance(fn, str) else fn.name, params)
            for node, fn, params in call.scorers
        )

        def work() -> tuple[NodeOutput, float]:
            started = time.perf_counter()
            state = self.models[call.model]
            with state.paged_in():  # an offloaded model's weights are on the device only now
                output = run_evaluation(state, call.examples, call.settings, scorers, call.keep)
            return output, time.perf_counter() - started

        key = store_key(call.step, EVAL_KEY)
        try:
            output, compute_s = await asyncio.get_running_loop().run_in_executor(self._compute, work)
        except BaseException as error:
            if call.keep:  # reward models waiting for the completions must not wait forever
                self._publish(key, _Failed(f"{type(error).__name__}: {error}"))
            raise
        if call.keep:
            self._publish(key, output.value)
        return NodeReport(
            node="eval", role="eval", device=self.device_name, key=f"{call.step}:eval",
            wall_s=time.perf_counter() - arrived, compute_s=compute_s, wait_s=0.0,
            tokens_in=output.tokens_in, tokens_out=output.tokens_out, metrics=output.metrics,
            messages=output.messages,
        )

    async def score_held_out(self, call: HeldOutScoreCall) -> NodeReport:
        """Score an evaluation's completions, kept on the hosts that generated them, with this
        host's reward model (on the compute thread, between two steps)."""
        from flowrl.roles.evaluate import score_held_out

        arrived = time.perf_counter()
        key = store_key(call.step, EVAL_KEY)
        rollouts: list[Any] = []
        for source in call.sources:
            part = await (self._stored(key) if source is None else source.fetch(key))
            if isinstance(part, _Failed):
                raise UpstreamFailed(f"the evaluation's completions could not be generated ({part.message})")
            rollouts.extend(part)
        waited_s = time.perf_counter() - arrived

        def work() -> tuple[NodeOutput, float]:
            started = time.perf_counter()
            state = self.models[call.model]
            with state.paged_in():  # an offloaded reward model's weights are on the device only now
                output = score_held_out(state, call.node, rollouts, call.n, call.micro_batch_tokens, call.retokenize)
            return output, time.perf_counter() - started

        output, compute_s = await asyncio.get_running_loop().run_in_executor(self._compute, work)
        return NodeReport(
            node="eval", role="eval", device=self.device_name, key=f"{key}:{call.node}",
            wall_s=time.perf_counter() - arrived, compute_s=compute_s, wait_s=waited_s,
            tokens_in=output.tokens_in, tokens_out=0, metrics=output.metrics,
        )

    async def _join(self, call: NodeCall, own: NodeOutput, rollout: Any) -> NodeOutput:
        """Shard 0 of a split node: wait for the other shards' parts, join them in row order."""
        from flowrl.roles import registry

        parts = [own.value]
        for number, peer in enumerate(call.shard_peers, start=1):
            part = await peer.fetch(store_key(call.step, call.node, number))
            if isinstance(part, _Failed):
                raise UpstreamFailed(f"node '{call.node}' shard {number} failed ({part.message})")
            parts.append(part)
        value, metrics = await self._computed(
            registry.role(call.role).join, [part for part in parts if part is not None], rollout, call.spec)
        return NodeOutput(value=value, metrics=metrics, tokens_in=own.tokens_in, tokens_out=own.tokens_out,
                          messages=value.messages() if isinstance(value, Scores) else ())

    def _timed(self, call: NodeCall, inputs: dict[str, Any], arrived: float) -> tuple[NodeOutput, float, float]:
        on_gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
        if on_gpu:
            # Node calls run one after another on the compute thread: the peak between two
            # resets is this call's own.
            torch.cuda.reset_peak_memory_stats()
        # The call's own thread count for the call only: whatever else runs on the compute
        # thread after it (evaluation, weight pushes, checkpoints) gets the worker's own.
        if call.threads and call.threads != torch.get_num_threads():
            torch.set_num_threads(call.threads)
        started = time.perf_counter()
        state = self.models.get(call.model) if call.model is not None else None
        try:
            with contextlib.ExitStack() as stack:
                if call.profile_dir:
                    stack.enter_context(profiled(call.profile_dir, file_stem(call.node, call.shard), on_gpu))
                if state is not None:
                    stack.enter_context(state.paged_in())  # an offloaded model's weights are on the device only now
                output = self._dispatch(call, inputs)
        finally:
            if torch.get_num_threads() != self.torch_threads:
                torch.set_num_threads(self.torch_threads)
        if on_gpu:
            free, total = torch.cuda.mem_get_info()
            output = replace(output, peak_memory_gb=torch.cuda.max_memory_allocated() / 1e9,
                             device_memory_gb=total / 1e9)
        # Time blocked on peers counts as waiting, not as this device's work.
        return output, time.perf_counter() - started - output.blocked_s, started - arrived + output.blocked_s

    def _dispatch(self, call: NodeCall, inputs: dict[str, Any]) -> NodeOutput:
        """Run the call's role (``roles.registry``); after a role that trains, push the new
        weights to the model's other copies."""
        from flowrl.roles import registry

        role, trains = registry.role(call.role), call.spec.trains
        group = None
        if call.shard[1] > 1 and trains:
            members = self._groups[call.node]
            group = DataParallel(members, call.part_shares, mesh=members.mesh() if members.sharding else None)
        context = registry.RoleContext(self.models, self._rewards, self.seed, group)
        request = registry.RoleCall(call.node, call.spec, call.prompts, call.group_size, call.kl_coef, call.lr)
        output = role.run(context, _inputs_by_role(call, inputs), request)
        if trains and call.model is not None and call.weight_peers:
            output.metrics.update(self._push_weights(call.model, call.weight_peers, call.node))
        return output

    def _push_weights(self, model: str, peers: tuple[Any, ...], node: str) -> dict[str, float]:
        """Send updated weights straight to the other workers that hold the model: over the
        node's weights group when the driver formed one (``runtime.weight_sync``), else by a
        call to each worker."""
        if not peers:
            return {}
        started = time.perf_counter()
        group = self._groups.get(weights_group(node))
        if group is not None:
            calls = [peer.receive_broadcast(model, weights_group(node)) for peer in peers]
            num_bytes = _broadcast_weights(self.models[model], group) * len(peers)
        else:
            weights = self.models[model].weights()
            calls = [peer.receive_weights(model, weights) for peer in peers]
            num_bytes = sum(t.numel() * t.element_size() for t in weights.values()) * len(peers)
        for call in calls:
            call.result()
        seconds = time.perf_counter() - started
        return {"perf/weight_sync_s": seconds, "perf/weight_sync_mb": num_bytes / 1e6,
                "perf/weight_sync_collective": 1.0 if group is not None else 0.0}

    # ---- data plane -----------------------------------------------------------------
    def _publish(self, key: str, value: Any) -> None:
        """Store an output (or its failure) under ``key`` and wake whoever waits for it."""
        self.store[key] = value
        self._event(key).set()

    def _event(self, key: str) -> asyncio.Event:
        event = self._ready.get(key)
        if event is None:
            event = self._ready[key] = asyncio.Event()
        return event

    async def _stored(self, key: str) -> Any:
        await self._event(key).wait()
        return self.store[key]

    async def fetch(self, key: str) -> Any:
        """A peer's request for an output: a rollout whose texts still decode leaves once
        they are done (waited for here, so that pickling it never blocks this event loop)."""
        value = await self._stored(key)
        # an evaluation keeps a list of rollouts (one per chunk of prompts)
        for rollout in value if isinstance(value, list) else [value]:
            texts = rollout.texts_pending() if isinstance(rollout, Rollout) else None
            if texts is None:
                continue
            try:
                await asyncio.wrap_future(texts)
            except Exception as error:  # noqa: BLE001 - the producer's failure, told as such
                step, _, node = key.partition(":")
                raise UpstreamFailed(f"the completion texts of node '{node}' at step {step} could not be decoded: "
                                     f"{type(error).__name__}: {error}") from error
        return value

    async def samples(self, key: str, rows: int) -> list[dict[str, Any]]:
        """The first ``rows`` rows of the output stored under ``key`` as plain values
        (:func:`flowrl.roles.samples.sample_rows`): a few texts and numbers, not the batch."""
        return sample_rows(await self.fetch(key), rows)

    def _forget_before(self, step: int) -> None:
        # The driver starts step s only after every node of step s-1 finished, so no
        # worker can still want an older batch.
        for key in [k for k in self.store if key_step(k) < step]:
            del self.store[key]
            self._ready.pop(key, None)

    # ---- measuring ----------------------------------------------------------------
    def sample_device(self) -> DeviceSample:
        """Mean utilisation and peak memory since the previous call (the sampler's thread
        samples every ``sample_interval_s``)."""
        return self._sampler.read()

    # ---- checkpoints --------------------------------------------------------------
    async def save_models(self, directory: str, names: list[str], with_state: bool, max_shard_size: str) -> None:
        await self._computed(self._save_models, directory, names, with_state, max_shard_size)

    def _save_models(self, directory: str, names: list[str], with_state: bool, max_shard_size: str) -> None:
        """Write models to ``directory/<name>/``, weights in files of at most ``max_shard_size``
        (``trainer.max_shard_size``, which the driver passes with each call)."""
        from flowrl.runtime import checkpoint

        for name in names:
            checkpoint.save_model_state(self.models[name], Path(directory) / name, with_state, max_shard_size)

    async def load_models(self, directory: str, names: list[str], parts: tuple[str, ...] | None = None) -> None:
        await self._computed(self._load_models, directory, names, parts)

    def _load_models(self, directory: str, names: list[str], parts: tuple[str, ...] | None = None) -> None:
        """Restore models from a checkpoint; ``parts`` limits what is taken (None: all)."""
        from flowrl.runtime import checkpoint

        for name in names:
            checkpoint.load_model_state(self.models[name], Path(directory) / name, parts)

    async def restore_state(self, model: str, saved: dict[str, Any]) -> None:
        """Take over a snapshot made by ``export_state`` (after a lost worker)."""
        await self._computed(self.models[model].restore, saved)


class UpstreamFailed(RuntimeError):
    """A node's input failed; the input's own error is the one the driver reports."""


class _Failed:
    """Stored in place of an output whose node raised."""

    def __init__(self, message: str) -> None:
        self.message = message


def _pin_process(cores: tuple[int, ...]) -> None:
    """Run every thread of this worker on ``cores`` only; threads started later inherit it.

    A CPU device slot is then a real share of the machine: another process busy on those
    cores slows this slot and not its neighbours, which is what the scheduler measures.
    """
    for thread in psutil.Process(os.getpid()).threads():
        try:
            os.sched_setaffinity(thread.id, cores)
        except OSError:  # a thread that ended meanwhile
            continue


def _state_bytes(exported: dict[str, Any]) -> int:
    total = 0
    stack: list[Any] = [exported]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            total += item.numel() * item.element_size()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def _rollout_input(call: NodeCall, inputs: dict[str, Any]) -> tuple[str, Any] | None:
    """The (input name, rollout) a split node divides by rows."""
    for ref in call.inputs:
        if ref.rollout:
            return ref.name, inputs[ref.name]
    return None


def _inputs_by_role(call: NodeCall, inputs: dict[str, Any]) -> dict[str, list[Any]]:
    grouped: dict[str, list[Any]] = {}
    for ref in call.inputs:
        grouped.setdefault(ref.role, []).append(inputs[ref.name])
    return grouped


WEIGHTS_BUCKET_BYTES = 32 * 2**20
"""Tensors smaller than a quarter of this go in shared buckets of up to this many bytes: one
broadcast each instead of one per tensor (a collective's fixed cost dominates small ones)."""


def _broadcast_weights(state: ModelState, group: DeviceGroup) -> int:
    """Every distinct tensor an update changes (the state dict, or a model's adapters alone:
    :meth:`ModelState.changing_tensors`), in order, from rank 0 (the trainer) to
    the group's other ranks, in place; the bytes one rank receives. Tied weights share storage
    and go once; every copy of a model has the same layout, so every rank makes the same
    buckets in the same order."""
    seen: set[int] = set()
    pending: list[torch.Tensor] = []
    pending_bytes = 0
    num_bytes = 0

    def send(tensors: list[torch.Tensor]) -> None:
        if len(tensors) == 1 and tensors[0].is_contiguous():
            group.broadcast(tensors[0], 0)
            return
        flat = torch.cat([tensor.reshape(-1) for tensor in tensors])
        group.broadcast(flat, 0)
        if group.rank != 0:
            offset = 0
            for tensor in tensors:
                tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()

    with torch.no_grad():
        for tensor in state.changing_tensors().values():
            if tensor.data_ptr() in seen:
                continue
            seen.add(tensor.data_ptr())
            size = tensor.numel() * tensor.element_size()
            num_bytes += size
            if size >= WEIGHTS_BUCKET_BYTES // 4:
                send([tensor])
                continue
            kind = (tensor.dtype, tensor.device)
            if pending and ((pending[0].dtype, pending[0].device) != kind or pending_bytes + size > WEIGHTS_BUCKET_BYTES):
                send(pending)
                pending, pending_bytes = [], 0
            pending.append(tensor)
            pending_bytes += size
        if pending:
            send(pending)
    return num_bytes


def _stop_threads(sampler: DeviceSampler, compute: ThreadPoolExecutor) -> None:
    """End a host's sampler and compute threads (a call running on the latter finishes first)."""
    sampler.close()
    compute.shutdown(wait=False)
