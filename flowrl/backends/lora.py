"""Low-rank adapters (LoRA) on a transformers model, through ``peft``'s layers.

The adapters are injected into the model in place (``peft.inject_adapter_in_model``): the
model stays the transformers class every other part of flowrl reads (the fused head, the
compiled layers, the static decoder), each adapted ``nn.Linear`` becomes a ``peft`` LoRA layer
whose ``base_layer`` holds the frozen weight, and only the adapters' ``lora_A``/``lora_B``
weights require gradients. The adapters take the model's dtype, so their products run without
casts; a 16-bit model's optimizer steps fp32 masters of them (``flowrl.roles.master_weights``),
so small steps are not rounded away. In fp32 instead, every adapted layer cast its input to
fp32 and kept that copy for the backward: on an H100 at 0.4B in bf16, a GRPO step with fp32
adapters took 1.37 s and 29.4 GB against 1.02 s and 26.3 GB for training every weight
(``benchmarks/results/gpu_grpo_lora_fp32_adapters_h100.json``).

Two ways out of a trained model: :func:`merged_weights` (the plain model's names, each
adapted weight plus its adapter's product, what ``from_pretrained`` opens) and
:func:`save_adapter` (the adapters alone, a ``peft`` adapter directory that
``PeftModel.from_pretrained(base, dir)`` loads onto the base model).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from flowrl.errors import CheckpointError, ModelLoadError
from flowrl.spec.schema import ADAPTER_DIR

ADAPTER_NAME = "default"
"""``peft``'s name of the one adapter set a model carries."""
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."
"""How ``peft`` names a key of the wrapped model in an adapter file."""
_CONFIG_ATTRIBUTE = "_flowrl_lora_config"


def add_adapters(module: torch.nn.Module, rank: int, alpha: int, target_modules: str | list[str],
                 model: str = "model", seed: int = 0) -> None:
    """Give ``module`` trainable adapters of ``rank`` on ``target_modules`` (``all-linear`` or
    module names) and freeze everything else; ``model`` names it in errors. The random A
    matrices are drawn from ``seed`` (B starts at zero, so the model starts unchanged): every
    copy and data-parallel rank of a model, given the same seed, starts from the same adapters."""
    from peft import LoraConfig, inject_adapter_in_model

    field = f"models.{model}.lora.target_modules"
    problem = target_problem(module, target_modules, model)
    if problem is not None:
        raise ModelLoadError(f"{field}: {problem}")
    # task type: what peft's AutoPeftModelForCausalLM reads to open the adapter directory
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=target_modules, lora_dropout=0.0, bias="none",
                        task_type="CAUSAL_LM")
    device = next(module.parameters()).device
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # the run's own random streams stay as they were
        torch.manual_seed(seed)
        try:
            inject_adapter_in_model(config, module)
        except ValueError as error:
            first = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
            raise ModelLoadError(
                f"{field}: {target_modules!r} cannot be adapted ({first}); name linear layers of the decoder "
                f"layers ({', '.join(_linear_names(module, _ends(module)))}), or use all-linear"
            ) from error
    setattr(module, _CONFIG_ATTRIBUTE, config)


def target_problem(module: torch.nn.Module, target_modules: str | list[str], model: str = "model") -> str | None:
    """Why ``target_modules`` cannot be adapted on ``module`` (a name that matches no module,
    the embeddings or the output head, a module that is not a linear layer), else None. Also
    run on a model built on the meta device by validation, before any weight is loaded."""
    if isinstance(target_modules, str):
        return None  # all-linear: peft leaves the output head out
    ends = _ends(module)
    names = _linear_names(module, ends)
    matches = {target: [layer for name, layer in module.named_modules() if name == target or name.endswith("." + target)]
               for target in target_modules}
    # every problem at once: a list with a typo and the output head is told of both
    problems = []
    unmatched = [target for target, matched in matches.items() if not matched]
    if unmatched:  # peft accepts a list as long as one name matches
        problems.append(f"{unmatched} match no module of '{model}'; its linear layers are named {names}, or write "
                        "all-linear")
    for target, matched in matches.items():
        end_named = next((what for what, end in ends.items()
                          if end is not None and any(layer is end for layer in matched)), None)
        if end_named is not None:
            problems.append(f"{target!r} is the {end_named} of '{model}', which cannot take adapters (generation "
                            "and the log-prob head read its weight directly); leave it out of target_modules")
        elif matched and not any(_linear_like(layer) for layer in matched):
            problems.append(f"{target!r} names {type(matched[0]).__name__} modules of '{model}', and adapters go on "
                            f"linear layers: {names}")
    return "; ".join(problems) or None


