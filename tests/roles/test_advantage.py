"""The advantage role with estimators, hand-computed; token-level advantages in the update."""

from __future__ import annotations


import pytest
import torch

from flowrl.algorithms.advantages import grpo_advantages
from flowrl.roles.batch import Scores
from flowrl.roles.forward import completion_logprobs
from flowrl.roles.advantage import run_advantage
from flowrl.roles.batch import Advantages
from flowrl.roles.update import update_policy
from flowrl.spec.schema import AdvantageNode, UpdateNode
from tests.tiny_models import model_state, text_rollout, tiny_policy


def _node(estimator: str, **settings: object) -> AdvantageNode:
    return AdvantageNode.model_validate({"inputs": ["reward"], "estimator": estimator, **settings})


def test_grpo_from_the_schema_node_equals_the_plain_function() -> None:
    scores = [
        Scores(torch.tensor([1.0, 0.0, 0.5, 0.25])),
        Scores(torch.tensor([0.0, 1.0, 0.0, 0.0])),
    ]
    node = AdvantageNode(inputs=["reward"], estimator="grpo")
    output = run_advantage(scores, None, None, None, None, 2, node)
    result = output.value
    assert isinstance(result, Advantages) and result.returns is None and not result.token_level
    # Summed scores [1, 1, 0.5, 0.25]: group 0 constant -> 0; group 1 -> +-1/sqrt(2) / (std + eps).
    assert torch.equal(result.scores, torch.tensor([1.0, 1.0, 0.5, 0.25]))
    torch.testing.assert_close(result.advantages, grpo_advantages(result.scores, 2))
    assert output.metrics["critic/zero_std_groups"] == 0.5
    # the total score's extremes: 1 and 0.25 (neither node's own, 1/0.5 and 1/0)
    assert (output.metrics["critic/score/max"], output.metrics["critic/score/min"]) == (1.0, 0.25)


def test_rloo_by_hand() -> None:
    # Groups of 2: A_i = r_i - r_other. [1, 0] -> [1, -1]; [0.5, 0.5] -> [0, 0].
    scores = [Scores(torch.tensor([1.0, 0.0, 0.5, 0.5]))]
    result = run_advantage(scores, None, None, None, None, 2, _node("rloo")).value
    assert result.advantages.tolist() == [1.0, -1.0, 0.0, 0.0]


def test_gae_by_hand_with_padding() -> None:
    # One row, tokens 0 and 1 real, column 2 padding. Score 1 on the last real token.
    # gamma = lam = 1, no whitening, values [0.5, 0.8]:
    #   delta_1 = r_1 + 0 - V_1 = 1 - 0.8 = 0.2           A_1 = 0.2
    #   delta_0 = r_0 + V_1 - V_0 = 0 + 0.8 - 0.5 = 0.3   A_0 = 0.3 + 0.2 = 0.5
    #   returns = A + V = [1.0, 1.0]
    mask = torch.tensor([[1, 1, 0]])
    values = torch.tensor([[0.5, 0.8, 123.0]])
    node = _node("gae", gamma=1.0, lam=1.0, whiten=False)
    output = run_advantage([Scores(torch.tensor([1.0]))], values, None, None, mask, 1, node)
    result = output.value
    assert result.token_level
    torch.testing.assert_close(result.advantages, torch.tensor([[0.5, 0.2, 0.0]]))
    torch.testing.assert_close(result.returns, torch.tensor([[1.0, 1.0, 0.0]]))
    assert abs(output.metrics["critic/returns/mean"] - 1.0) < 1e-6


