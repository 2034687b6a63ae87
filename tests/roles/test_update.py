"""The GRPO update role on a tiny real model: steps, old log-probs, and the direction it learns."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from flowrl.roles.batch import Rollout
from flowrl.roles.forward import completion_logprobs
from flowrl.roles.state import ModelState
from flowrl.roles.update import update_policy
from flowrl.spec.schema import UpdateNode
from tests.tiny_models import model_state, tiny_policy


def _state(seed: int = 0) -> ModelState:
    return model_state("actor", tiny_policy(seed), seed)


def _rollout(state: ModelState) -> Rollout:
    tokenizer = state.tokenizer
    prompts = ["ab=", "ab=", "cd=", "cd="]
    completions = ["12", "xy", "34", "zw"]
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    completion = tokenizer(completions, return_tensors="pt", padding=True, add_special_tokens=False)
    return Rollout(
        prompt_ids=encoded["input_ids"], prompt_mask=encoded["attention_mask"],
        completion_ids=completion["input_ids"], completion_mask=completion["attention_mask"],
        group_size=2, prompts=prompts, completions=completions, answers=[None] * 4,
        max_new_tokens=2, temperature=1.0,
    )


def test_single_step_update_has_ratio_one_and_raises_the_favoured_completion() -> None:
    state = _state()
    rollout = _rollout(state)
    # advantage +1 for the digit completions, -1 for the letters
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    before = completion_logprobs(state.module, rollout, state.device).detach()
    node = UpdateNode(model="actor", inputs=["rollout", "adv"], lr=1e-2)
    output = update_policy(state, rollout, advantages, None, node, seed=0)
    after = completion_logprobs(state.module, rollout, state.device).detach()

    # one epoch, one mini-batch: old log-probs are the new ones detached, so ratio == 1 exactly
    assert output.metrics["actor/ratio_mean"] == 1.0
    assert output.metrics["actor/pg_clipfrac"] == 0.0
    assert output.metrics["actor/num_optimizer_steps"] == 1.0
    gain = (after - before).sum(dim=1)
    assert gain[0] > 0 and gain[2] > 0      # favoured completions became likelier
    assert gain[1] < 0 and gain[3] < 0      # disfavoured ones less likely
    assert state.num_updates == 1


def test_epochs_and_mini_batches_make_that_many_optimizer_steps_against_fixed_old_logprobs() -> None:
    state = _state()
    rollout = _rollout(state)
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    node = UpdateNode(model="actor", inputs=["rollout", "adv"], lr=5e-2, ppo_epochs=3, mini_batch_size=2)
    output = update_policy(state, rollout, advantages, None, node, seed=0)
    # 3 epochs x (4 sequences / 2 per mini-batch) = 6 optimizer steps
    assert output.metrics["actor/num_optimizer_steps"] == 6.0
    # After the first step the policy has moved away from the fixed old log-probs, so the
    # mean ratio over all steps is no longer exactly 1.
    assert output.metrics["actor/ratio_mean"] != 1.0


def test_kl_term_is_reported_and_zero_against_itself() -> None:
    state = _state()
    rollout = _rollout(state)
    reference = completion_logprobs(state.module, rollout, state.device).detach()
    node = UpdateNode(model="actor", inputs=["rollout", "adv", "ref"], lr=1e-3, kl_coef=0.1, kl_estimator="k3")
    output = update_policy(state, rollout, torch.zeros(4), reference, node, seed=0)
    # the reference equals the policy before the step, so k3 = exp(0) - 0 - 1 = 0
    assert output.metrics["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)


def test_an_entropy_bonus_alone_raises_the_entropy_and_enters_the_loss() -> None:
    # zero advantages and no KL: the clipped surrogate's gradient is 0, so only the bonus moves
    # the policy, towards higher entropy; one pass of token_mean: loss = pg_loss - coef x entropy
    rollout = _rollout(_state())
    entropies = []
    for coef in (0.0, 0.5):
        state = _state()
        node = UpdateNode(model="actor", inputs=["rollout", "adv"], lr=1e-3, entropy_coef=coef)
        before = [p.detach().clone() for p in state.module.parameters()]
        outputs = [update_policy(state, rollout, torch.zeros(4), None, node, seed=0) for _ in range(3)]
        moved = any(not torch.equal(a, b) for a, b in zip(before, state.module.parameters()))
        assert moved == (coef > 0)
        for output in outputs:
            metrics = output.metrics
            assert metrics["actor/loss"] == pytest.approx(metrics["actor/pg_loss"] - coef * metrics["actor/entropy"],
                                                          abs=1e-6)
        entropies.append([output.metrics["actor/entropy"] for output in outputs])
    still, raised = entropies
    assert still[0] == still[1] == still[2]
    assert raised[0] == still[0] and raised[0] < raised[1] < raised[2]


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean"])
def test_truncated_completions_masked_out_train_as_if_they_were_not_there(loss_agg: str) -> None:
    # rows 1 and 3 were cut at the limit: masked, the step equals the step on rows 0 and 2 alone
    advantages = torch.tensor([1.0, -1.0, 0.5, 2.0])
    results = []
    for masked in (True, False):
        state = _state()
        rollout = _rollout(state)
        rollout.truncated = torch.tensor([False, True, False, True])
        node = UpdateNode(model="actor", inputs=["rollout", "adv"], lr=1e-2, loss_agg=loss_agg,
                          mask_truncated_completions=masked)
        if not masked:
            rollout, advantages = rollout.select(torch.tensor([0, 2])), advantages[[0, 2]]
        output = update_policy(state, rollout, advantages, None, node, seed=0)
        results.append((output.metrics, [p.detach().clone() for p in state.module.parameters()]))
    (masked_metrics, masked_weights), (alone_metrics, alone_weights) = results
    for key in ("actor/loss", "actor/entropy", "actor/grad_norm"):
        assert masked_metrics[key] == pytest.approx(alone_metrics[key], rel=1e-5), key
    # AdamW's first step is lr x g / (|g| + eps): where g is near 0 the last bits of the
    # gradient (other rows in the pass) show, well below the step of 1e-2
    for mine, theirs in zip(masked_weights, alone_weights):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


def test_a_mini_batch_of_only_truncated_completions_leaves_the_weights_alone() -> None:
    state = _state()
    rollout = _rollout(state)
    rollout.truncated = torch.tensor([True, True, False, False])
    node = UpdateNode(model="actor", inputs=["rollout", "adv"], lr=1e-2, mask_truncated_completions=True,
                      mini_batch_size=2)
    update_policy(state, rollout, torch.tensor([1.0, -1.0, 0.5, -0.5]), None, node, seed=0)
    before = [p.detach().clone() for p in state.module.parameters()]
    # now every row is cut: no step (the moments of the first would move the weights on a zero
    # gradient) and no numbers of empty mini-batches averaged in
    rollout.truncated = torch.ones(4, dtype=torch.bool)
    output = update_policy(state, rollout, torch.tensor([1.0, -1.0, 0.5, -0.5]), None, node, seed=0)
    assert output.metrics["actor/num_optimizer_steps"] == 0.0 and "actor/loss" not in output.metrics
    for mine, theirs in zip(state.module.parameters(), before):
        assert torch.equal(mine, theirs)
    # rows 0 and 1 cut, one mini-batch of them alone: one step, on rows 2 and 3 only
    rollout.truncated = torch.tensor([True, True, False, False])
    ordered = UpdateNode(model="actor", inputs=["rollout", "adv"], lr=1e-2, mask_truncated_completions=True,
                         mini_batch_size=2, ppo_epochs=1)
    counts = {update_policy(state, rollout, torch.tensor([1.0, -1.0, 0.5, -0.5]), None, ordered,
                            seed=seed).metrics["actor/num_optimizer_steps"] for seed in range(6)}
    assert counts <= {1.0, 2.0} and 1.0 in counts  # a shuffle that pairs the cut rows makes one step


def test_truncated_importance_weights_scale_the_tokens_the_sampler_found_less_likely() -> None:
    # The sampler gave row 0's tokens a quarter of the training forward's probability: their
    # weight min(4, cap 2) = 2 on one step of token_mean at ratio 1 is the step with row 0's
    # advantage doubled; the other rows' sampling log-probs are the forward's own (weight 1).
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    results = []
    for capped in (True, False):
        state = _state()
        rollout = _rollout(state)
        current = completion_logprobs(state.module, rollout, state.device).detach()
        rollout.sampled_logprobs = current - torch.tensor([[math.log(4.0)], [0.0], [0.0], [0.0]])
        node = UpdateNode(model="actor", inputs=["rollout", "adv"], lr=1e-2, rollout_is_cap=2.0 if capped else None)
        scaled = advantages if capped else advantages * torch.tensor([2.0, 1.0, 1.0, 1.0])
        output = update_policy(state, rollout, scaled, None, node, seed=0)
        results.append((output.metrics, [p.detach().clone() for p in state.module.parameters()]))
    (capped_metrics, capped_weights), (doubled_metrics, doubled_weights) = results
    tokens = rollout.completion_mask.float()
    row0_share = float(tokens[0].sum() / tokens.sum())
    for metrics in (capped_metrics, doubled_metrics):  # the drift is logged whether or not it is corrected
        assert metrics["actor/rollout_logprob_diff"] == pytest.approx(math.log(4.0) * row0_share, rel=1e-5)
    # weight 2 on row 0's tokens, 1 elsewhere; without a cap no weight applies and none is logged
    assert capped_metrics["actor/rollout_is_weight"] == pytest.approx(1.0 + row0_share, rel=1e-5)
    assert "actor/rollout_is_weight" not in doubled_metrics
    assert capped_metrics["actor/pg_loss"] == pytest.approx(doubled_metrics["actor/pg_loss"], rel=1e-5)
    for mine, theirs in zip(capped_weights, doubled_weights):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-5)


def test_a_rollout_from_the_decoder_has_no_drift_from_the_training_forward_on_a_cpu() -> None:
    from flowrl.data import PromptExample
    from flowrl.roles.generate import run_generate
    from flowrl.spec.schema import GenerateNode

    state = _state()
    prompts = [PromptExample("ab=", "a"), PromptExample("xyzw=", "x")]
    rollout = run_generate(state, prompts, GenerateNode(model="actor", inputs=["prompts"], n=3, max_new_tokens=6)).value
    assert rollout.sampled_logprobs is not None
    node = UpdateNode(model="actor", inputs=["rollout", "adv"], lr=1e-3, rollout_is_cap=2.0)
    metrics = update_policy(state, rollout, torch.zeros(6), None, node, seed=0).metrics
    # fp32 on a CPU: the static decoder's log-probs and the training pass's agree to rounding
    assert metrics["actor/rollout_logprob_diff"] < 1e-4
    assert metrics["actor/rollout_is_weight"] == pytest.approx(1.0, abs=1e-4)


def test_rollout_is_cap_and_masking_cut_completions_need_what_the_rollout_knows() -> None:
    from flowrl.errors import FlowrlError

    state = _state()
    node = UpdateNode(model="actor", inputs=["rollout", "adv"], rollout_is_cap=2.0)
    with pytest.raises(FlowrlError, match="rollout_is_cap"):
        update_policy(state, _rollout(state), torch.zeros(4), None, node, seed=0)
    masking = UpdateNode(model="actor", inputs=["rollout", "adv"], mask_truncated_completions=True)
    with pytest.raises(FlowrlError, match="which completions were cut"):
        update_policy(state, _rollout(state), torch.zeros(4), None, masking, seed=0)


def test_padding_columns_do_not_change_logprobs() -> None:
    state = _state()
    rollout = _rollout(state)
    pad = state.tokenizer.pad_token_id
    wider = Rollout(
        prompt_ids=rollout.prompt_ids, prompt_mask=rollout.prompt_mask,
        completion_ids=torch.cat([rollout.completion_ids, torch.full((4, 3), pad)], dim=1),
        completion_mask=torch.cat([rollout.completion_mask, torch.zeros(4, 3, dtype=torch.long)], dim=1),
        group_size=2, prompts=rollout.prompts, completions=rollout.completions, answers=rollout.answers,
        max_new_tokens=5, temperature=1.0,
    )
    narrow = completion_logprobs(state.module, rollout, state.device)
    padded = completion_logprobs(state.module, wider, state.device)
    assert torch.allclose(padded[:, :2], narrow, atol=1e-6)
    assert torch.equal(padded[:, 2:], torch.zeros(4, 3))


def _uneven_rollout(state: ModelState) -> Rollout:
    """Six rows of different prompt and completion lengths (padding on both sides)."""
    tokenizer = state.tokenizer
    prompts = ["abcd=", "ab=", "a=", "abc=", "b=", "cdef="]
    completions = ["1", "x2y3", "77", "zzz", "9", "q1"]
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    completion = tokenizer(completions, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    return Rollout(
        prompt_ids=encoded["input_ids"], prompt_mask=encoded["attention_mask"],
        completion_ids=completion["input_ids"], completion_mask=completion["attention_mask"],
        group_size=2, prompts=prompts, completions=completions, answers=[None] * 6,
        max_new_tokens=4, temperature=1.0,
    )


def test_micro_batches_are_length_sorted_within_the_token_budget() -> None:
    from flowrl.roles.forward import micro_batches

    rollout = _uneven_rollout(_state())
    # total lengths (prompt + completion): 6, 7, 4, 7, 3, 7
    groups = [group.tolist() for group in micro_batches(rollout, max_tokens=14)]
    # sorted: 4(3) 2(4) 0(6) 1(7) 3(7) 5(7); widths grow as rows join a pass:
    # [4, 2]: 2 rows x (max prompt 2 + max completion 2) = 8; adding 0 makes 3 x (5+2) = 21 > 14
    # [0, 1]: 2 x (5 + 4) = 18 > 14, so 0 alone; [1, 3]: 2 x (4 + 4) = 16 > 14: each alone
    assert groups == [[4, 2], [0], [1], [3], [5]]
    assert [g.tolist() for g in micro_batches(rollout, None)] == [[0, 1, 2, 3, 4, 5]]
    assert sorted(sum(groups, [])) == list(range(6))


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean", "token_sum_norm"])
def test_micro_batches_give_the_whole_batch_gradient(loss_agg: str) -> None:
    """Gradient accumulation over length-sorted passes = one pass over the whole batch."""
    advantages = torch.tensor([1.0, -0.5, 0.3, -1.0, 0.7, 0.2])
    results = []
    for budget in (None, 12):
        state = _state()
        rollout = _uneven_rollout(state)
        reference = completion_logprobs(state.module, rollout, state.device).detach() + 0.1
        node = UpdateNode(model="actor", inputs=["rollout", "adv", "ref"], lr=1e-3, kl_coef=0.1,
                          loss_agg=loss_agg, micro_batch_tokens=budget, max_grad_norm=0.0)
        output = update_policy(state, rollout, advantages, reference, node, seed=0)
        grads = torch.cat([p.grad.flatten() for p in state.module.parameters() if p.grad is not None])
        results.append((output.metrics, grads))
    (whole, whole_grad), (parts, parts_grad) = results
    torch.testing.assert_close(parts_grad, whole_grad, atol=1e-6, rtol=1e-4)
    for key in ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/ratio_mean", "actor/grad_norm"):
        assert parts[key] == pytest.approx(whole[key], rel=1e-4, abs=1e-7), key


def test_every_pass_of_an_update_keeps_to_its_budget_the_old_log_probs_too() -> None:
    """Two epochs: the log-probs before the first step come from a no-grad pass over the whole
    rollout, which keeps to the node's token budget like the training passes."""
    state = _state()
    rollout = _uneven_rollout(state)
    tokens: list[int] = []
    handle = state.module.get_input_embeddings().register_forward_hook(
        lambda module, inputs, output: tokens.append(inputs[0].numel()))
    node = UpdateNode(model="actor", inputs=["rollout", "adv"], lr=1e-3, ppo_epochs=2, micro_batch_tokens=14)
    try:
        update_policy(state, rollout, torch.tensor([1.0, -0.5, 0.3, -1.0, 0.7, 0.2]), None, node, seed=0)
    finally:
        handle.remove()
    # the old log-probs' passes, then each epoch's (the rows come shuffled, so an epoch's
    # length-sorted groups may differ): 4-5 passes each, none over the budget (the 6 rows
    # hold 34 real tokens: one pass of them all would not be)
    assert len(tokens) >= 12 and max(tokens) <= 14, tokens


