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
from flowrl.backends.models import load_policy, load_scalar
from flowrl.backends.value_model import ScalarHeadModel

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
    uses (generation, scoring, checkpoints, weight pushes), refreshed after each update
    (:meth:`refresh_whole`). The optimizer steps the sharded copy's parameters."""

    @property
    def training_module(self) -> torch.nn.Module:
        """The copy an update trains: the sharded one while there is one, else ``module``."""
        return self.sharded if self.sharded is not None else self.module

    def shard_training(self, mesh: Any) -> None:
        """Train sharded over ``mesh`` from now on: a copy of the model is sharded (FSDP2)
        and the optimizer's state, if any, is cut to this rank's shards (no collective)."""
        import copy

        from flowrl.roles.sharded import shard, shard_optimizer_state

        whole_state = self.optimizer.state_dict() if self.optimizer is not None else None
        sharded = copy.deepcopy(self.module)
        shard(sharded, mesh)
        self.sharded = sharded
        self.optimizer = None
        if whole_state is not None:
            optimizer = self._new_optimizer()
            optimizer.load_state_dict(shard_optimizer_state(whole_state, self._trained_parameters()))

    def unshard_training(self) -> None:
        """Stop training sharded (the group is about to go): the whole optimizer state is
        gathered (every rank of the group must call) and steps ``module`` from now on."""
        if self.sharded is None:
            return
        whole_state = self.optimizer_state()
        self.sharded = None
        self.optimizer = None
        if whole_state is not None:
            self._new_optimizer().load_state_dict(whole_state)

    def refresh_whole(self) -> None:
        """After a sharded update: the whole copy gets the new weights (every rank must call)."""
        from flowrl.roles.sharded import copy_whole

        if self.sharded is not None:
            copy_whole(self.sharded, self.module)

    def optimizer_state(self) -> dict[str, Any] | None:
        """The optimizer's state dict with whole tensors (every rank of a sharded model's
        group must call, at once); None before the first update."""
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
    ) -> "ModelState":
        """``options``: the model's hub revision and whether its own code may run."""
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
        if gradient_checkpointing:
            module.gradient_checkpointing_enable()
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        return cls(name=name, module=module, tokenizer=tokenizer, device=torch.device(device), generator=generator,
                   kind=kind)

    def ensure_optimizer(self, lr: float, betas: tuple[float, float], weight_decay: float) -> torch.optim.Optimizer:
        """The optimizer is created by the first update, with that node's settings."""
        if self.optimizer is None:
            self._new_optimizer(lr=lr, betas=betas, weight_decay=weight_decay)
        assert self.optimizer is not None
        return self.optimizer

    def _trained_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.training_module.parameters() if p.requires_grad]

    def _new_optimizer(self, **settings: Any) -> torch.optim.Optimizer:
        """AdamW over the trained copy's parameters (hyper-parameters from ``settings``, or
        from a state dict loaded after)."""
        fused = self._fused_adamw()
        self.optimizer = torch.optim.AdamW(self._trained_parameters(), fused=fused, foreach=not fused, **settings)
        return self.optimizer

    def _fused_adamw(self) -> bool:
        """AdamW's implementation: on a GPU the fused kernel (one launch for every parameter;
        several times faster than the multi-tensor loop), elsewhere the multi-tensor loop."""
        return self.device.type == "cuda"

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def restore(self, saved: dict[str, Any]) -> None:
        """Take over the parts of another copy's state that ``saved`` holds: ``weights``,
        ``optimizer`` with ``num_updates``, ``generator``. Used by checkpoint loading and by
        migration alike, so a moved role and a resumed one continue the same way."""
        if "weights" in saved:
            self.load_weights(saved["weights"])
        if saved.get("optimizer") is not None:
            if self.optimizer is None:
                self._new_optimizer()  # hyper-parameters come with the state dict's param_groups
            # A state saved on another device kind (or before fused AdamW) carries that kind's
            # implementation flags; they decide, while loading, where each step counter goes
            # (the fused kernel wants it on the parameter's device), so they are set first.
            fused = self._fused_adamw()
            optimizer_state = dict(saved["optimizer"])
            optimizer_state["param_groups"] = [
                {**group, "fused": fused, "foreach": not fused} for group in optimizer_state["param_groups"]
            ]
            if self.sharded is not None:
                from flowrl.roles.sharded import shard_optimizer_state

                optimizer_state = shard_optimizer_state(optimizer_state, self._trained_parameters())
            assert self.optimizer is not None
            self.optimizer.load_state_dict(optimizer_state)
        if "num_updates" in saved:
            self.num_updates = int(saved["num_updates"])
        if saved.get("generator") is not None:
            self.generator.set_state(saved["generator"])

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
