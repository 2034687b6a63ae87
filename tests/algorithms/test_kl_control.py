"""KL coefficient controllers over a few hand-computed updates.

TRL 1.16 has no KL controller to compare with (its ``AdaptiveKLController`` left with the PPO
trainer); the expectations follow Ziegler et al. 2019 by hand.
"""

from __future__ import annotations

import pytest

from flowrl.algorithms.kl_control import AdaptiveKLController, FixedKLController, KLController


def test_fixed_controller_never_moves() -> None:
    controller: KLController = FixedKLController(0.05)
    controller.update(current_kl=100.0, num_steps=64)
    assert controller.coef == 0.05
    assert controller.state_dict() == {"coef": 0.05}


def test_adaptive_controller_over_a_few_updates() -> None:
    # init 0.1, target 6, horizon 100; coef *= 1 + clip(KL / 6 - 1, -0.2, 0.2) * n / 100
    #   1. KL 6.6, n 10: error = 0.1           -> 0.1     * (1 + 0.1 * 0.1)  = 0.101
    #   2. KL 12,  n 10: error 1.0 -> clip 0.2 -> 0.101   * (1 + 0.2 * 0.1)  = 0.10302
    #   3. KL 3,   n 20: error -0.5 -> -0.2    -> 0.10302 * (1 - 0.2 * 0.2)  = 0.0988992
    #   4. KL 6,   n 50: error 0               -> unchanged                  = 0.0988992
    controller = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=100)
    expected = [0.101, 0.10302, 0.0988992, 0.0988992]
    for (kl, num_steps), coef in zip([(6.6, 10), (12.0, 10), (3.0, 20), (6.0, 50)], expected):
        controller.update(kl, num_steps)
        assert controller.coef == pytest.approx(coef, rel=1e-12)


def test_adaptive_controller_state_round_trip() -> None:
    # A resumed run continues from the coefficient reached, not from init_coef.
    controller = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=100)
    controller.update(12.0, 10)  # 0.1 * 1.02 = 0.102
    state = controller.state_dict()
    assert state == {"coef": pytest.approx(0.102)}
    resumed = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=100)
    resumed.load_state_dict(state)
    assert resumed.coef == controller.coef
    resumed.update(12.0, 10)
    controller.update(12.0, 10)
    assert resumed.coef == controller.coef


def test_adaptive_controller_never_goes_negative() -> None:
    # n / horizon = 10: 1 + (-0.2) * 10 = -1 would flip the sign; it stops at 0.
    controller = AdaptiveKLController(init_coef=0.1, target=1.0, horizon=10)
    controller.update(0.0, 100)
    assert controller.coef == 0.0


def test_controller_errors() -> None:
    with pytest.raises(ValueError, match="target KL must be > 0"):
        AdaptiveKLController(init_coef=0.1, target=0.0, horizon=100)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(init_coef=0.1, target=1.0, horizon=0)
    with pytest.raises(ValueError, match="init_coef"):
        AdaptiveKLController(init_coef=-1.0, target=1.0, horizon=10)
    controller = AdaptiveKLController(init_coef=0.1, target=1.0, horizon=10)
    with pytest.raises(ValueError, match="measured KL is nan"):
        controller.update(float("nan"), 1)
    with pytest.raises(ValueError, match="'coef' entry"):
        controller.load_state_dict({"value": 0.2})
    with pytest.raises(ValueError, match="coef must be"):
        FixedKLController(0.1).load_state_dict({"coef": float("inf")})
