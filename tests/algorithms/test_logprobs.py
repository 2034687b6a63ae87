"""Chunked token log-probabilities and entropies against the plain torch formulas."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.algorithms.logprobs import (
    linear_token_logprobs,
    linear_token_logprobs_and_entropy,
    token_entropy,
    token_logprobs,
)


def _reference(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def test_hand_example() -> None:
    # logits [0, ln 3] -> softmax [1/4, 3/4]; label 1 -> ln 0.75, label 0 -> ln 0.25.
    # At temperature 2 the logits [0, 2 ln 3] scale to the same [0, ln 3].
    logits = torch.tensor([[[0.0, math.log(3)], [0.0, math.log(3)]]])
    labels = torch.tensor([[1, 0]])
    torch.testing.assert_close(
        token_logprobs(logits, labels), torch.tensor([[math.log(0.75), math.log(0.25)]])
    )
    torch.testing.assert_close(
        token_logprobs(logits * 2, labels, temperature=2.0),
        torch.tensor([[math.log(0.75), math.log(0.25)]]),
    )


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_log_softmax_gather(chunk_size: int, temperature: float) -> None:
    generator = torch.Generator().manual_seed(chunk_size)
    logits = torch.randn(3, 5, 11, generator=generator) * 4
    labels = torch.randint(0, 11, (3, 5), generator=generator)
    result = token_logprobs(logits, labels, temperature, chunk_size)
    assert result.dtype == torch.float32 and result.shape == (3, 5)
    torch.testing.assert_close(result, _reference(logits, labels, temperature), atol=1e-5, rtol=0)


def test_gradient_matches_autograd_of_the_reference() -> None:
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4, 9, generator=generator)
    labels = torch.randint(0, 9, (2, 4), generator=generator)
    weights = torch.randn(2, 4, generator=generator)
    ours = logits.clone().requires_grad_(True)
    theirs = logits.clone().requires_grad_(True)
    (token_logprobs(ours, labels, 0.8, chunk_size=3) * weights).sum().backward()
    (_reference(theirs, labels, 0.8) * weights).sum().backward()
    assert ours.grad is not None and theirs.grad is not None
    torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-6, rtol=1e-5)


def test_gradcheck_in_float64() -> None:
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 5, dtype=torch.float64, generator=generator, requires_grad=True)
    labels = torch.randint(0, 5, (2, 3), generator=generator)
    # The computation runs in fp32 by contract, so finite differences need a step well above
    # fp32 rounding (central differences with eps=1e-3: truncation ~1e-6, rounding ~1e-4).
    assert torch.autograd.gradcheck(
        lambda x: token_logprobs(x, labels, 1.3, chunk_size=2).double(),
        (logits,),
        eps=1e-3,
        atol=1e-3,
        rtol=1e-3,
    )


def test_bfloat16_logits_give_fp32_results_and_bf16_grads() -> None:
    generator = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, 3, 7, generator=generator) * 3).to(torch.bfloat16)
    labels = torch.randint(0, 7, (2, 3), generator=generator)
    logits.requires_grad_(True)
    result = token_logprobs(logits, labels, chunk_size=4)
    assert result.dtype == torch.float32
    torch.testing.assert_close(result, _reference(logits.detach(), labels, 1.0), atol=1e-5, rtol=0)
    result.sum().backward()
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16


def test_errors() -> None:
    with pytest.raises(ValueError, match="vocab"):
        token_logprobs(torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long), temperature=0)


def test_entropy() -> None:
    # uniform over 4 -> ln 4; one-hot-like (100, 0, 0, 0) -> ~0
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]])
    entropy = token_entropy(logits, chunk_size=1)
    assert entropy[0, 0].item() == pytest.approx(math.log(4))
    assert entropy[0, 1].item() == pytest.approx(0.0, abs=1e-6)
    generator = torch.Generator().manual_seed(4)
    random_logits = torch.randn(2, 3, 6, generator=generator)
    probs = torch.softmax(random_logits / 0.5, -1)
    expected = -(probs * probs.log()).sum(-1)
    torch.testing.assert_close(token_entropy(random_logits, 0.5, chunk_size=4), expected)


def _linear_reference(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      labels: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = torch.nn.functional.linear(hidden, weight, bias)
    return _reference(logits, labels, temperature)


def _head_case(seed: int, with_bias: bool) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """13 rows of hidden size 6 against a vocabulary of 17: labels, an upstream gradient, and
    (hidden, weight[, bias]) twice as leaves: for the fused head and for the reference."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(13, 6, generator=generator)
    weight = torch.randn(17, 6, generator=generator)
    bias = torch.randn(17, generator=generator) if with_bias else None
    labels = torch.randint(0, 17, (13,), generator=generator)
    upstream = torch.randn(13, generator=generator)
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight) + ((bias,) if bias is not None else ())]
    return labels, upstream, leaves, [t.detach().clone().requires_grad_(True) for t in leaves]


