"""Dropout off in every model a run loads.

A model trains on log-probs of completions it sampled, measured against the log-probs of the
rollout and of the reference, all of which run in eval mode. With dropout on in the update
(GPT-2 and OPT ship ``*_pdrop``/``dropout`` 0.1) the update's log-probs are noisy copies of
the rollout's: at step 1, before any change, the policy differed from its own rollout by 0.9
nats per sequence, the KL term measured dropout, adapters moved with zero advantages, and a
resumed run no longer matched an uninterrupted one. So every dropout is set to 0 on load,
as RL trainers do; the model's config (and so the config saved with it) is left as it was.
"""

from __future__ import annotations

import torch

DROPOUT_WORDS = ("dropout", "pdrop", "layerdrop")
"""Words in the names of the float attributes transformers' modules keep their dropout
rates in (``self.attention_dropout``, ``self.resid_pdrop``, OPT's ``self.layerdrop``, which
skips whole layers in training)."""


def disable_dropout(model: torch.nn.Module) -> int:
    """Set every dropout of ``model`` to 0: each ``nn.Dropout`` module's ``p`` and each float
    attribute named for a dropout rate. Returns how many were not 0."""
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            changed += module.p != 0
            module.p = 0.0
        for name, value in vars(module).items():
            if isinstance(value, float) and any(word in name for word in DROPOUT_WORDS):
                changed += value != 0
                setattr(module, name, 0.0)
    return changed
