"""The static-cache decode engine against transformers' generate() and the plain loop.

On CPU the engine runs its decode step eagerly (no CUDA graphs) over the same buffers, so
these tests check its arithmetic, the cache layout, compaction of finished rows and the
bookkeeping; ``test_greedy_matches_generate_on_gpu`` checks the captured graphs on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from flowrl.backends.generation import generate_tokens
from flowrl.backends.static_decode import StaticDecoder, _splits, decoder_for, unsupported_reason

PAD_ID = 0
VOCAB_SIZE = 40


def build(kind: str, device: str = "cpu") -> torch.nn.Module:
    shape = dict(vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128,
                 pad_token_id=PAD_ID, initializer_range=0.5)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        if kind == "qwen2":  # q/k/v biases and tied embeddings
            model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True))
        else:
            model = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False))
    return model.to(device).eval()


def left_padded(lengths: list[int], seed: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    width = max(lengths)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.randint(3, VOCAB_SIZE, (length,), generator=generator)
        mask[row, width - length:] = 1
    return ids.to(device), mask.to(device)


def hf_greedy(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int,
              eos: int) -> torch.Tensor:
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=PAD_ID, eos_token_id=eos)
    return out[:, ids.shape[1]:]


def frequent_token(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> int:
    """The token greedy decoding emits most often: as eos it makes rows stop at different steps."""
    free_run = hf_greedy(model, ids, mask, 40, eos=VOCAB_SIZE + 5)
    return int(torch.mode(free_run.flatten()).values)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_equals_transformers_generate(kind: str) -> None:
    model = build(kind)
    ids, mask = left_padded([5, 2, 7, 3, 6, 1], seed=1)
    expected = hf_greedy(model, ids, mask, 24, eos=VOCAB_SIZE + 5)
    out = StaticDecoder(model).generate(ids, mask, 24, eos_token_id=VOCAB_SIZE + 5, pad_token_id=PAD_ID,
                                        greedy=True)
    assert out.num_decode_steps == 24
    assert torch.equal(out.completion_ids, expected)
    assert bool(out.completion_mask.all())


@pytest.mark.parametrize(("gate_up_splits", "down_splits"), [(2, 1), (1, 4), (4, 2)])
def test_split_products_decode_as_whole_ones(gate_up_splits: int, down_splits: int) -> None:
    """The MLP's products cut along their inner dimension (partial sums added where they are
    read) give transformers' greedy tokens and the unsplit engine's log-probabilities."""
    model = build("qwen2")
    ids, mask = left_padded([5, 2, 7, 3], seed=7)
    expected = hf_greedy(model, ids, mask, 16, eos=VOCAB_SIZE + 5)
    settings = dict(eos_token_id=VOCAB_SIZE + 5, pad_token_id=PAD_ID, temperature=0.8)
    split = StaticDecoder(model, gate_up_splits=gate_up_splits, down_splits=down_splits)
    assert (split.gate_up_splits, split.down_splits) == (gate_up_splits, down_splits)
    out = split.generate(ids, mask, 16, greedy=True, **settings)
    assert torch.equal(out.completion_ids, expected)
    sampled = split.generate(ids, mask, 16, generator=torch.Generator().manual_seed(3), **settings)
    whole = StaticDecoder(model).generate(ids, mask, 16, generator=torch.Generator().manual_seed(3), **settings)
    assert torch.equal(sampled.completion_ids, whole.completion_ids)
    torch.testing.assert_close(sampled.sampled_logprobs, whole.sampled_logprobs, atol=5e-5, rtol=0)


def test_the_first_layers_zeros_are_contiguous_for_every_batch_size() -> None:
    """Compiled halves are specialised on strides: the first layer's input must be laid out as
    the later layers' (contiguous), whatever the live batch, or each batch compiles twice."""
    from flowrl.backends.static_decode import _Buffers

    for splits in (1, 4):
        buffers = _Buffers(40, 16, 8, 2, 2, 16, 64, VOCAB_SIZE, torch.float32, torch.device("cpu"), splits)
        for batch in (40, 32, 16, 8):
            zeros = buffers.first_pending(batch)
            assert zeros.is_contiguous() and not zeros.any()
            assert zeros.shape == ((splits, batch, 64) if splits > 1 else (batch, 64))


