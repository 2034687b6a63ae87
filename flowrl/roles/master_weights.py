"""AdamW for a model held in bf16 or fp16: the optimizer steps fp32 master copies of the
weights, and the model's 16-bit weights are the masters rounded after each step.

Stepping 16-bit weights directly loses every update smaller than half a unit of their last
place: at bf16's 8 significant bits, a weight of 0.02 moves only by steps of about 1e-4, so at
a learning rate of 1e-6 almost no weight ever changes. The masters keep the small updates and
pass them on once they add up. Forward and backward stay in 16 bits (the memory and speed
of a 16-bit model); the optimizer holds 12 bytes per parameter (the master and AdamW's two
moments in fp32) where it held 4.

The masters are optimizer state (``"master"`` beside ``exp_avg`` in each parameter's entry),
so checkpoints, migration and the cutting of a state into FSDP2 shards carry them like the
moments: a resumed run continues from the same masters, not from the rounded weights.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

MASTER_KEY = "master"
STEP_CHUNK_BYTES = 256 << 20
"""fp32 gradient copies held at once during a step (the planner counts them as transient)."""


def needs_masters(params: Iterable[torch.Tensor]) -> bool:
    """Whether any of ``params`` is below fp32 precision."""
    return any(p.dtype in (torch.bfloat16, torch.float16) for p in params)


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW over fp32 masters of ``params``; ``step`` reads the model's gradients and writes
    the rounded masters back into the model. ``param_groups`` hold the masters, in the order
    of ``params``, so a state dict lists parameters as plain AdamW's would."""

    def __init__(self, params: list[torch.nn.Parameter], **settings: Any) -> None:
        self.model_params = list(params)
        masters = [p.detach().to(torch.float32, copy=True) for p in self.model_params]
        super().__init__(masters, **settings)

    def _masters(self) -> list[torch.Tensor]:
        return [master for group in self.param_groups for master in group["params"]]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if closure is not None:
            raise ValueError("MasterWeightAdamW.step takes no closure: it reads the gradients the model holds")
        pairs = [(p, master) for p, master in zip(self.model_params, self._masters()) if p.grad is not None]
        # In chunks: an fp32 copy of every gradient at once would hold 4 more bytes per
        # parameter beside the masters and moments at the step; a chunk holds a bounded few.
        chunk: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        size = 0
        for p, master in pairs:
            chunk.append((p, master))
            size += master.numel() * 4
            if size >= STEP_CHUNK_BYTES:
                self._step_chunk(chunk)
                chunk, size = [], 0
        if chunk:
            self._step_chunk(chunk)
        return None

    def _step_chunk(self, chunk: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
        """AdamW on the masters of ``chunk`` (the others have no gradient now, so it skips
        them), then the model takes them rounded."""
        for p, master in chunk:
            assert p.grad is not None
            master.grad = p.grad.to(torch.float32)
        super().step()
        for p, master in chunk:
            master.grad = None
            p.copy_(master)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self.model_params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()

    @torch.no_grad()
    def sync_masters(self) -> None:
        """Masters from the model's weights, after they were set from outside the optimizer."""
        for p, master in zip(self.model_params, self._masters()):
            master.copy_(p)

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        state = {index: dict(entry) for index, entry in saved["state"].items()}
        for index, master in enumerate(self._masters()):
            state.setdefault(index, {})[MASTER_KEY] = master.detach()
        return {**saved, "state": state}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A state dict of this class or of a plain AdamW (masters then come from the model's
        weights: a checkpoint written before the model was held in 16 bits)."""
        masters = self._masters()
        saved = [index for group in state_dict["param_groups"] for index in group["params"]]
        if len(saved) != len(masters):
            raise ValueError(f"the optimizer state holds {len(saved)} parameters, this model trains {len(masters)}")
        self.sync_masters()
        state: dict[Any, dict[str, Any]] = {}
        for index, entry in state_dict["state"].items():
            if MASTER_KEY in entry:
                master = masters[saved.index(index)]
                if tuple(entry[MASTER_KEY].shape) != tuple(master.shape):
                    raise ValueError(f"the saved master of parameter {index} is {tuple(entry[MASTER_KEY].shape)}, "
                                     f"the parameter {tuple(master.shape)}")
                master.copy_(entry[MASTER_KEY])
            rest = without_masters(entry)
            if rest:
                state[index] = rest
        super().load_state_dict({**state_dict, "state": state})


def without_masters(entry: dict[str, Any]) -> dict[str, Any]:
    """A parameter's optimizer state without its master (for a plain AdamW: a model held in
    fp32 whose saved state came from a 16-bit one)."""
    return {key: value for key, value in entry.items() if key != MASTER_KEY}
