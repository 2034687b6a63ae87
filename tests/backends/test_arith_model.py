"""builtin:arith-llama: the supervised fit's inputs, and a (small) fitted model on disk."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from flowrl.backends.arith_model import ArithModelRecipe, ArithProblem, arith_model_dir, encode_batch, read_fit
from flowrl.backends.tokenizer import build_char_tokenizer


def test_encode_batch_labels_only_the_completion() -> None:
    tokenizer = build_char_tokenizer()
    ids, mask, labels = encode_batch([ArithProblem("1+2=", "3"), ArithProblem("10-2=", "8")], tokenizer)
    # "1+2=" + "3;3" + <eos> = 8 tokens; "10-2=" + "8;8" + <eos> = 9 tokens (the widest)
    assert ids.shape == (2, 9) and mask.sum(dim=1).tolist() == [8, 9]
    assert tokenizer.decode(ids[0, :7]) == "1+2=3;3" and int(ids[0, 7]) == tokenizer.eos_token_id
    # labels: -100 on the prompt and the padding, the token itself on the completion
    assert (labels[0, :4] == -100).all() and labels[0, 4:8].tolist() == ids[0, 4:8].tolist()
    assert int(labels[0, 8]) == -100 and (labels[1, :5] == -100).all()


def test_a_small_fit_is_cached_and_loads_with_from_pretrained(tmp_path: Path) -> None:
    recipe = ArithModelRecipe(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, num_steps=3, batch_size=8)
    directory = arith_model_dir(tmp_path, recipe)
    fit = read_fit(directory)
    assert fit.num_steps == 3 and fit.num_eval == 500 and 0.0 <= fit.test_accuracy <= 1.0
    model = AutoModelForCausalLM.from_pretrained(directory)
    assert model.config.hidden_size == 32
    # a second call finds the cache; the same recipe rebuilt elsewhere has the same weights
    assert arith_model_dir(tmp_path, recipe) == directory
    again = AutoModelForCausalLM.from_pretrained(arith_model_dir(tmp_path / "other", recipe))
    for first, second in zip(model.parameters(), again.parameters()):
        torch.testing.assert_close(first, second, rtol=0, atol=0)
