"""Saving and restoring one model's full state, on the worker that holds it.

Weights go to safetensors through ``save_pretrained`` (so a checkpoint of a policy is a
model directory ``from_pretrained`` can open); optimizer, sampling RNG and update count go
to ``state.pt``, read back with ``weights_only=True`` so loading never runs pickled code.
The driver makes the step directory appear atomically (temp name, then rename).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from flowrl.backends.value_model import ScalarHeadModel, scalar_model_weights
from flowrl.errors import CheckpointError
from flowrl.roles.state import ModelState

STATE_FILE = "state.pt"


def save_model_state(state: ModelState, directory: Path, with_state: bool) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        state.module.save_pretrained(directory, safe_serialization=True)
        if state.tokenizer is not None:
            state.tokenizer.save_pretrained(directory)
        if with_state:
            torch.save(
                {
                    "optimizer": state.optimizer.state_dict() if state.optimizer is not None else None,
                    "generator": state.generator.get_state(),
                    "num_updates": state.num_updates,
                },
                directory / STATE_FILE,
            )
    except OSError as error:
        raise CheckpointError(f"cannot write checkpoint of '{state.name}' to {directory}: {error}") from error


def load_model_state(state: ModelState, directory: Path, parts: tuple[str, ...] | None = None) -> None:
    weights_file = directory / "model.safetensors"
    if not weights_file.exists():
        raise CheckpointError(f"checkpoint of '{state.name}' has no {weights_file.name} in {directory}")
    # A value/reward model's backbone file has no "backbone." prefix: read it as a whole.
    weights = (
        scalar_model_weights(directory) if isinstance(state.module, ScalarHeadModel) else load_file(str(weights_file))
    )
    state_file = directory / STATE_FILE
    try:
        saved = torch.load(state_file, weights_only=True) if state_file.exists() else {}
    except Exception as error:  # a truncated or foreign file: unpickling refused or failed
        raise CheckpointError(f"cannot read {state_file}: {error}") from error
    everything = {**saved, "weights": weights}
    if parts is not None:
        everything = {key: value for key, value in everything.items()
                      if key in parts or (key == "num_updates" and "optimizer" in parts)}
    state.restore(everything)