def test_gae_with_a_kl_reward_penalty_by_hand() -> None:
    # kl_t = logp - logp_ref = [0.2, 0.4]; kl_coef 0.1 -> r = [-0.02, 1 - 0.04] = [-0.02, 0.96].
    # Values 0, gamma = lam = 1: A_1 = 0.96, A_0 = -0.02 + 0.96 = 0.94; returns = A.
    mask = torch.tensor([[1, 1]])
    policy = torch.tensor([[-1.0, -2.0]])
    reference = torch.tensor([[-1.2, -2.4]])
    node = _node("gae", gamma=1.0, lam=1.0, whiten=False)
    output = run_advantage(
        [Scores(torch.tensor([1.0]))],
        torch.zeros(1, 2),
        reference,
        policy,
        mask,
        1,
        node,
        kl_coef=0.1,
    )
    torch.testing.assert_close(output.value.advantages, torch.tensor([[0.94, 0.96]]))
    torch.testing.assert_close(output.value.returns, torch.tensor([[0.94, 0.96]]))
    # Sequence KL 0.2 + 0.4 = 0.6 (what an adaptive controller is fed); token mean 0.3.
    assert abs(output.metrics["critic/kl/sequence_mean"] - 0.6) < 1e-6
    assert abs(output.metrics["critic/kl/token_mean"] - 0.3) < 1e-6
    assert output.metrics["actor/reward_kl_penalty_coeff"] == 0.1
    # verl's penalty: the mean over sequences of each one's token mean, here 0.3
    assert abs(output.metrics["actor/reward_kl_penalty"] - 0.3) < 1e-6


def test_reinforce_pp_is_token_level_and_zero_on_padding() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    output = run_advantage(
        [Scores(torch.tensor([1.0, 0.0]))], None, None, None, mask, 1, _node("reinforce_pp")
    )
    advantages = output.value.advantages
    assert advantages.shape == (2, 3) and advantages[0, 2] == 0.0
    # Returns [1, 1, -] and [0, 0, 0]: whitened over the 5 tokens, the first row is positive.
    assert bool((advantages[0, :2] > 0).all()) and bool((advantages[1] < 0).all())


def test_missing_inputs_are_named() -> None:
    scores = [Scores(torch.tensor([1.0]))]
    mask = torch.ones(1, 2)
    with pytest.raises(ValueError, match="values"):
        run_advantage(scores, None, None, None, mask, 1, _node("gae"))
    with pytest.raises(ValueError, match="reference"):
        run_advantage(
            scores, torch.zeros(1, 2), None, None, mask, 1, _node("gae"), kl_coef=0.1
        )


def test_policy_update_takes_token_level_advantages() -> None:
    state = model_state("actor", tiny_policy(0))
    tokenizer = state.tokenizer
    prompts, completions = ["ab=", "ab=", "cd=", "cd="], ["12", "x", "34", "zw"]
    rollout = text_rollout(tokenizer, prompts, completions, group_size=2, max_new_tokens=2)
    # +1 on every token of the digit completions, -1 on the letters, 0 on padding ([N, T]).
    sign = torch.tensor([1.0, -1.0, 1.0, -1.0]).unsqueeze(1)
    advantages = sign * rollout.completion_mask.float()
    before = completion_logprobs(state.module, rollout, state.device).detach()
    node = UpdateNode(
        model="actor", inputs=["rollout", "adv"], lr=1e-2, ppo_epochs=2, mini_batch_size=2
    )
    output = update_policy(state, rollout, advantages, None, node, seed=0)
    after = completion_logprobs(state.module, rollout, state.device).detach()
    gain = ((after - before) * rollout.completion_mask).sum(dim=1)
    assert output.metrics["actor/num_optimizer_steps"] == 4.0
    assert gain[0] > 0 and gain[2] > 0 and gain[1] < 0 and gain[3] < 0


def test_critic_rewards_carry_the_kl_penalty_as_in_verl() -> None:
    # One row of two real tokens, score 1, per-token KL (policy - reference) [0.5, 0.3]:
    # the sequence's reward is 1 - 0.1 * 0.8 = 0.92 (verl's critic/rewards/mean); its score
    # stays 1 (critic/score/mean).
    mask = torch.tensor([[1, 1, 0]])
    policy = torch.tensor([[-1.0, -2.0, 0.0]])
    reference = torch.tensor([[-1.5, -2.3, 5.0]])
    node = _node("gae", gamma=1.0, lam=1.0, whiten=False, kl_coef=0.1)
    output = run_advantage([Scores(torch.tensor([1.0]))], torch.zeros(1, 3), reference, policy, mask, 1, node,
                           kl_coef=0.1)
    assert abs(output.metrics["critic/rewards/mean"] - 0.92) < 1e-6
    assert output.value.scores.tolist() == [1.0]
    # the rewards are the returns of the first token at gamma = lam = 1 with zero values
    assert abs(float(output.value.returns[0, 0]) - 0.92) < 1e-6