def test_splits_that_do_not_divide_the_inner_dimension_are_refused() -> None:
    with pytest.raises(ValueError, match="inner dimension of 128 cannot be cut into 3"):
        StaticDecoder(build("llama"), down_splits=3)
    assert StaticDecoder(build("llama")).down_splits == 1  # no graphs (a CPU): whole products
    # with graphs: the default parts, else the largest half of it that divides the dimension
    assert [_splits(None, inner, 4, graphs=True) for inner in (4864, 8960, 6, 7)] == [4, 4, 2, 1]
    assert _splits(None, 4864, 4, graphs=False) == 1


@pytest.mark.parametrize("down_splits", [1, 4])
def test_rows_that_stop_early_match_generate_and_are_compacted(down_splits: int) -> None:
    """40 rows, eos frequent: rows stop at many different steps and the live batch shrinks
    (with the down projection whole and in four partial sums)."""
    model = build("llama")
    ids, mask = left_padded([1 + (row * 7) % 9 for row in range(40)], seed=2)
    eos = frequent_token(model, ids, mask)
    expected = hf_greedy(model, ids, mask, 48, eos=eos)
    decoder = StaticDecoder(model, down_splits=down_splits)
    shrunk: list[int] = []
    original = decoder._compact
    decoder._compact = lambda *args: shrunk.append(args[1]) or original(*args)  # type: ignore[method-assign]
    out = decoder.generate(ids, mask, 48, eos_token_id=eos, pad_token_id=PAD_ID, greedy=True)
    # generate() pads finished rows; its length is the step where the last row stopped.
    assert out.completion_ids.shape == expected.shape
    assert torch.equal(out.completion_ids, expected)
    lengths = out.completion_mask.sum(dim=1)
    stops = (expected == eos).long().argmax(dim=1) + 1
    assert torch.equal(lengths[(expected == eos).any(dim=1)], stops[(expected == eos).any(dim=1)])
    assert shrunk, "the batch was never compacted although most rows finished"


def test_rows_stop_at_any_of_several_eos_ids_as_generate_does() -> None:
    """An instruct model stops at its end-of-turn token and at its end-of-text one: the
    static decoder and the plain loop stop where generate() with the list of both stops."""
    model = build("llama")
    ids, mask = left_padded([1 + (row * 5) % 7 for row in range(12)], seed=4)
    free_run = hf_greedy(model, ids, mask, 20, eos=VOCAB_SIZE + 5)
    counts = torch.bincount(free_run.flatten(), minlength=VOCAB_SIZE)
    first, second = (int(token) for token in counts.argsort(descending=True)[:2])
    expected = hf_greedy(model, ids, mask, 20, eos=[first, second])  # type: ignore[arg-type]
    assert (expected == first).any() and (expected == second).any(), "the test needs rows stopping at each"
    loop = generate_tokens(model, ids, mask, 20, eos_token_id=[first, second], pad_token_id=PAD_ID, greedy=True)
    static = StaticDecoder(model).generate(ids, mask, 20, eos_token_id=(first, second), pad_token_id=PAD_ID,
                                           greedy=True)
    for out in (loop, static):
        assert torch.equal(out.completion_ids, expected)
        stopped = torch.isin(expected, torch.tensor([first, second]))
        lengths = torch.where(stopped.any(dim=1), stopped.long().argmax(dim=1) + 1, expected.shape[1])
        assert torch.equal(out.completion_mask.sum(dim=1), lengths)


def test_sampled_tokens_and_logprobs_match_the_plain_loop() -> None:
    """Same generator, same noise draws: the same tokens and the same log-probabilities."""
    model = build("qwen2")
    ids, mask = left_padded([4, 6, 2, 5], seed=3)
    settings = dict(eos_token_id=VOCAB_SIZE + 5, pad_token_id=PAD_ID, temperature=0.7, top_k=10, top_p=0.9)
    engine = StaticDecoder(model).generate(ids, mask, 20, generator=torch.Generator().manual_seed(5), **settings)
    plain = generate_tokens(model, ids, mask, 20, generator=torch.Generator().manual_seed(5), **settings)
    assert torch.equal(engine.completion_ids, plain.completion_ids)
    # fp32 sums in another order (a static cache against a growing one): last bits differ,
    # by up to 1.9e-5 on one machine's CPU
    torch.testing.assert_close(engine.sampled_logprobs, plain.sampled_logprobs, atol=5e-5, rtol=0)


