"""Ranks of a sharded (FSDP2) update for tests: each a process of its own, since the sharding
group is a process's default group. Importable by name, so ``spawn`` can start them."""

from __future__ import annotations

import multiprocessing
import traceback
from typing import Any, Callable

import torch

from flowrl.roles.data_parallel import DataParallel
from flowrl.roles.state import ModelState
from flowrl.runtime.collective import DeviceGroup, free_port

Train = Callable[[ModelState, DataParallel | None], list[dict[str, float]]]


def _rank(make_state: Callable[[], ModelState], train: Train, index: int, shares: tuple[float, ...], port: int,
          results: Any) -> None:
    try:
        state = make_state()
        group = DeviceGroup("127.0.0.1", port, index, len(shares), timeout_s=60, sharding=True)
        metrics = train(state, DataParallel(group, shares, mesh=group.mesh()))
        # the shards themselves, gathered (the whole copy beside them is checked to equal them)
        assert state.sharded is not None
        weights = {name: tensor.tolist() for name, tensor in _gathered(state.sharded).items()}
        for name, tensor in state.module.state_dict().items():
            assert tensor.tolist() == weights[name], name
        group.close()
        results.put((index, weights, metrics, None))
    except BaseException:  # reported to the test
        results.put((index, None, None, traceback.format_exc()))


