"""Every built-in model flowrl can make without a download, in one table (no torch: the
planner sizes them, validation names them).

Each entry is a shape plus how the weights come about: ``init`` (a seeded random init,
``flowrl.backends.builtin``), ``arith`` (tiny-llama's shape fitted to arithmetic,
``flowrl.backends.arith_model``) or ``tiny-rm`` (a small reward model fitted to the digits rule,
``flowrl.backends.tiny_rm``). ``flowrl.backends.models`` turns ``builtin:NAME`` into its folder.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Literal

from flowrl.errors import ModelLoadError

CHAR_VOCAB_SIZE = 83
"""Tokens of the character tokenizer the builtin models use (4 specials + 79 characters;
``flowrl.backends.tokenizer`` builds it, and a test keeps the two equal)."""


@dataclass(frozen=True)
class BuiltinModel:
    """The shape of one builtin model; the tokenizer is the character tokenizer, padded with
    filler tokens when ``vocab_size`` asks for a larger vocabulary."""

    hidden_size: int
    """Width of the residual stream."""
    num_layers: int
    """Number of decoder layers."""
    num_heads: int
    """Attention heads per layer."""
    num_kv_heads: int
    """Key/value heads per layer (equal to ``num_heads``: plain multi-head attention)."""
    intermediate_size: int
    """Width of the MLP's hidden layer."""
    max_position_embeddings: int = 256
    """Longest sequence (prompt + completion) in tokens, default 256."""
    seed: int = 0
    """Seed of the weight initialisation, default 0."""
    version: int = 1
    """Bumped whenever the bytes would change, so stale caches are never reused."""
    architecture: str = "llama"
    """``llama`` (no biases) or ``qwen2`` (q/k/v biases), default llama."""
    vocab_size: int | None = None
    """Embedding rows; None (default) means the character tokenizer's 83."""
    tie_word_embeddings: bool = False
    """Share the input embedding with the output head, default False."""
    recipe: Literal["init", "arith", "tiny-rm"] = "init"
    """How the weights come about (module docstring), default init."""
    kind: Literal["policy", "reward"] = "policy"
    """A causal LM, or a backbone with a scalar reward head, default policy."""

    @property
    def vocabulary(self) -> int:
        """Embedding rows: ``vocab_size``, else the character tokenizer's."""
        return self.vocab_size or CHAR_VOCAB_SIZE


TINY_LLAMA = BuiltinModel(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=512)

BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "tiny-llama": TINY_LLAMA,
    "small-llama": BuiltinModel(
        hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=4, intermediate_size=1024
    ),
    # Qwen2.5-0.5B's shape with a 32k vocabulary (387 M parameters): the GPU benchmark model.
    "qwen2-0.4b": BuiltinModel(
        hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
        max_position_embeddings=2048, architecture="qwen2", vocab_size=32_000,
        tie_word_embeddings=True,
    ),
    # Qwen2.5-1.5B's shape with a 32k vocabulary (1.36 B parameters).
    "qwen2-1.5b": BuiltinModel(
        hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960,
        max_position_embeddings=2048, architecture="qwen2", vocab_size=32_000,
        tie_word_embeddings=True,
    ),
    "arith-llama": BuiltinModel(
        hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=512, recipe="arith",
        version=2,
    ),
    "tiny-rm": BuiltinModel(
        hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=128, recipe="tiny-rm",
        kind="reward", version=2,
    ),
}
"""Every ``builtin:NAME`` model."""


def builtin_folder(name: str) -> tuple[str, str]:
    """(folder name under the cache's ``models/``, the file written last) of builtin model
    ``name``'s default build: what its builder writes, so a caller can see it is there
    without importing the builder (torch, transformers)."""
    model = lookup_builtin(name)
    if model.recipe == "arith":
        return f"arith-llama-v{model.version}", "fit.json"
    if model.recipe == "tiny-rm":
        return f"tiny-rm-digits-v{model.version}", "fit.json"
    return f"{name}-v{model.version}", "config.json"


def lookup_builtin(name: str) -> BuiltinModel:
    """The builtin model called ``name``; a ModelLoadError naming the choices otherwise."""
    if name in BUILTIN_MODELS:
        return BUILTIN_MODELS[name]
    choices = sorted(BUILTIN_MODELS)
    close = difflib.get_close_matches(name, choices, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise ModelLoadError(
        f"unknown builtin model '{name}'{hint}; builtin models are: {', '.join(choices)}"
    )
