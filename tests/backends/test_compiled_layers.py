"""Compiled decoder layers give the eager log-probs and gradients, fall back on a compiler
failure, and are active only inside the pass that asks for them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from flowrl.backends.compiled_layers import compiled_for, decoder_layers, run_compiled
from flowrl.backends.tokenizer import build_char_tokenizer
from flowrl.roles.forward import completion_logprobs
from tests.tiny_models import text_rollout, tiny_policy

CPU = torch.device("cpu")


def _rollout(uneven: bool) -> Any:
    if uneven:  # mostly padding when padded: the pass is packed (attention outside the graph)
        prompts, completions = ["1+1=", "123456+7=", "9=", "40+2="], ["2", "123463 is it", "9", "42?"]
    else:
        prompts, completions = ["1+2=", "3+4=", "5+6=", "7+8="], ["3 ok", "7 ok", "11 o", "15 k"]
    return text_rollout(build_char_tokenizer(), prompts, completions, group_size=2, max_new_tokens=12)


def _logprobs_and_grads(model: torch.nn.Module, rollout: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    values = completion_logprobs(model, rollout, CPU)
    mask = rollout.completion_mask.float()
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask
    (values * weights).sum().backward()
    return values.detach() * mask, [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("uneven", [False, True], ids=["padded", "packed"])
def test_compiled_layers_give_the_eager_values_and_gradients(uneven: bool) -> None:
    rollout = _rollout(uneven)
    eager_model, compiled_model = tiny_policy(seed=5), tiny_policy(seed=5)
    # "aot_eager": dynamo's graphs and autograd through them, without a C++ build per graph
    compiled = compiled_for(compiled_model, force=True, backend="aot_eager")
    assert compiled is not None and len(compiled.calls) == len(decoder_layers(compiled_model) or [])
    eager_values, eager_grads = _logprobs_and_grads(eager_model, rollout)
    graphs_before = counters["stats"]["unique_graphs"]
    values, grads = _logprobs_and_grads(compiled_model, rollout)
    assert counters["stats"]["unique_graphs"] > graphs_before and not compiled.failed
    torch.testing.assert_close(values, eager_values, atol=1e-5, rtol=0)
    assert len(grads) == len(eager_grads)
    for mine, theirs in zip(grads, eager_grads):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-4)
    # outside the pass the layers are plain modules again
    assert all(layer._compiled_call_impl is None for layer in compiled.layers)
    # a second pass of another shape reuses the compiled calls and still agrees
    with torch.no_grad():
        again = completion_logprobs(compiled_model, _rollout(not uneven), CPU)
        expected = completion_logprobs(eager_model, _rollout(not uneven), CPU)
    torch.testing.assert_close(again, expected, atol=1e-5, rtol=0)


def test_one_compiled_version_serves_passes_of_other_lengths_and_row_counts() -> None:
    # Without marking the sizes dynamic, the second length and then the second row count
    # would each compile again (three graphs in all).
    torch._dynamo.reset()  # compiled versions are kept per code object, shared by every test's model
    tokenizer = build_char_tokenizer()
    model = tiny_policy(seed=5)
    compiled = compiled_for(model, force=True, backend="aot_eager")
    assert compiled is not None
    new_graphs = []
    for rows, width in [(4, 6), (4, 9), (3, 7), (2, 5), (4, 11)]:
        prompts = ["1+2=", "3+4=", "5+6=", "7+8="][:rows]
        rollout = text_rollout(tokenizer, prompts, ["x" * width] * rows, group_size=2, max_new_tokens=width)
        before = counters["stats"]["unique_graphs"]
        with torch.no_grad():
            values = completion_logprobs(model, rollout, CPU)
        new_graphs.append(counters["stats"]["unique_graphs"] - before)
        assert values.shape == (rows, width)
    assert new_graphs == [1, 0, 0, 0, 0] and not compiled.failed


def test_a_compiler_failure_warns_once_and_the_model_stays_eager() -> None:
    def failing_backend(graph: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Any:
        raise RuntimeError("no kernels for this graph")

    rollout = _rollout(False)
    model, reference = tiny_policy(seed=2), tiny_policy(seed=2)
    compiled = compiled_for(model, force=True, backend=failing_backend)
    assert compiled is not None
    with pytest.warns(UserWarning, match="torch.compile of the decoder layers failed"):
        values = completion_logprobs(model, rollout, CPU)
    assert compiled.failed and compiled_for(model) is None
    torch.testing.assert_close(values, completion_logprobs(reference, rollout, CPU), atol=1e-6, rtol=0)


def test_errors_of_the_model_itself_are_not_hidden() -> None:
    model = tiny_policy()
    compiled_for(model, force=True, backend="aot_eager")

    def broken() -> None:
        raise ValueError("a shape the model rejects")

    with pytest.raises(ValueError, match="shape the model rejects"):
        run_compiled(model, broken)
    assert compiled_for(model) is not None


def test_not_wanted_on_a_cpu_model_unless_forced() -> None:
    model = tiny_policy()
    assert compiled_for(model) is None
    assert compiled_for(model, force=True, backend="aot_eager") is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("uneven", [False, True], ids=["padded", "packed"])
def test_layers_compiled_by_inductor_on_a_gpu_match_eager(uneven: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    rollout = _rollout(uneven)
    eager_model, compiled_model = tiny_policy(seed=5).cuda(), tiny_policy(seed=5).cuda()
    switched_off = compiled_for(eager_model)
    assert switched_off is not None and compiled_for(compiled_model) is not None  # wanted on CUDA
    switched_off.failed = True  # what a compiler failure leaves: this model's passes run eagerly
    results = []
    for model in (eager_model, compiled_model):
        values = completion_logprobs(model, rollout, torch.device("cuda"))
        mask = rollout.completion_mask.float().cuda()
        (values * mask).sum().backward()
        results.append((values.detach() * mask, [p.grad for p in model.parameters() if p.grad is not None]))
    assert compiled_for(compiled_model) is not None  # no failure on the way
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-4, rtol=0)
    assert len(results[1][1]) == len(results[0][1])
    for mine, theirs in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-3)
