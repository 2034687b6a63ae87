"""Saving and restoring one model's full state, on the worker that holds it.

Weights go to safetensors through ``save_pretrained``, in files of at most
``trainer.max_shard_size`` (a bigger model is written as ``model-0000i-of-0000N.safetensors``
plus ``model.safetensors.index.json``), so a checkpoint of a policy is a model directory
``from_pretrained`` can open and one of a critic or reward model a classifier directory (see
:mod:`flowrl.backends.scalar_files`). A model with adapters (``lora``) writes its adapters
alone to ``adapter/`` (:mod:`flowrl.backends.lora`), which is what loading reads, and its
final model also merged. Optimizer, sampling RNG and update count go to ``state.pt``, read back with
``weights_only=True`` so loading never runs pickled code. The driver makes the step
directory appear atomically (temp name, then rename).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from flowrl.backends.hf import save_tokenizer
from flowrl.backends.lora import (
    ADAPTER_DIR,
    adapter_tensors,
    base_fingerprint,
    changed_settings,
    has_adapters,
    merged_weights,
    read_adapter,
    save_adapter,
)
from flowrl.backends.value_model import ScalarHeadModel, scalar_model_weights
from flowrl.backends.weight_files import INDEX_NAME, WEIGHTS_NAME, has_weights, read_weights, shard_size_bytes
from flowrl.errors import CheckpointError, ModelLoadError
from flowrl.roles.state import ModelState

STATE_FILE = "state.pt"
BASE_FINGERPRINT = "base_fingerprint"
"""state.pt's key for an adapted model's :func:`base_fingerprint`."""


def save_model_state(state: ModelState, directory: Path, with_state: bool, max_shard_size: str) -> None:
    """Write ``state``'s weights (and tokenizer; with ``with_state`` also optimizer, RNG and
    update count) to ``directory``, weights in files of at most ``max_shard_size``."""
    # first, before anything can fail here: a sharded model's other ranks wait in this gather
    optimizer = state.optimizer_state() if with_state else None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if has_adapters(state.module):
            # the adapters alone; the final model also as a plain model directory of the merged
            # weights (a checkpoint of a 7B model would otherwise write 15 GB for MBs of adapters)
            save_adapter(state.module, directory / ADAPTER_DIR, base_model=state.source)
            if not with_state:
                state.module.save_pretrained(directory, state_dict=merged_weights(state.module),
                                             max_shard_size=shard_size_bytes(max_shard_size))
        else:
            state.module.save_pretrained(directory, max_shard_size=shard_size_bytes(max_shard_size))
        if state.tokenizer is not None:
            save_tokenizer(state.tokenizer, directory)
        if with_state:
            saved: dict[str, Any] = {"optimizer": optimizer, "generator": state.generator.get_state(),
                                     "num_updates": state.num_updates}
            if has_adapters(state.module):
                saved[BASE_FINGERPRINT] = base_fingerprint(state.module)
            torch.save(saved, directory / STATE_FILE)
    except Exception as error:  # noqa: BLE001 - the writers' failures named below; any other as it was
        if not is_write_failure(error):
            raise
        raise CheckpointError(f"cannot write checkpoint of '{state.name}' to {directory}: "
                              f"{write_failure(error, directory)}") from error


WRITER_MESSAGES = ("enforce fail", "unexpected pos", "PytorchStreamWriter", "file write failed")
"""What torch's file writer says when a write fails (a full disk among others)."""


def is_write_failure(error: BaseException) -> bool:
    """A failure to write a file: the system's (``OSError``), safetensors' (its own
    ``SafetensorError``), or torch's file writer's (a ``RuntimeError`` that says so); not an
    out-of-memory error or a collective's failure, which are ``RuntimeError`` too."""
    if isinstance(error, OSError) or type(error).__name__ == "SafetensorError":
        return True
    if isinstance(error, torch.OutOfMemoryError) or not isinstance(error, RuntimeError):
        return False
    return any(text in str(error) for text in WRITER_MESSAGES)


LOW_DISK_BYTES = 256 * 2**20
"""Free space below which a failed write is put down to a full disk."""


def write_failure(error: BaseException, directory: Path) -> str:
    """Why writing into ``directory`` failed, in words: an ``OSError`` says it itself; torch's
    file writer says "unexpected pos" or "enforce fail" where the disk filled up, so the free
    space decides what to call it."""
    if isinstance(error, OSError):
        return str(error)
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    try:
        free = shutil.disk_usage(directory if directory.exists() else directory.parent).free
    except OSError:
        return f"the file write failed ({first})"
    if free < LOW_DISK_BYTES:
        return f"no space left on the device ({free / 2**20:.1f} MiB free there; torch: {first})"
    return f"the file write failed ({first}; {free / 2**30:.1f} GiB free there)"


