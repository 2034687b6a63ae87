"""KL estimators k1 and k3 on hand values."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.algorithms.kl import kl_penalty


def test_k1_is_the_log_ratio() -> None:
    # logp - logp_ref: (-1) - (-2) = 1; (-2) - (-1) = -1; equal -> 0
    logprobs = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-2.0, -1.0, -0.5])
    torch.testing.assert_close(kl_penalty(logprobs, ref, "k1"), torch.tensor([1.0, -1.0, 0.0]))


def test_k3_hand_values() -> None:
    # x = ref - logp; k3 = e^x - x - 1
    #   logp=-1, ref=-2: x=-1 -> e^-1 + 1 - 1 = 0.367879
    #   logp=-2, ref=-1: x=+1 -> e - 1 - 1   = 0.718282
    #   equal: x=0 -> 1 - 0 - 1 = 0
    logprobs = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-2.0, -1.0, -0.5])
    expected = torch.tensor([math.exp(-1), math.e - 2, 0.0])
    torch.testing.assert_close(kl_penalty(logprobs, ref, "k3"), expected)


def test_both_estimators_are_unbiased_on_an_enumerated_distribution() -> None:
    # p = [0.5, 0.5] (policy), q = [0.25, 0.75] (reference).
    # KL(p || q) = 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75) = 0.5 ln(4/3) = 0.143841
    # E_p[k1] = sum p ln(p/q) = KL; E_p[k3] = sum q - sum p ln(q/p) - 1 = KL (sum q = 1).
    p = torch.tensor([0.5, 0.5], dtype=torch.float64)
    q = torch.tensor([0.25, 0.75], dtype=torch.float64)
    exact = 0.5 * math.log(4 / 3)
    for estimator in ("k1", "k3"):
        expectation = (p * kl_penalty(p.log(), q.log(), estimator)).sum().item()
        assert expectation == pytest.approx(exact, rel=1e-12)


def test_k3_is_never_negative_and_stays_finite_when_clamped() -> None:
    generator = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(1000, generator=generator) * 10
    ref = -torch.rand(1000, generator=generator) * 10
    assert (kl_penalty(logprobs, ref, "k3") >= 0).all()
    # ref - logp = 99 would be e^99; clamped to 20: e^20 - 20 - 1
    extreme = kl_penalty(torch.tensor([-100.0, -1.0]), torch.tensor([-1.0, -100.0]), "k3")
    assert extreme[0].item() == pytest.approx(math.exp(20) - 21, rel=1e-6)
    # ref - logp = -99 clamped to -20: e^-20 + 20 - 1
    assert extreme[1].item() == pytest.approx(math.exp(-20) + 19, rel=1e-6)


def test_k3_gradient_flows_into_logprobs_only() -> None:
    # d/dlogp [e^(ref - logp) - (ref - logp) - 1] = 1 - e^(ref - logp); at x = -1: 1 - e^-1
    logprobs = torch.tensor([-1.0], requires_grad=True)
    ref = torch.tensor([-2.0], requires_grad=True)
    kl_penalty(logprobs, ref, "k3").sum().backward()
    assert logprobs.grad is not None
    assert logprobs.grad.item() == pytest.approx(1 - math.exp(-1))
    assert ref.grad is None


def test_errors() -> None:
    with pytest.raises(ValueError, match="same shape"):
        kl_penalty(torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError, match="unknown KL estimator 'k2'"):
        kl_penalty(torch.zeros(2), torch.zeros(2), "k2")  # type: ignore[arg-type]
