"""Every model a run loads has its dropout off: the update's log-probs must equal the
rollout's and the reference's (eval mode) for the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, OPTConfig, OPTForCausalLM

from flowrl.backends.dropout import disable_dropout
from flowrl.backends.hf import load_causal_lm
from flowrl.backends.value_model import load_scalar_model


def _gpt2_folder(tmp_path: Path, tiny_llama_dir: Path) -> Path:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _train_mode_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.train()
    output = model(input_ids=ids)
    return output.logits if hasattr(output, "logits") else output


def test_a_gpt2_with_dropout_trains_without_it_and_keeps_its_config(tmp_path: Path, tiny_llama_dir: Path) -> None:
    # GPT-2 ships resid/embd/attn_pdrop 0.1: in train mode two passes differed, and the
    # policy differed from its own rollout by 0.9 nats per sequence at step 1
    folder = _gpt2_folder(tmp_path, tiny_llama_dir)
    model, _ = load_causal_lm(str(folder))
    ids = torch.arange(3, 19).view(2, 8)
    first, second = _train_mode_logits(model, ids), _train_mode_logits(model, ids)
    assert torch.equal(first, second)
    model.eval()
    assert torch.allclose(first, model(input_ids=ids).logits, atol=1e-6)
    # the saved config is the user's: only the loaded modules changed
    assert json.loads((folder / "config.json").read_text())["resid_pdrop"] == 0.1
    assert model.config.resid_pdrop == 0.1
    # a critic on the same backbone too
    critic, _ = load_scalar_model(str(folder), kind="value")
    mask = torch.ones_like(ids)
    critic.train()
    assert torch.equal(critic(ids, mask), critic(ids, mask))


def test_float_rates_and_skipped_layers_are_set_to_zero() -> None:
    # OPT keeps its rates as floats (self.dropout, self.activation_dropout) and skips whole
    # layers in training with probability self.layerdrop
    config = OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, ffn_dim=32, num_attention_heads=2,
                       word_embed_proj_dim=16, max_position_embeddings=32, dropout=0.1, attention_dropout=0.1,
                       activation_dropout=0.1, layerdrop=0.5)
    model = OPTForCausalLM(config)
    assert disable_dropout(model) > 0
    rates = [value for module in model.modules() for name, value in vars(module).items()
             if isinstance(value, float) and ("dropout" in name or "layerdrop" in name)]
    assert rates and all(rate == 0.0 for rate in rates)
    ids = torch.arange(1, 17).view(2, 8)
    model.train()
    assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)
    assert disable_dropout(model) == 0  # nothing left to change