def load_model_state(state: ModelState, directory: Path, parts: tuple[str, ...] | None = None) -> None:
    """Restore ``state`` from a directory :func:`save_model_state` wrote, sharded or not;
    ``parts`` limits what is taken (None: all)."""
    if (directory / ADAPTER_DIR).is_dir() and not has_adapters(state.module):
        raise CheckpointError(
            f"the checkpoint of '{state.name}' in {directory} holds adapters (lora), and models.{state.name} has "
            "none now; resume with the lora settings that wrote it"
        )
    if not has_weights(directory) and not has_adapters(state.module):
        raise CheckpointError(
            f"checkpoint of '{state.name}' in {directory} has no weights: expected {WEIGHTS_NAME} "
            f"or {INDEX_NAME} with its shards; resume from another checkpoint or start afresh"
        )
    try:
        # A value/reward model's file names the backbone with its own prefix and the head as
        # its classifier class does ("score", "classifier"): read it as a whole, renamed to
        # the module's keys. A model with adapters takes the adapters alone: its other
        # weights are the frozen ones it was loaded with.
        if has_adapters(state.module):
            weights = read_adapter(directory / ADAPTER_DIR)
            _check_adapters(state, directory, weights)
        else:
            scalar = isinstance(state.module, ScalarHeadModel)
            weights = scalar_model_weights(directory) if scalar else read_weights(directory)
            _check_weights(state, directory, weights)
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, ModelLoadError) as error:
        raise CheckpointError(f"cannot read the weights of '{state.name}' in {directory}: {error}") from error
    state_file = directory / STATE_FILE
    try:
        saved = torch.load(state_file, weights_only=True) if state_file.exists() else {}
    except Exception as error:  # a truncated or foreign file: unpickling refused or failed
        raise CheckpointError(f"cannot read {state_file}: {error}") from error
    if has_adapters(state.module) and BASE_FINGERPRINT in saved and (parts is None or "weights" in parts):
        _check_base(state, directory, saved[BASE_FINGERPRINT])
    everything = {**saved, "weights": weights}
    if parts is not None:
        everything = {key: value for key, value in everything.items()
                      if key in parts or (key == "num_updates" and "optimizer" in parts)}
    state.restore(everything)


def _check_weights(state: ModelState, directory: Path, saved: dict[str, torch.Tensor]) -> None:
    """The saved weights must be the model's: the same names and shapes (a resume whose
    model path was changed, with ``--force``, to a model of another configuration). A
    buffer the model keeps out of its files need not be there."""
    own = state.module.state_dict()
    reshaped = [f"{key} {list(tensor.shape)} against {list(own[key].shape)} now" for key, tensor in saved.items()
                if key in own and tuple(tensor.shape) != tuple(own[key].shape)]
    unknown = [key for key in saved if key not in own]
    # tied weights stand in state_dict under each name and in the file under one
    stored = {own[key].data_ptr() for key in saved if key in own}
    missing = [key for key, tensor in state.module.named_parameters(remove_duplicate=False)
               if key not in saved and tensor.data_ptr() not in stored]
    if reshaped or unknown or missing:
        found = "; ".join(f"{what}: {_first(names)}" for what, names in (
            ("other shapes", reshaped), (f"weights models.{state.name} lacks", unknown),
            ("weights the checkpoint lacks", missing)) if names)
        source = f" ({state.source})" if state.source else ""
        raise CheckpointError(
            f"the weights in the checkpoint of '{state.name}' in {directory} do not match models.{state.name} "
            f"now{source}: {found}; resume with the model that wrote it, or start afresh in another output_dir"
        )


def _first(names: list[str], shown: int = 3) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _check_base(state: ModelState, directory: Path, saved: str) -> None:
    """Adapters go on with the frozen weights they were trained beside: a model whose weights
    at ``path`` were replaced since (trained on, re-downloaded as another revision) would
    resume other training than the checkpoint's."""
    if base_fingerprint(state.module) != saved:
        raise CheckpointError(
            f"the frozen weights of models.{state.name} (from {state.source}) are not those the adapters in "
            f"{directory / ADAPTER_DIR} were trained on: the model at that path changed since the checkpoint; "
            "restore that model, or start afresh in another output_dir"
        )


def _check_adapters(state: ModelState, directory: Path, saved: dict[str, torch.Tensor]) -> None:
    """The saved adapters must be the model's: same layers, same rank, same scale."""
    changes = changed_settings(state.module, directory / ADAPTER_DIR)
    if changes:
        raise CheckpointError(
            f"the adapters in {directory / ADAPTER_DIR} were trained with other settings than models.{state.name}"
            f".lora now ({'; '.join(changes)}); resume with the lora settings that wrote the checkpoint"
        )
    own = {key: tuple(tensor.shape) for key, tensor in adapter_tensors(state.module).items()}
    found = {key: tuple(tensor.shape) for key, tensor in saved.items()}
    if own != found:
        raise CheckpointError(
            f"the adapters in {directory / ADAPTER_DIR} are not those of models.{state.name}.lora now ("
            f"{len(found)} matrices saved, {len(own)} now, or of another rank); resume with the lora settings "
            "that wrote the checkpoint"
        )