def rank_problem(module: torch.nn.Module, target_modules: str | list[str], rank: int, model: str = "model") -> str | None:
    """Why ``rank`` is too large for the layers ``target_modules`` adapts on ``module`` (an
    adapter of rank r on an m x n layer learns at most min(m, n) directions, so a larger rank
    only adds parameters), else None."""
    adapted = [layer for name, layer in _adaptable(module, _ends(module))
               if isinstance(target_modules, str) or any(name == target or name.endswith("." + target)
                                                         for target in target_modules)]
    widest = max((min(_weight_of(layer).shape) for layer in adapted), default=None)
    if widest is None or rank <= widest:
        return None
    return (f"rank {rank} is above the smaller side of every layer the adapters of '{model}' go on (the largest is "
            f"{widest}): an adapter of rank r on an m x n layer learns at most min(m, n) directions, so rank {widest} "
            f"trains as much with fewer parameters; set rank: {widest} or less")


def _accessor(module: torch.nn.Module, getter: str) -> torch.nn.Module | None:
    try:
        found = getattr(module, getter)()
    except (AttributeError, NotImplementedError):  # a model class without the accessor
        return None
    return found if isinstance(found, torch.nn.Module) else None


def _linear_like(layer: torch.nn.Module) -> bool:
    """A linear layer adapters go on: ``nn.Linear``, or transformers' ``Conv1D`` (GPT-2's)."""
    return isinstance(layer, torch.nn.Linear) or type(layer).__name__ == "Conv1D"


def _ends(module: torch.nn.Module) -> dict[str, torch.nn.Module | None]:
    """The modules adapters cannot go on, by what they are: the embeddings and the head."""
    return {"input embeddings": _accessor(module, "get_input_embeddings"),
            "output head": _accessor(module, "get_output_embeddings")}


def _weight_of(layer: torch.nn.Module) -> torch.Tensor:
    """A linear layer's weight (``nn.Linear``'s or ``Conv1D``'s)."""
    weight = layer.weight
    assert isinstance(weight, torch.Tensor)
    return weight


def _adaptable(module: torch.nn.Module, ends: dict[str, torch.nn.Module | None]) -> Iterator[tuple[str, torch.nn.Module]]:
    """(name, layer) of the model's linear layers, ``ends`` (:func:`_ends`) left out."""
    for name, layer in module.named_modules():
        if name and _linear_like(layer) and not any(layer is end for end in ends.values()):
            yield name, layer


def _linear_names(module: torch.nn.Module, ends: dict[str, torch.nn.Module | None]) -> list[str]:
    """The short names of the model's linear layers, ``ends`` (:func:`_ends`) left out."""
    return sorted({name.rsplit(".", 1)[-1] for name, _ in _adaptable(module, ends)})


