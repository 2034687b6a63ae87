"""The Triton products of a decode step (``decode_products``) against the arithmetic by hand:
under Triton's interpreter on a CPU, and in the static decoder on a GPU."""

from __future__ import annotations

import pytest
import torch

from flowrl.backends import decode_products as products
from flowrl.backends.decode_products import Launch
from tests.backends.conftest import run_interpreted

INTERPRETED = """
import sys
import torch
import torch.nn.functional as F
sys.path.insert(0, {root!r})
from flowrl.backends.decode_products import Launch, triton_product

generator = torch.Generator().manual_seed(0)
def normal(*shape):
    return torch.randn(*shape, generator=generator)

# rows and outputs that are not whole blocks (masked), biases, slices of the inner dimension
for rows, inner, outputs, launch, biased in [
    (40, 64, 80, Launch(32, 32, 32), True),
    (40, 64, 80, Launch(16, 64, 16, splits=2), True),
    (7, 128, 48, Launch(16, 16, 32, splits=4), False),
    (64, 96, 32, Launch(64, 32, 32, splits=3), False),
]:
    x, weight = normal(rows, inner), normal(outputs, inner)
    bias = normal(outputs) if biased else None
    try:
        out = triton_product(x, weight, bias, launch)
    except Exception as error:
        if "only 0-dimensional arrays" not in str(error):
            raise
        print("UNSUPPORTED", repr(error)[:300])
        sys.exit(0)
    part = inner // launch.splits
    parts = torch.stack([x[:, s * part:(s + 1) * part] @ weight[:, s * part:(s + 1) * part].T
                         for s in range(launch.splits)])
    if bias is not None:
        parts[0] += bias
    expected = parts if launch.splits > 1 else parts[0]
    assert out.shape == expected.shape, (out.shape, expected.shape)
    assert ((out - expected).abs() / (1 + expected.abs())).max() < 1e-5, (rows, launch)
    print("product", tuple(out.shape))

# the gated product: silu(x @ gate.T) * (x @ up.T) from the stacked [gate; up] weight
x, gate_up = normal(40, 64), normal(2 * 48, 64)
out = triton_product(x, gate_up, None, Launch(32, 32, 32), gated=True)
gate, up = (x @ gate_up.T).chunk(2, dim=-1)
expected = F.silu(gate) * up
# silu(gate) * up reaches hundreds here: float32 sums of 64 products each, rounded
torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-3)
print("gated", tuple(out.shape))
"""


def test_triton_product_in_the_interpreter_matches_by_hand() -> None:
    """fp32 under Triton's interpreter (its bf16 is not faithful): whole products with and
    without biases, partial sums over 2, 3 and 4 slices of the inner dimension (only the first
    slice adds the bias), rows and outputs that leave blocks part empty, and the gated product."""
    assert run_interpreted(INTERPRETED)[:5] == [
        "product (40, 80)", "product (2, 40, 80)", "product (4, 7, 48)", "product (3, 64, 32)", "gated (40, 48)"]


def test_a_launch_fits_when_every_slice_is_whole_blocks() -> None:
    # 0.4B: hidden 896, MLP 4,864
    assert Launch(64, 64, 64, splits=4).fits(4864)  # 1,216 = 19 x 64
    assert not Launch(64, 64, 64, splits=8).fits(4864)  # 608 = 9.5 x 64
    assert Launch(64, 64, 32, splits=8).fits(4864)
    assert not Launch(64, 64, 64, splits=4).fits(896)  # 224 = 3.5 x 64
    assert Launch(64, 64, 32, splits=4).fits(896)
    assert not Launch(64, 64, 64, splits=3).fits(896)  # 896 / 3 is not whole
    # every kind has a candidate that fits the 0.4B and 1.5B shapes (hidden 1,536, MLP 8,960)
    for hidden, mlp in ((896, 4864), (1536, 8960)):
        inner = {"qkv": hidden, "o": hidden, "gated": hidden, "down": mlp}
        for kind in products.KINDS:
            assert any(launch.fits(inner[kind]) for launch in products.CANDIDATES[kind]), (kind, hidden)
    for kind in set(products.KINDS) - set(products.SLICED):  # their consumers read whole products
        assert all(launch.splits == 1 for launch in products.CANDIDATES[kind])
    assert products.most_splits() == 8


def test_a_triton_launch_is_picked_only_at_least_5_percent_faster_than_cublas() -> None:
    fast, faster = Launch(64, 64, 64), Launch(128, 64, 64)
    assert products.pick({None: 10.0, fast: 9.6, faster: 9.4}) == faster  # 94 %
    assert products.pick({None: 10.0, fast: 9.6}) is None  # 96 %: within the margin
    assert products.pick({None: 10.0, fast: 9.5}) == fast
    assert products.pick({None: 10.0}) is None