def test_logprobs_are_those_of_a_full_forward() -> None:
    """The sampled log-probabilities equal log_softmax(logits / T) of one forward over the result."""
    model = build("llama")
    ids, mask = left_padded([3, 5], seed=4)
    out = StaticDecoder(model).generate(ids, mask, 10, eos_token_id=VOCAB_SIZE + 5, pad_token_id=PAD_ID,
                                        temperature=1.3, generator=torch.Generator().manual_seed(0))
    full_ids = torch.cat([ids, out.completion_ids], dim=1)
    full_mask = torch.cat([mask, out.completion_mask], dim=1)
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=full_ids, attention_mask=full_mask, position_ids=positions).logits
    logprobs = torch.log_softmax(logits[:, ids.shape[1] - 1:-1].float() / 1.3, dim=-1)
    expected = logprobs.gather(-1, out.completion_ids[..., None]).squeeze(-1)
    torch.testing.assert_close(out.sampled_logprobs, expected, atol=1e-4, rtol=0)


def test_an_optimizer_step_is_seen_by_the_next_generation() -> None:
    """The engine reads the module's parameters in place: no stale copy after training."""
    model = build("llama")
    decoder = decoder_for(model)
    assert decoder is not None and decoder_for(model) is decoder
    ids, mask = left_padded([4, 4], seed=5)
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)
    out = decoder.generate(ids, mask, 8, eos_token_id=VOCAB_SIZE + 5, pad_token_id=PAD_ID, greedy=True)
    assert torch.equal(out.completion_ids, hf_greedy(model, ids, mask, 8, eos=VOCAB_SIZE + 5))