def _gathered(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole tensors of a sharded model's state dict (every rank must call)."""
    from torch.distributed.tensor import DTensor

    return {name: value.full_tensor() if isinstance(value, DTensor) else value
            for name, value in module.state_dict().items()}


def run_sharded(make_state: Callable[[], ModelState], train: Train, shares: tuple[float, ...],
                ) -> list[tuple[dict[str, torch.Tensor], list[dict[str, float]]]]:
    """Whole weights and metrics of each rank after ``train`` over a gloo sharding group of
    ``len(shares)`` processes."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port("127.0.0.1")
    processes = [context.Process(target=_rank, args=(make_state, train, index, shares, port, results))
                 for index in range(len(shares))]
    for process in processes:
        process.start()
    try:
        got = sorted((results.get(timeout=180) for _ in processes), key=lambda item: item[0])
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    failures = [error for _, _, _, error in got if error]
    if failures:
        raise AssertionError("a rank failed:\n" + failures[0])
    return [({name: torch.tensor(value) for name, value in weights.items()}, metrics) for _, weights, metrics, _ in got]


# What the ranks train, the same as one device trains in the tests (module level: ``spawn``
# pickles them by name).

ADVANTAGES = [1.0, -1.0, 0.5, -0.5, 2.0, -2.0]


def rollout_of(state: ModelState) -> Any:
    from tests.tiny_models import text_rollout

    prompts = ["ab=", "ab=", "cd=", "cd=", "efg=", "efg="]
    completions = ["1", "xyz", "34", "z", "5678", "ab"]  # unequal lengths
    return text_rollout(state.tokenizer, prompts, completions, group_size=2, max_new_tokens=4)


def policy_state() -> ModelState:
    from tests.tiny_models import model_state, tiny_policy

    return model_state("actor", tiny_policy(0), 0)


def critic_state() -> ModelState:
    from tests.tiny_models import model_state, tiny_scalar_model

    return model_state("critic", tiny_scalar_model(0), 0)


def train_policy(node: Any, updates: int, state: ModelState, dp: DataParallel | None) -> list[dict[str, float]]:
    from flowrl.roles.update import update_policy

    rollout = rollout_of(state)
    reference = torch.randn(6, rollout.completion_ids.shape[1], generator=torch.Generator().manual_seed(1)) * 0.1 - 2.0
    return [update_policy(state, rollout, torch.tensor(ADVANTAGES), reference, node, seed=0, dp=dp).metrics
            for _ in range(updates)]


def train_critic(node: Any, updates: int, state: ModelState, dp: DataParallel | None) -> list[dict[str, float]]:
    from flowrl.roles.update import update_critic

    rollout = rollout_of(state)
    returns = rollout.completion_mask.float() * torch.linspace(-1.0, 1.0, rollout.completion_mask.shape[1])
    return [update_critic(state, rollout, returns, None, node, seed=0, dp=dp).metrics for _ in range(updates)]


def logprobs_sharded_and_whole(state: ModelState, dp: DataParallel | None) -> list[dict[str, float]]:
    """Shards the model, then compares its log-probs and entropies (the fused head standing in
    for the sharded model's output head) with those of the whole copy beside it; counts the
    calls of the sharded model's own output head."""
    from flowrl.backends.compiled_layers import decoder_layers
    from flowrl.backends.shared_prompt import NAME as SHARED
    from flowrl.roles.forward import completion_logprobs, completion_logprobs_and_entropy

    assert dp is not None and dp.mesh is not None
    state.shard_training(dp.mesh)
    sharded = state.training_module
    head = sharded.get_output_embeddings()
    calls: list[int] = []
    head.register_forward_hook(lambda *_: calls.append(1))
    # the attention each pass's first layer runs: the pass's layout (shared prompts, packed, padded)
    attention: dict[str, list[str]] = {"sharded": [], "whole": []}
    for key, model in (("sharded", sharded), ("whole", state.module)):
        layer = (decoder_layers(model) or [])[0]
        layer.register_forward_pre_hook(
            lambda *_, key=key, model=model: attention[key].append(model.config._attn_implementation))
    rollout = rollout_of(state)
    logprobs, entropy = completion_logprobs_and_entropy(sharded, rollout, state.device, entropy_grad=True)
    mask = rollout.completion_mask.bool()
    # the head's gradient (an entropy bonus's too) goes through the sharded model's backward
    (logprobs.sum() + (entropy * mask).sum()).backward()
    whole, whole_entropy = completion_logprobs_and_entropy(state.module, rollout, state.device, entropy_grad=True)
    (whole.sum() + (whole_entropy * mask).sum()).backward()
    whole_grads = dict(state.module.named_parameters())
    # every rank computed the same rows, and the ranks' gradients add up
    ranks = torch.distributed.get_world_size()
    grad_diff = max(float((parameter.grad.full_tensor() - ranks * whole_grads[name].grad).abs().max())
                    for name, parameter in sharded.named_parameters())
    head_grad_norm = float(head.weight.grad.full_tensor().norm())
    same_layout = attention["sharded"] == attention["whole"]
    # asked for no entropy gradient, the sharded model's entropy is a metric
    _, metric = completion_logprobs_and_entropy(sharded, rollout, state.device)
    return [{
        "same_layout": float(same_layout),
        "shared_prompts": float(attention["sharded"][:1] == [SHARED]),
        "logprob_diff": float((logprobs - whole).detach().abs().max()),
        "entropy_diff": float((entropy - whole_entropy).detach().abs().max()),
        "grad_diff": grad_diff,
        "metric_entropy_grad": float(metric.requires_grad),
        "metric_entropy_diff": float((metric - whole_entropy).detach().abs().max()),
        "masked_zero": float(logprobs[~mask].abs().max()) if bool((~mask).any()) else 0.0,
        "head_calls": float(len(calls)),
        "head_grad_norm": head_grad_norm,
        "no_grad_diff": float((completion_logprobs(sharded, rollout, state.device) - whole).abs().max()),
    }]


def policy_state_bf16() -> ModelState:
    from tests.tiny_models import model_state, tiny_policy

    return model_state("actor", tiny_policy(0).to(torch.bfloat16), 0)


def train_policy_checking_masters(node: Any, updates: int, state: ModelState,
                                  dp: DataParallel | None) -> list[dict[str, float]]:
    """:func:`train_policy`, then the whole optimizer state (gathered from the shards when
    sharded) holds an fp32 master of every parameter, which rounds to the model's weights."""
    metrics = train_policy(node, updates, state, dp)
    whole = state.optimizer_state()
    assert whole is not None
    params = [p for p in state.module.parameters() if p.requires_grad]
    for index, param in enumerate(params):
        master = whole["state"][index]["master"]
        assert master.dtype == torch.float32 and master.shape == param.shape
        assert torch.equal(master.to(param.device, torch.bfloat16), param.detach())
    return metrics