@pytest.mark.parametrize("chunk_rows", [1, 4, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_head_matches_linear_then_log_softmax(chunk_rows: int, with_bias: bool) -> None:
    labels, upstream, leaves, theirs = _head_case(5 + chunk_rows, with_bias)
    ours_bias = leaves[2] if with_bias else None
    ours = linear_token_logprobs(leaves[0], leaves[1], labels, bias=ours_bias, temperature=0.7, chunk_rows=chunk_rows)
    expected = _linear_reference(theirs[0], theirs[1], theirs[2] if with_bias else None, labels, 0.7)
    assert ours.dtype == torch.float32 and ours.shape == (13,)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)
    (ours * upstream).sum().backward()
    (expected * upstream).sum().backward()
    for mine, reference in zip(leaves, theirs):
        assert mine.grad is not None and reference.grad is not None
        torch.testing.assert_close(mine.grad, reference.grad, atol=1e-5, rtol=1e-5)


def test_the_fused_heads_backward_walks_the_vocabulary_in_chunks_of_the_forwards_size() -> None:
    from flowrl.algorithms.logprobs import backward_columns

    # a forward chunk of 1,048 rows x 32,000 (2^25 logits) over 16,384 rows: 2,046 columns,
    # rounded down to a multiple of 64 (aligned rows for the chunk's products); and the chunk
    # of 2^26 logits the engine takes, 2,097 rows: 4,095 columns -> 4,032
    assert backward_columns(16384, 32000, 1048) == 1984
    assert backward_columns(16384, 32000, 2097) == 4032
    assert backward_columns(16000, 32000, 1048) == 2048  # 2,096
    assert backward_columns(16000, 151936, 220) == 2048  # 2,089
    assert backward_columns(16384, 151936, 220) == 1984  # 2,040
    assert backward_columns(13, 17, 4) == 5  # 68 logits over 13 rows: 5 columns, 4 chunks (fewer than 64: as they are)
    assert backward_columns(10, 100, 8) == 64  # 80, rounded down
    assert backward_columns(2, 17, 64) == 17  # never more than the vocabulary
    assert backward_columns(100, 17, 1) == 1  # never less than one column


def test_fused_head_in_bf16_on_a_cpu_matches_the_plain_head() -> None:
    """bf16 weights and hidden states, labels in every chunk of columns and a chunk with none:
    the weight gradient (one product per chunk of columns) and the hidden states' (summed over
    the chunks in fp32) stay within bf16's rounding of the plain head's."""
    generator = torch.Generator().manual_seed(21)
    hidden = torch.randn(40, 16, generator=generator).to(torch.bfloat16)
    weight = (torch.randn(300, 16, generator=generator) * 0.3).to(torch.bfloat16)
    labels = torch.randint(0, 100, (40,), generator=generator)  # columns 100-299 hold no label
    upstream = torch.randn(40, generator=generator)
    ours_h, ours_w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    their_h, their_w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ours = linear_token_logprobs(ours_h, ours_w, labels, chunk_rows=8)  # 60 columns per backward chunk
    expected = _linear_reference(their_h, their_w, None, labels, 1.0)
    torch.testing.assert_close(ours, expected.float(), atol=2e-2, rtol=0)
    (ours * upstream).sum().backward()
    (expected.float() * upstream).sum().backward()
    assert ours_h.grad is not None and their_h.grad is not None and ours_h.grad.dtype == torch.bfloat16
    assert ours_w.grad is not None and their_w.grad is not None and ours_w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(ours_h.grad.float(), their_h.grad.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ours_w.grad.float(), their_w.grad.float(), atol=2e-2, rtol=2e-2)


def test_fused_head_hand_example() -> None:
    # hidden [1, 0] against rows [0, 0] and [ln 3, 0]: logits [0, ln 3] -> ln 0.75 for label 1;
    # d/dlogits = onehot - softmax = [-1/4, 1/4], so d/dhidden = [-1/4 * 0 + 1/4 * ln 3, 0].
    hidden = torch.tensor([[1.0, 0.0]], requires_grad=True)
    weight = torch.tensor([[0.0, 0.0], [math.log(3), 0.0]], requires_grad=True)
    result = linear_token_logprobs(hidden, weight, torch.tensor([1]))
    torch.testing.assert_close(result, torch.tensor([math.log(0.75)]))
    result.sum().backward()
    assert hidden.grad is not None and weight.grad is not None
    torch.testing.assert_close(hidden.grad, torch.tensor([[0.25 * math.log(3), 0.0]]))
    torch.testing.assert_close(weight.grad, torch.tensor([[-0.25, 0.0], [0.25, 0.0]]))


def test_fused_head_gradcheck_in_float64() -> None:
    generator = torch.Generator().manual_seed(6)
    hidden = torch.randn(5, 3, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(4, 3, dtype=torch.float64, generator=generator, requires_grad=True)
    labels = torch.randint(0, 4, (5,), generator=generator)
    assert torch.autograd.gradcheck(
        lambda h, w: linear_token_logprobs(h, w, labels, temperature=1.3, chunk_rows=2).double(),
        (hidden, weight), eps=1e-3, atol=1e-3, rtol=1e-3,
    )


@pytest.mark.parametrize("chunk_rows", [1, 4, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_head_entropy_gradient_matches_autograd_of_the_plain_entropy(chunk_rows: int, with_bias: bool) -> None:
    # a loss of both outputs (an entropy bonus beside the log-probs) and of the entropy alone
    entropy_upstream = torch.randn(13, generator=torch.Generator().manual_seed(3))
    for logprob_weight in (1.0, 0.0):
        labels, upstream, leaves, theirs = _head_case(11 + chunk_rows, with_bias)
        values, entropy = linear_token_logprobs_and_entropy(leaves[0], leaves[1], labels,
                                                            bias=leaves[2] if with_bias else None,
                                                            temperature=0.7, chunk_rows=chunk_rows)
        logits = torch.nn.functional.linear(theirs[0], theirs[1], theirs[2] if with_bias else None) / 0.7
        log_p = torch.log_softmax(logits, dim=-1)
        expected_entropy = -(log_p.exp() * log_p).sum(dim=-1)
        expected_values = log_p.gather(-1, labels[:, None]).squeeze(-1)
        torch.testing.assert_close(entropy, expected_entropy, atol=1e-5, rtol=0)
        loss = (entropy * entropy_upstream).sum()
        expected_loss = (expected_entropy * entropy_upstream).sum()
        if logprob_weight:
            loss = loss + (values * upstream).sum()
            expected_loss = expected_loss + (expected_values * upstream).sum()
        loss.backward()
        expected_loss.backward()
        for mine, reference in zip(leaves, theirs):
            assert mine.grad is not None and reference.grad is not None
            # fp32: dH/dz = -p (z - lse + H) sums terms of both signs, a few ulps of the largest
            torch.testing.assert_close(mine.grad, reference.grad, atol=5e-5, rtol=1e-4)


def test_fused_head_entropy_gradient_hand_example() -> None:
    # logits [log 3, 0]: p = [3/4, 1/4], H = 2 log 2 - (3/4) log 3, and dH/dz = -p (log p + H)
    # = [-3/16 log 3, +3/16 log 3]; through z = weight @ hidden with hidden = log 3:
    # dH/dhidden = -3/16 log 3, dH/dweight = [[-3/16 (log 3)^2], [3/16 (log 3)^2]]
    hidden = torch.tensor([[math.log(3)]], requires_grad=True)
    weight = torch.tensor([[1.0], [0.0]], requires_grad=True)
    _, entropy = linear_token_logprobs_and_entropy(hidden, weight, torch.tensor([0]))
    torch.testing.assert_close(entropy, torch.tensor([2 * math.log(2) - 0.75 * math.log(3)]))
    entropy.sum().backward()
    assert hidden.grad is not None and weight.grad is not None
    torch.testing.assert_close(hidden.grad, torch.tensor([[-3 / 16 * math.log(3)]]))
    torch.testing.assert_close(weight.grad, torch.tensor([[-3 / 16 * math.log(3) ** 2], [3 / 16 * math.log(3) ** 2]]))


def test_fused_head_errors() -> None:
    with pytest.raises(ValueError, match=r"\[R, H\]"):
        linear_token_logprobs(torch.zeros(2, 3), torch.zeros(4, 5), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        linear_token_logprobs(torch.zeros(2, 3), torch.zeros(4, 3), torch.zeros(2, dtype=torch.long), temperature=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("entropy_weight", [0.0, 0.5])
def test_fused_head_on_a_gpu_in_bf16_matches_the_plain_head(entropy_weight: float) -> None:
    # the compiled chunk steps against autograd of the plain head; with an entropy weight, the
    # gradient of log-probs minus that weight x the entropies (an entropy bonus)
    generator = torch.Generator(device="cuda").manual_seed(7)
    hidden = torch.randn(300, 64, device="cuda", generator=generator).to(torch.bfloat16)
    weight = (torch.randn(5000, 64, device="cuda", generator=generator) * 0.1).to(torch.bfloat16)
    labels = torch.randint(0, 5000, (300,), device="cuda", generator=generator)
    ours_h, ours_w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    theirs_h, theirs_w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    values, entropy = linear_token_logprobs_and_entropy(ours_h, ours_w, labels, temperature=0.8, chunk_rows=128)
    log_p = torch.log_softmax(torch.nn.functional.linear(theirs_h, theirs_w).float() / 0.8, dim=-1)
    expected_values = log_p.gather(-1, labels[:, None]).squeeze(-1)
    expected_entropy = -(log_p.exp() * log_p).sum(dim=-1)
    torch.testing.assert_close(values, expected_values, atol=2e-2, rtol=0)  # bf16 logits, fp32 softmax
    torch.testing.assert_close(entropy, expected_entropy, atol=2e-2, rtol=0)
    (values.sum() - entropy_weight * entropy.sum()).backward()
    (expected_values.sum() - entropy_weight * expected_entropy.sum()).backward()
    assert ours_h.grad is not None and theirs_h.grad is not None and ours_w.grad is not None and theirs_w.grad is not None
    torch.testing.assert_close(ours_h.grad.float(), theirs_h.grad.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ours_w.grad.float(), theirs_w.grad.float(), atol=2e-2, rtol=2e-2)


def test_compiled_chunk_steps_match_the_plain_ones_over_changing_shapes() -> None:
    # What the GPU runs: each chunk's steps traced by torch.compile (here through the
    # aot_eager backend on the CPU), one compiled version serving every row count.
    from torch._dynamo.utils import counters

    from flowrl.algorithms.logprobs import (
        _logits_backward,
        _logits_backward_entropy,
        _logits_forward,
        _logits_forward_entropy,
    )
    from flowrl.backends.compiled_layers import CompiledFunction

    forward = CompiledFunction(_logits_forward, "forward", device_types=("cpu",), backend="aot_eager")
    backward = CompiledFunction(_logits_backward, "backward", device_types=("cpu",), backend="aot_eager")
    entropy_backward = CompiledFunction(_logits_backward_entropy, "entropy backward", device_types=("cpu",),
                                        backend="aot_eager")
    generator = torch.Generator().manual_seed(9)
    torch._dynamo.reset()  # compiled versions are kept per code object, shared with other tests
    forward_graphs = []
    for rows in (8, 5, 3):
        logits = torch.randn(rows, 11, generator=generator).to(torch.bfloat16)
        labels = torch.randint(0, 11, (rows, 1), generator=generator)
        upstream = torch.randn(rows, 1, generator=generator)
        before = counters["stats"]["unique_graphs"]
        lse, out = forward(logits, labels, 0.7)
        forward_graphs.append(counters["stats"]["unique_graphs"] - before)
        plain_lse, plain_out = _logits_forward(logits, labels, 0.7)
        torch.testing.assert_close(lse, plain_lse)
        torch.testing.assert_close(out, plain_out)
        grad, summed = backward(logits, lse, labels, upstream, 0.7, True)
        plain_grad, plain_sum = _logits_backward(logits, lse, labels, upstream, 0.7, True)
        assert grad.dtype == torch.bfloat16 and summed is not None and plain_sum is not None
        torch.testing.assert_close(grad, plain_grad)
        torch.testing.assert_close(summed, plain_sum)
        _, _, entropy = _logits_forward_entropy(logits, labels, 0.7)
        entropy_upstream = torch.randn(rows, 1, generator=generator)
        grad, summed = entropy_backward(logits, lse, entropy, labels, upstream, entropy_upstream, 0.7, True)
        plain_grad, plain_sum = _logits_backward_entropy(logits, lse, entropy, labels, upstream, entropy_upstream,
                                                         0.7, True)
        torch.testing.assert_close(grad, plain_grad)
        torch.testing.assert_close(summed, plain_sum)
        # a chunk of vocabulary columns (the fused head's backward): rows whose label is not
        # one of its columns get no onehot
        hit = (torch.arange(rows) % 2 == 0).to(torch.float32)[:, None]
        grad, summed = backward(logits, lse, labels, upstream, 0.7, True, hit)
        plain_grad, plain_sum = _logits_backward(logits, lse, labels, upstream, 0.7, True, hit)
        torch.testing.assert_close(grad, plain_grad)
        torch.testing.assert_close(summed, plain_sum)
        grad, _ = entropy_backward(logits, lse, entropy, labels, upstream, entropy_upstream, 0.7, False, hit)
        plain_grad, _ = _logits_backward_entropy(logits, lse, entropy, labels, upstream, entropy_upstream,
                                                 0.7, False, hit)
        torch.testing.assert_close(grad, plain_grad)
    assert forward_graphs == [1, 0, 0]
    assert forward.compiled is not None and not forward.failed
    assert entropy_backward.compiled is not None and not entropy_backward.failed


def test_a_compiler_failure_warns_once_and_runs_the_plain_function() -> None:
    from flowrl.algorithms.logprobs import _logits_forward
    from flowrl.backends.compiled_layers import CompiledFunction

    def broken(graph: object, example_inputs: object) -> object:
        raise RuntimeError("no code generated")

    forward = CompiledFunction(_logits_forward, "the chunks", device_types=("cpu",), backend=broken)
    logits, labels = torch.tensor([[0.0, math.log(3.0)]]), torch.tensor([[1]])
    with pytest.warns(UserWarning, match="torch.compile of the chunks failed"):
        lse, out = forward(logits, labels, 1.0)
    assert forward.failed
    torch.testing.assert_close(out, torch.tensor([math.log(0.75)]))
    lse, out = forward(logits, labels, 1.0)  # plain from now on, no second warning
    torch.testing.assert_close(lse, torch.tensor([math.log(4.0)]))