def test_unsupported_models_are_named() -> None:
    model = build("llama")
    model.config.hidden_act = "gelu"
    assert "gelu" in (unsupported_reason(model) or "")
    assert decoder_for(model) is None
    assert unsupported_reason(torch.nn.Linear(2, 2)) is not None
    # Llama's attention_bias also puts a bias on o_proj, which the decode step has no term for
    biased = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, intermediate_size=64, attention_bias=True))
    assert biased.model.layers[0].self_attn.o_proj.bias is not None
    assert "biases" in (unsupported_reason(biased) or "")
    assert decoder_for(biased) is None  # engine: auto decodes it with the plain loop


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("splits", [(1, 1), (2, 4)])
@pytest.mark.parametrize("compile_layers", [False, True])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_matches_generate_on_gpu(kind: str, compile_layers: bool, splits: tuple[int, int]) -> None:
    """On CUDA the decode step replays a captured graph; fp32 so argmax ties cannot flip.
    ``splits``: the gate/up and down products whole, and cut along their inner dimension."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build(kind, "cuda")
    ids, mask = left_padded([1 + (row * 5) % 8 for row in range(40)], seed=6, device="cuda")
    eos = frequent_token(model, ids, mask)
    decoder = StaticDecoder(model, compile_layers=compile_layers, gate_up_splits=splits[0], down_splits=splits[1])
    assert decoder.use_graphs
    expected = hf_greedy(model, ids, mask, 40, eos=eos)
    for _ in range(2):  # the second call replays graphs captured by the first
        out = decoder.generate(ids, mask, 40, eos_token_id=eos, pad_token_id=PAD_ID, greedy=True)
        differ = (out.completion_ids != expected).any(dim=1) if out.completion_ids.shape == expected.shape else None
        assert torch.equal(out.completion_ids, expected), (
            f"shapes {tuple(out.completion_ids.shape)} vs {tuple(expected.shape)}; rows that differ: "
            f"{None if differ is None else differ.nonzero().flatten().tolist()}")
    sampled = decoder.generate(ids, mask, 40, eos_token_id=VOCAB_SIZE + 5, pad_token_id=PAD_ID,
                               generator=torch.Generator(device="cuda").manual_seed(0))
    again = decoder.generate(ids, mask, 40, eos_token_id=VOCAB_SIZE + 5, pad_token_id=PAD_ID,
                             generator=torch.Generator(device="cuda").manual_seed(0))
    assert torch.equal(sampled.completion_ids, again.completion_ids)


def test_batches_of_other_prompt_widths_reuse_the_cache() -> None:
    """With fixed shapes (captured graphs: on a GPU), prompt widths are rounded up (and never
    shrink the cache), so batches whose longest prompt differs reuse one set of buffers and
    the captured graphs."""
    model = build("llama")
    decoder = StaticDecoder(model, fixed_shapes=True)
    shapes, buffers = [], []
    for lengths, seed in (([5, 2, 7], 1), ([3, 3, 1], 2), ([9, 4, 6], 3)):
        ids, mask = left_padded(lengths, seed=seed)
        out = decoder.generate(ids, mask, 10, eos_token_id=VOCAB_SIZE + 5, pad_token_id=PAD_ID, greedy=True)
        assert torch.equal(out.completion_ids, hf_greedy(model, ids, mask, 10, eos=VOCAB_SIZE + 5))
        shapes.append(decoder._shape)
        buffers.append(decoder._buffers)
    assert shapes == [(3, 42, 10)] * 3  # 32 prompt columns (widths 7, 3, 9 rounded up) + 10 new
    assert buffers[0] is buffers[1] is buffers[2]


def test_without_graphs_prompts_keep_their_width_and_steps_attend_over_the_columns_written() -> None:
    model = build("llama")
    decoder = StaticDecoder(model)  # on CPU: no graphs, so no fixed shapes
    assert not decoder.fixed_shapes
    windows: list[int] = []
    step = decoder._decode_step

    def recorded(batch: int, window: int, *args: object) -> None:
        windows.append(window)
        step(batch, window, *args)  # type: ignore[arg-type]

    decoder._decode_step = recorded  # type: ignore[method-assign]
    for lengths, seed in (([5, 2, 7], 1), ([3, 3, 1], 2)):
        ids, mask = left_padded(lengths, seed=seed)
        out = decoder.generate(ids, mask, 10, eos_token_id=VOCAB_SIZE + 5, pad_token_id=PAD_ID, greedy=True)
        assert torch.equal(out.completion_ids, hf_greedy(model, ids, mask, 10, eos=VOCAB_SIZE + 5))
        width = max(lengths)
        assert decoder._shape == (3, width + 10, 10)  # the prompts' own width, nothing rounded up
        # the prefill wrote columns 0..width-1 and sampled the first token; decode step t
        # (t = 1..9) writes column width + t - 1 and attends over columns 0..width + t - 1
        assert windows == [width + t for t in range(1, 10)]
        windows.clear()


def test_a_prompt_repeated_in_consecutive_rows_is_prefilled_once() -> None:
    model = build("qwen2")
    decoder = StaticDecoder(model)
    prefilled: list[int] = []
    rows_of = decoder._prefill_rows

    def recorded(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        prefilled.append(ids.shape[0])
        return rows_of(ids, mask)

    decoder._prefill_rows = recorded  # type: ignore[method-assign]
    ids, mask = left_padded([4, 6, 3], seed=7)
    grouped_ids, grouped_mask = ids.repeat_interleave(3, dim=0), mask.repeat_interleave(3, dim=0)
    out = decoder.generate(grouped_ids, grouped_mask, 8, eos_token_id=VOCAB_SIZE + 5, pad_token_id=PAD_ID, greedy=True)
    assert prefilled == [3]  # 9 rows, 3 prompts
    assert torch.equal(out.completion_ids, hf_greedy(model, grouped_ids, grouped_mask, 8, eos=VOCAB_SIZE + 5))
    # sampled: every row its own draw, the same as the plain loop's from the same noise
    settings = dict(eos_token_id=VOCAB_SIZE + 5, pad_token_id=PAD_ID)
    sampled = decoder.generate(grouped_ids, grouped_mask, 8, generator=torch.Generator().manual_seed(2), **settings)
    plain = generate_tokens(model, grouped_ids, grouped_mask, 8, generator=torch.Generator().manual_seed(2), **settings)
    assert torch.equal(sampled.completion_ids, plain.completion_ids)
    torch.testing.assert_close(sampled.sampled_logprobs, plain.sampled_logprobs, atol=1e-5, rtol=0)
    # distinct prompts run as they are
    prefilled.clear()
    decoder.generate(ids, mask, 4, greedy=True, **settings)
    assert prefilled == [3]