def is_adapted_layer(layer: torch.nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(layer, LoraLayer)


def has_adapters(module: torch.nn.Module) -> bool:
    return getattr(module, _CONFIG_ATTRIBUTE, None) is not None


@contextmanager
def adapters_off(module: torch.nn.Module) -> Iterator[None]:
    """The frozen model alone for the block: every adapter skipped (a reference node of a
    model with adapters computes the model as it was loaded). Outside ``inference_mode``:
    ``peft`` switches the adapters' ``requires_grad`` with them."""
    layers: list[Any] = [layer for layer in module.modules() if is_adapted_layer(layer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def adapter_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' weights by ``state_dict`` name (no copies)."""
    return {name: tensor for name, tensor in module.state_dict().items() if _is_adapter_key(name)}


FINGERPRINT_SAMPLES = 64
"""Elements of each frozen tensor that :func:`base_fingerprint` reads."""


def base_fingerprint(module: torch.nn.Module) -> str:
    """A SHA-256 of the frozen weights an adapted model was loaded with: each tensor's name
    and shape and ``FINGERPRINT_SAMPLES`` evenly spaced elements, rounded to bf16 (so that a
    model loaded in another dtype from the same files matches). Weights trained or replaced
    since change nearly every element, so the samples tell them apart without reading GBs."""
    import hashlib

    digest = hashlib.sha256()
    samples = []
    names = []
    with torch.no_grad():
        for name, tensor in sorted(module.state_dict().items()):
            if _is_adapter_key(name) or not tensor.is_floating_point() or tensor.numel() == 0:
                continue
            flat = tensor.reshape(-1)
            # integer positions, the same on every device (float positions round past the end
            # of a tensor of more than 2^24 elements, and differently on a GPU and a CPU)
            count = min(FINGERPRINT_SAMPLES, flat.numel())
            picks = torch.arange(count) * (flat.numel() - 1) // max(count - 1, 1)
            samples.append(flat[picks.to(flat.device)].to(torch.bfloat16).float())
            names.append(f"{name}{tuple(tensor.shape)}")
    digest.update("\n".join(names).encode())
    if samples:
        digest.update(torch.cat(samples).cpu().numpy().tobytes())  # one copy from the device
    return digest.hexdigest()


def merged_weight(layer: Any) -> torch.Tensor:
    """An adapted linear layer's weight plus its adapter's product (alpha / rank) B A, computed
    in fp32 and rounded once to the weight's dtype."""
    base = layer.get_base_layer().weight
    with torch.no_grad():
        a = layer.lora_A[ADAPTER_NAME].weight.float()
        b = layer.lora_B[ADAPTER_NAME].weight.float()
        delta = (b @ a) * layer.scaling[ADAPTER_NAME]
        if getattr(layer, "fan_in_fan_out", False):  # a Conv1D-style layer keeps its weight transposed
            delta = delta.T
        return (base.float() + delta).to(base.dtype)


def merged_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under the plain model's names, each adapted weight merged."""
    adapted = {name: layer for name, layer in module.named_modules() if is_adapted_layer(layer)}
    merged: dict[str, torch.Tensor] = {}
    for key, tensor in module.state_dict().items():
        if _is_adapter_key(key):
            continue
        if key.endswith(".base_layer.weight"):
            tensor = merged_weight(adapted[key[: -len(".base_layer.weight")]])
        merged[key.replace(".base_layer.", ".")] = tensor
    return merged


def save_adapter(module: torch.nn.Module, directory: Path, base_model: str) -> None:
    """Write the adapters as a ``peft`` adapter directory (``adapter_model.safetensors`` and
    ``adapter_config.json``, naming ``base_model``)."""
    from safetensors.torch import save_file

    config = getattr(module, _CONFIG_ATTRIBUTE)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {_PEFT_PREFIX + key.replace(f".{ADAPTER_NAME}.", "."): tensor.detach().to("cpu").contiguous()
               for key, tensor in adapter_tensors(module).items()}
    save_file(tensors, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config.base_model_name_or_path = base_model
    config.save_pretrained(str(directory))


def read_adapter(directory: Path) -> dict[str, torch.Tensor]:
    """The adapters :func:`save_adapter` wrote, by the adapted model's ``state_dict`` names."""
    from safetensors.torch import load_file

    path = directory / ADAPTER_WEIGHTS
    if not path.is_file():
        raise CheckpointError(
            f"{directory.parent} has no {ADAPTER_DIR}/{ADAPTER_WEIGHTS}: it was not written by a run that trains "
            "adapters (lora); resume with the pipeline that wrote it, or start afresh"
        )
    weights: dict[str, torch.Tensor] = {}
    for key, tensor in load_file(str(path)).items():
        name = key[len(_PEFT_PREFIX):] if key.startswith(_PEFT_PREFIX) else key
        for part in (".lora_A.", ".lora_B."):
            name = name.replace(part, f"{part}{ADAPTER_NAME}.")
        weights[name] = tensor
    return weights


def changed_settings(module: torch.nn.Module, directory: Path) -> list[str]:
    """The settings of the adapters saved in ``directory`` (``adapter_config.json``) that
    differ from ``module``'s, as ``name: saved -> now``; the scale (alpha / rank) changes
    what a model's adapters compute without changing their shapes."""
    saved = json.loads((directory / ADAPTER_CONFIG).read_text())
    config = getattr(module, _CONFIG_ATTRIBUTE)

    def targets(value: Any) -> Any:
        return value if isinstance(value, str) else sorted(value)

    changes = []
    for key, name, now in (("r", "rank", config.r), ("lora_alpha", "alpha", config.lora_alpha),
                           ("target_modules", "target_modules", targets(config.target_modules))):
        before = targets(saved.get(key)) if key == "target_modules" else saved.get(key)
        if before != now and key == "target_modules":  # peft records the layers it adapted
            kinds = [sorted({path.rsplit(".", 1)[-1] for path in ([paths] if isinstance(paths, str) else paths or [])})
                     for paths in (before, now)]
            changes.append(f"{name}: {kinds[0]} -> {kinds[1]}" if kinds[0] != kinds[1] else
                           f"{name}: {len(before or [])} adapted layers -> {len(now)}")
        elif before != now:
            changes.append(f"{name}: {before} -> {now}")
    return changes


def _is_adapter_key(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key