def test_a_launch_that_does_not_fit_is_refused() -> None:
    x, weight = torch.zeros(8, 96), torch.zeros(32, 96)
    with pytest.raises(ValueError, match="does not fit"):
        products.triton_product(x, weight, None, Launch(16, 16, 64))  # 96 is not whole blocks of 64
    with pytest.raises(ValueError, match="does not fit"):
        products.triton_product(x, torch.zeros(64, 96), None, Launch(16, 16, 16, splits=2), gated=True)
    with pytest.raises(ValueError, match="does not fit"):  # a bias on silu(gate) * up has no meaning here
        products.triton_product(x, torch.zeros(64, 96), torch.zeros(64), Launch(16, 16, 16), gated=True)


def test_the_decoder_refuses_launches_that_cut_a_product_read_whole() -> None:
    from tests.backends.test_static_decode import build

    from flowrl.backends.static_decode import StaticDecoder

    with pytest.raises(ValueError, match="only o and down may be cut"):
        StaticDecoder(build("llama"), launches={"qkv": Launch(16, 16, 16, splits=2)})
    with pytest.raises(ValueError, match="no launch"):
        StaticDecoder(build("llama"), launches={"mlp": Launch(16, 16, 16)})
    with pytest.raises(ValueError, match="inner dimension of 128 into whole blocks"):
        StaticDecoder(build("llama"), launches={"down": Launch(16, 16, 48)})  # MLP of 128
    # not measuring (no Triton candidates), a fixed down launch still gets room for its partial sums
    decoder = StaticDecoder(build("llama"), launches={"down": Launch(16, 16, 16, splits=8)}, use_graphs=True,
                            triton_products=False)
    decoder._ensure_buffers(4, 16, 8)
    assert decoder._buffers is not None and decoder.down_splits == 4
    assert decoder._buffers.first_pending(4, 8).shape == (8, 4, 64)


def test_off_a_gpu_cublas_is_the_choice() -> None:
    x = torch.zeros(8, 64)
    assert not products.triton_usable(x)
    assert products.choose_launch("qkv", x, [torch.zeros(32, 64)], [None], lambda x, w, b: x @ w.T) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_decoder_with_triton_products_gives_generates_greedy_tokens(kind: str) -> None:
    """Every product by the Triton kernel (slices for the output and down projections, the gated product with
    its gating), fp32 so that argmax ties cannot flip: transformers' greedy tokens, over
    captured graphs and compacted batches."""
    from tests.backends.test_static_decode import PAD_ID, build, frequent_token, hf_greedy, left_padded

    from flowrl.backends.static_decode import StaticDecoder

    torch.backends.cuda.matmul.allow_tf32 = False
    model = build(kind, "cuda")  # hidden 64, MLP 128, 4 heads of 16
    ids, mask = left_padded([1 + (row * 5) % 8 for row in range(40)], seed=6, device="cuda")
    eos = frequent_token(model, ids, mask)
    launches = {"qkv": Launch(32, 32, 32), "o": Launch(16, 32, 32, splits=2), "gated": Launch(32, 32, 32),
                "down": Launch(16, 64, 32, splits=4)}
    decoder = StaticDecoder(model, launches=launches)
    expected = hf_greedy(model, ids, mask, 40, eos=eos)
    for _ in range(2):  # the second call replays graphs captured by the first
        out = decoder.generate(ids, mask, 40, eos_token_id=eos, pad_token_id=PAD_ID, greedy=True)
        assert torch.equal(out.completion_ids, expected)
    assert decoder._launches[40] == launches


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_choice_on_a_gpu_is_cublas_or_a_launch_that_fits_and_is_kept() -> None:
    torch.manual_seed(0)
    x = torch.randn(256, 896, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(1152, 896, device="cuda", dtype=torch.bfloat16) / 30 for _ in range(4)]
    biases: list[torch.Tensor | None] = [torch.randn(1152, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    chosen = products.choose_launch("qkv", x, weights, biases, lambda x, w, b: torch.nn.functional.linear(x, w, b))
    assert chosen is None or (chosen in products.CANDIDATES["qkv"] and chosen.fits(896))
    if chosen is not None:
        out = products.triton_product(x, weights[0], biases[0], chosen)
        whole = out.float().sum(0) if out.dim() == 3 else out.float()
        expected = x.float() @ weights[0].float().T + biases[0].float()
        assert (whole - expected).abs().max() < 0.1
    # made once per process: the same answer without measuring again
    assert products.choose_launch("qkv", x, weights, biases, lambda x, w, b: x) == chosen


def test_a_measurement_that_fails_leaves_every_product_to_cublas(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.backends.test_static_decode import build

    from flowrl.backends import static_decode

    def failing(*args: object) -> None:
        raise RuntimeError("the card went away")

    decoder = static_decode.StaticDecoder(build("qwen2"), use_graphs=True)
    assert decoder.triton_products
    monkeypatch.setattr(static_decode, "choose_launch", failing)
    with pytest.warns(UserWarning, match="at 4 rows failed .*the card went away.*they run by cuBLAS"):
        decoder._choose_launches(4, None)
    assert decoder._launches[4] == dict.fromkeys(products.KINDS)
