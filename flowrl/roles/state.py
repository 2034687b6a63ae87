"""A model held by a worker for the whole run: module, tokenizer, optimizer, RNG."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from transformers import PreTrainedModel

from flowrl.backends.hf import DtypeName, HubOptions
from flowrl.backends.lora import adapter_tensors, add_adapters, has_adapters
from flowrl.backends.models import load_policy, load_scalar, resolve_model_path
from flowrl.backends.compiled_layers import ATTRIBUTE as COMPILED_ATTRIBUTE
from flowrl.backends.static_decode import DECODER_ATTRIBUTE
from flowrl.backends.value_model import ScalarHeadModel
from flowrl.errors import CheckpointError
from flowrl.roles.master_weights import MasterWeightAdamW, needs_masters, without_masters

MODULE_CACHES = (DECODER_ATTRIBUTE, COMPILED_ATTRIBUTE)
"""Instance attributes where generation and the compiled passes keep what they built for a
model."""


@dataclass
class ModelState:
    """Everything a worker keeps about one model between node calls."""

    name: str
    module: PreTrainedModel | ScalarHeadModel
    tokenizer: Any
    device: torch.device
    generator: torch.Generator
    """Sampling RNG of this model's generate calls; part of the checkpoint."""
    optimizer: torch.optim.Optimizer | None = None
    num_updates: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    kind: str = "policy"
    """``ModelSpec.kind``: policy, value or reward."""
    offloaded: bool = False
    """``ModelSpec.offload_to_cpu`` on a GPU: the weights live in pinned host memory and are
    on ``device`` only during a call (``paged_in``)."""
    sharded: torch.nn.Module | None = None
    """While an update trains the model sharded over a group (``ModelSpec.sharded``), the
    FSDP2 copy it trains; ``module`` then stays a plain whole copy that every other reader
    uses (generation, scoring, the old log-probs, checkpoints, weight pushes), refreshed after
    each update (:meth:`refresh_whole`). The optimizer steps the sharded copy's parameters."""
    shards_training: bool = False
    """``ModelSpec.sharded``: restored optimizer state waits in host memory
    (``pending_optimizer``) for the update to cut it into shards, instead of becoming a
    whole optimizer on the device first."""
    source: str = ""
    """Where the weights came from (a folder's absolute path, or a hub name), named as the
    base model in an adapter directory."""
    pending_optimizer: dict[str, Any] | None = None
    """A whole optimizer state dict (host memory) that the next update loads: restored for a
    model that trains sharded, or gathered when its sharding group went."""

    @property
    def training_module(self) -> torch.nn.Module:
        """The copy an update trains: the sharded one while there is one, else ``module``."""
        return self.sharded if self.sharded is not None else self.module

    def shard_training(self, mesh: Any) -> None:
        """Train sharded over ``mesh`` from now on: a copy of the model is sharded (FSDP2);
        the optimizer's state, if any, waits to be cut into this rank's shards when the
        update makes its optimizer (no collective)."""
        import copy

        from flowrl.roles.sharded import shard

        if self.optimizer is not None and self.pending_optimizer is None:
            self.pending_optimizer = self.optimizer.state_dict()
        self.optimizer = None
        self.module.zero_grad(set_to_none=True)  # whole-size gradients of earlier whole training
        # Generation's caches (the static decoder: captured graphs, stacked weights, KV
        # buffers) and compiled layers are attributes of the instance: the copy starts without.
        caches = [getattr(self.module, name, None) for name in MODULE_CACHES]
        memo: dict[int, Any] = {id(cache): None for cache in caches if cache is not None}
        sharded = copy.deepcopy(self.module, memo)
        shard(sharded, mesh)
        self.sharded = sharded

    def unshard_training(self) -> None:
        """Stop training sharded (the group is about to go): the whole optimizer state is
        gathered into host memory (every rank of the group must call) and waits there for
        the next update, sharded or not."""
        if self.sharded is None:
            return
        try:
            self.pending_optimizer = self.optimizer_state()
        finally:
            self.sharded = None
            self.optimizer = None

    def refresh_whole(self) -> None:
        """After a sharded update: the whole copy gets the new weights (every rank must call)."""
        from flowrl.roles.sharded import copy_whole

        if self.sharded is not None:
            copy_whole(self.sharded, self.module)

    def optimizer_state(self) -> dict[str, Any] | None:
        """The optimizer's state dict with whole tensors (sharded: gathered into host memory;
        every rank of the group must call, at once); None before the first update."""
        if self.pending_optimizer is not None:
            return self.pending_optimizer
        if self.optimizer is None:
            return None
        if self.sharded is None:
            return self.optimizer.state_dict()
        from flowrl.roles.sharded import whole_optimizer_state

        return whole_optimizer_state(self.optimizer)

    def page_out(self) -> None:
        """Keep the weights in pinned host memory until the next call (``paged_in``)."""
        if self.device.type != "cuda":
            return  # a CPU slot's weights are in host memory already
        module: torch.nn.Module = self.module  # transformers' typing of ``to`` takes no device
        module.to("cpu")
        for tensor in [*self.module.parameters(), *self.module.buffers()]:
            tensor.data = tensor.data.pin_memory()
        self.offloaded = True
        torch.cuda.empty_cache()

    def _tensors(self) -> list[tuple[str, torch.Tensor]]:
        # every registration, shared ones included: ``to`` gives a shared buffer one copy per name
        return [*self.module.named_parameters(remove_duplicate=False), *self.module.named_buffers(remove_duplicate=False)]

    @contextmanager
    def paged_in(self) -> Iterator[None]:
        """The weights on ``device`` for the duration of one call, when offloaded."""
        if not self.offloaded:
            yield
            return
        host = {name: tensor.data for name, tensor in self._tensors()}
        module: torch.nn.Module = self.module
        module.to(self.device, non_blocking=True)
        try:
            yield
        finally:
            # back to the pinned copies (an offloaded model is never trained, so they are current)
            for name, tensor in self._tensors():
                tensor.data = host[name]
            torch.cuda.empty_cache()

    @classmethod
    def load(
        cls,
        name: str,
        path: str,
        dtype: DtypeName,
        device: str,
        seed: int,
        base_dir: Path | None,
        gradient_checkpointing: bool = False,
        kind: str = "policy",
        options: HubOptions = HubOptions(),
        lora: Any = None,
        adapter_seed: int = 0,
    ) -> "ModelState":
        """``options``: the model's hub revision and whether its own code may run; ``lora``:
        the model's ``LoraSpec`` (adapters are added and everything else is frozen), or None;
        ``adapter_seed`` draws the adapters' initial A (every copy of a model takes the run's
        seed, so all start equal)."""
        module: PreTrainedModel | ScalarHeadModel
        if kind == "policy":
            module, tokenizer = load_policy(path, dtype=dtype, device=device, base_dir=base_dir, options=options)
        elif kind in ("value", "reward"):
            # A reward model must come with a trained head; a critic may start from a fresh one.
            module, tokenizer = load_scalar(
                path, dtype=dtype, device=device, base_dir=base_dir,
                kind="reward" if kind == "reward" else "value", options=options,
            )
        else:
            raise ValueError(f"model kind '{kind}' is not one of policy, value, reward")
        if lora is not None:
            add_adapters(module, lora.rank, lora.scale_alpha, lora.target_modules, model=name, seed=adapter_seed)
            if isinstance(module, PreTrainedModel):
                # The frozen embeddings would give the first layer an input without gradient,
                # unlike every later layer's: a checkpointed first layer would never reach its
                # adapters in backward, and compiled layers would need a version for each kind.
                module.enable_input_require_grads()
        if gradient_checkpointing:
            module.gradient_checkpointing_enable()
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        # where the weights are, for an adapter directory to name its base: a builtin model's
        # folder, a local folder as an absolute path, or the hub name
        location = resolve_model_path(path, base_dir)
        source = str(location.resolve()) if isinstance(location, Path) else location
        return cls(name=name, module=module, tokenizer=tokenizer, device=torch.device(device), generator=generator,
                   kind=kind, source=source)

    def ensure_optimizer(self, lr: float, betas: tuple[float, float], weight_decay: float) -> torch.optim.Optimizer:
        """The optimizer is created by the first update, with that node's settings."""
        if self.optimizer is None:
            optimizer = self._new_optimizer(lr=lr, betas=betas, weight_decay=weight_decay)
            if self.pending_optimizer is not None:
                optimizer.load_state_dict(self._for_this_optimizer(self.pending_optimizer))
                self.pending_optimizer = None
        assert self.optimizer is not None
        return self.optimizer

    def _for_this_optimizer(self, whole: dict[str, Any]) -> dict[str, Any]:
        """A whole optimizer state dict made loadable here. A state saved on another device
        kind (or before fused AdamW) carries that kind's implementation flags; they decide,
        while loading, where each step counter goes (the fused kernel wants it on the
        parameter's device), so they are set first. Sharded, each tensor is cut to this
        rank's shard."""
        fused = self._fused_adamw()
        state = {**whole, "param_groups": [{**group, "fused": fused, "foreach": not fused}
                                           for group in whole["param_groups"]]}
        if not isinstance(self.optimizer, MasterWeightAdamW):  # held in fp32 now: its weights are the masters
            entries = {index: without_masters(entry) for index, entry in whole["state"].items()}
            state["state"] = {index: entry for index, entry in entries.items() if entry}
        if self.sharded is None:
            return state
        from flowrl.roles.sharded import shard_optimizer_state

        return shard_optimizer_state(state, self._trained_parameters())

    def _trained_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.training_module.parameters() if p.requires_grad]

    def _new_optimizer(self, **settings: Any) -> torch.optim.Optimizer:
        """AdamW over the trained copy's parameters (hyper-parameters from ``settings``, or
        from a state dict loaded after); over fp32 masters of them when they are 16-bit
        (:mod:`flowrl.roles.master_weights`)."""
        fused = self._fused_adamw()
        params = self._trained_parameters()
        kind = MasterWeightAdamW if needs_masters(params) else torch.optim.AdamW
        self.optimizer = kind(params, fused=fused, foreach=not fused, **settings)
        return self.optimizer

    def _fused_adamw(self) -> bool:
        """AdamW's implementation: the fused kernel on a GPU (one launch for every parameter;
        several times faster than the multi-tensor loop) and on a CPU (one pass over each
        parameter's memory: builtin:small-llama's step 12.3 -> 2.6 ms on 2 cores); the
        multi-tensor loop elsewhere."""
        return self.device.type in ("cuda", "cpu")

    def changing_tensors(self) -> dict[str, torch.Tensor]:
        """The ``state_dict`` entries an update can change (no copies): every one, or a model
        with adapters its adapters alone (its other weights are frozen, and every copy loads
        them from the same files)."""
        if has_adapters(self.module):
            return adapter_tensors(self.module)
        return self.module.state_dict()

    def weights(self) -> dict[str, torch.Tensor]:
        """Copies of :meth:`changing_tensors`: what another copy of the model needs to catch up."""
        return {k: v.detach().clone() for k, v in self.changing_tensors().items()}

    def restore(self, saved: dict[str, Any]) -> None:
        """Take over the parts of another copy's state that ``saved`` holds: ``weights``,
        ``optimizer`` with ``num_updates``, ``generator``. Used by checkpoint loading and by
        migration alike, so a moved role and a resumed one continue the same way."""
        if saved.get("optimizer") is not None:
            self._check_optimizer(saved["optimizer"])  # before any weight is overwritten
        if "weights" in saved:
            self.load_weights(saved["weights"])
        if saved.get("optimizer") is not None:
            if self.shards_training and self.sharded is None:
                # cut into shards by the next update; no whole optimizer on the device before
                self.pending_optimizer, self.optimizer = saved["optimizer"], None
            else:
                self.pending_optimizer = None
                if self.optimizer is None:
                    self._new_optimizer()  # hyper-parameters come with the state dict's param_groups
                assert self.optimizer is not None
                self.optimizer.load_state_dict(self._for_this_optimizer(saved["optimizer"]))
        if "num_updates" in saved:
            self.num_updates = int(saved["num_updates"])
        if saved.get("generator") is not None:
            self.generator.set_state(saved["generator"])

    def _check_optimizer(self, whole: dict[str, Any]) -> None:
        """An optimizer state of as many parameters as this copy trains (one saved for a model
        of another configuration failed in torch's loading with a traceback)."""
        saved = sum(len(group["params"]) for group in whole["param_groups"])
        trained = len(self._trained_parameters())
        if saved != trained:
            source = f" ({self.source})" if self.source else ""
            raise CheckpointError(
                f"the optimizer state of '{self.name}' is for {saved} trained tensors, and models.{self.name}{source} "
                f"trains {trained}: it was saved for another model; resume with the model that wrote it, or start "
                "afresh in another output_dir"
            )

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Whole tensors by ``state_dict`` name, into the whole copy and, when sharded, into
        this rank's shards (no collective)."""
        with torch.no_grad():
            own = self.module.state_dict()
            for key, value in weights.items():
                own[key].copy_(value.to(own[key].device, own[key].dtype))
        if self.sharded is not None:
            from flowrl.roles.sharded import load_whole

            load_whole(self.sharded, weights)
        if isinstance(self.optimizer, MasterWeightAdamW):
            self.optimizer.sync_masters()  # an optimizer state restored after this sets its own
