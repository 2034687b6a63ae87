"""Whether a causal LM's logits are its output head's plain product.

The fused output head (``flowrl.algorithms.logprobs.linear_token_logprobs``) computes
log-probs from the head's weight without the full logits, which is right only when the model's
logits are that product. Some models transform them first (Gemma 2 soft-caps them, Cohere and
Granite scale them); their log-probs go through the model's own forward, full logits and all,
and the planner counts those logits.
"""

from __future__ import annotations

from collections.abc import Mapping

LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
"""Config fields of models whose logits are not the output head's plain product."""


def transforms_logits(config: object) -> bool:
    """True when ``config`` (a transformers config, or a config.json's dict) sets one of
    ``LOGIT_TRANSFORMS`` to something other than none or 1."""
    def value(name: str) -> object:
        return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)

    return any(value(name) not in (None, 1, 1.0) for name in LOGIT_TRANSFORMS)