class _ModelReads(TorchDispatchMode):
    """Counts the host's reads of values computed from the model's parameters (``item()``,
    ``nonzero()``, ``tolist()``...): on a GPU each one waits for the device."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.derived: set[int] = {id(p) for p in module.parameters()}
        self.kept: list[torch.Tensor] = []  # keeps the ids above from being reused
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        from_model = any(id(t) in self.derived for t in inputs)
        if from_model and func.overloadpacket in (torch.ops.aten._local_scalar_dense, torch.ops.aten.nonzero,
                                                 torch.ops.aten.is_nonzero, torch.ops.aten.equal):
            self.reads += 1
        out = func(*args, **kwargs)
        if from_model:
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor):
                    self.derived.add(id(tensor))
                    self.kept.append(tensor)
        return out


def test_an_update_reads_its_loss_numbers_once_per_step_whatever_its_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loss terms of an optimizer step's passes are read from the device once, after the
    last pass (beside the gradient norm), not after each pass."""
    advantages = torch.tensor([1.0, -0.5, 0.3, -1.0, 0.7, 0.2])
    reads: dict[int | None, int] = {}
    tolist = torch.Tensor.tolist
    for budget in (None, 12):  # one pass; five passes (see the test above)
        state = _state()
        rollout = _uneven_rollout(state)
        reference = completion_logprobs(state.module, rollout, state.device).detach() + 0.1
        node = UpdateNode(model="actor", inputs=["rollout", "adv", "ref"], lr=1e-3, kl_coef=0.1,
                          micro_batch_tokens=budget)
        with _ModelReads(state.module) as counter:
            # tolist() reads without going through the dispatcher: counted here
            def counted(tensor: torch.Tensor, counter: _ModelReads = counter) -> object:
                counter.reads += id(tensor) in counter.derived
                return tolist(tensor)

            monkeypatch.setattr(torch.Tensor, "tolist", counted)
            update_policy(state, rollout, advantages, reference, node, seed=0)
            monkeypatch.setattr(torch.Tensor, "tolist", tolist)
        reads[budget] = counter.reads
    assert reads[12] == reads[None]
    assert reads[None] == 2  # the numbers (one tolist()) and the gradient norm
