"""A decode step's attention (rotary, cache write, attention over the window) against the
same arithmetic written out by hand, on CPU (plain path) and on a GPU (the Triton kernel)."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.backends import decode_attention as attention
from tests.backends.conftest import run_interpreted

KV_HEADS, GROUP, HEAD_DIM = 2, 7, 64
SCALING = HEAD_DIM ** -0.5


def rotated(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotary by hand: pairs (i, i + half) turned by each row's angle i (fp64)."""
    half = x.shape[-1] // 2
    first, second = x[..., :half].double(), x[..., half:].double()
    cos, sin = angles.cos().double(), angles.sin().double()
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def step_inputs(device: str, dtype: torch.dtype, window: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A step's inputs: the cache window is a view [:batch, :, :window] into a larger cache
    (as the decode step slices its buffers); rows have left padding of different widths, one
    row attends only to the new column, one has unwritten columns after the new one."""
    generator = torch.Generator().manual_seed(seed)
    batch, columns = 5, window + 40

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    column = window - 7
    angles = torch.rand(batch, HEAD_DIM // 2, generator=generator) * 2 * math.pi
    valid = torch.zeros(batch, window, dtype=torch.bool)
    valid[:, :column + 1] = True
    valid[0, :window // 2] = False
    valid[1, :3] = False
    valid[2, :column] = False  # only the new column
    keys, values = draw(batch + 2, KV_HEADS, columns, HEAD_DIM), draw(batch + 2, KV_HEADS, columns, HEAD_DIM)
    # Columns a row does not attend to hold large values (stale keys and values of earlier
    # rows), and some of them inf or NaN (a stale overflow): they must add nothing.
    stale = torch.zeros(batch + 2, 1, columns, 1, dtype=torch.bool)
    stale[:batch, 0, :window, 0] = ~valid
    keys = torch.where(stale.to(device), keys * 1000, keys)
    values = torch.where(stale.to(device), values * 1000, values)
    keys[3, :, column + 3] = float("inf")  # after the new column, unwritten by this generation
    values[3, :, column + 2] = float("nan")
    values[0, :, 1] = float("inf")  # in row 0's left padding
    return {
        "qkv": draw(batch, (KV_HEADS * GROUP + 2 * KV_HEADS) * HEAD_DIM),
        "angles": angles,
        "cos": torch.cat((angles, angles), -1).cos().to(device=device, dtype=dtype),
        "sin": torch.cat((angles, angles), -1).sin().to(device=device, dtype=dtype),
        "keys": keys,
        "values": values,
        "column": torch.tensor([column], device=device),
        "valid": valid.to(device),
    }


def by_hand(inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expected output, new key and new value (fp64) for every row."""
    qkv, angles, valid = inputs["qkv"].cpu().double(), inputs["angles"], inputs["valid"].cpu()
    keys, values = inputs["keys"].cpu().double(), inputs["values"].cpu().double()
    column = int(inputs["column"])
    batch = qkv.shape[0]
    heads = KV_HEADS * GROUP
    q = qkv[:, :heads * HEAD_DIM].reshape(batch, heads, HEAD_DIM)
    new_keys = rotated(qkv[:, heads * HEAD_DIM:(heads + KV_HEADS) * HEAD_DIM].reshape(batch, KV_HEADS, HEAD_DIM),
                       angles[:, None])
    new_values = qkv[:, (heads + KV_HEADS) * HEAD_DIM:].reshape(batch, KV_HEADS, HEAD_DIM)
    out = torch.zeros(batch, KV_HEADS, GROUP, HEAD_DIM, dtype=torch.float64)
    for row in range(batch):
        columns = valid[row].nonzero().flatten()
        for head in range(KV_HEADS):
            k = keys[row, head, :valid.shape[1]].clone()
            v = values[row, head, :valid.shape[1]].clone()
            k[column], v[column] = new_keys[row, head], new_values[row, head]
            for member in range(GROUP):
                query = rotated(q[row, head * GROUP + member], angles[row])
                weights = torch.softmax(k[columns] @ query * SCALING, dim=0)
                out[row, head, member] = weights @ v[columns]
    return out, new_keys, new_values


def run(inputs: dict[str, torch.Tensor], window: int) -> torch.Tensor:
    batch = inputs["qkv"].shape[0]
    return attention.decode_attention(
        inputs["qkv"], inputs["cos"], inputs["sin"], inputs["keys"][:batch, :, :window],
        inputs["values"][:batch, :, :window], inputs["column"], inputs["valid"], SCALING)


def check(inputs: dict[str, torch.Tensor], window: int, tolerance: float) -> None:
    expected, new_keys, new_values = by_hand(inputs)
    out = run(inputs, window)
    assert out.shape == (5, KV_HEADS, GROUP, HEAD_DIM)
    assert torch.allclose(out.cpu().double(), expected, atol=tolerance), (out.cpu().double() - expected).abs().max()
    column = int(inputs["column"])
    written_keys = inputs["keys"][:5, :, column].cpu().double()
    assert torch.allclose(written_keys, new_keys, atol=tolerance)
    assert torch.equal(inputs["values"][:5, :, column].cpu().double(), new_values)


def test_plain_path_matches_the_arithmetic_by_hand() -> None:
    inputs = step_inputs("cpu", torch.float32, window=70)
    untouched = inputs["keys"].clone()
    check(inputs, 70, tolerance=1e-5)
    # Only the new column changed in the cache.
    changed = (inputs["keys"] != untouched).any(dim=-1).nonzero()[:, 2].unique().tolist()
    assert changed == [int(inputs["column"])]


def test_a_window_written_whole_in_this_generation_is_attended_without_masked_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Columns not attended to hold large but finite keys and values (a CPU's window ends at
    # the last column written, so none is stale): the bias alone leaves them out, and no
    # masked copy of the window is made
    inputs = step_inputs("cpu", torch.float32, window=70)
    for name in ("keys", "values"):
        inputs[name] = torch.nan_to_num(inputs[name], nan=5e3, posinf=5e3)
    copies: list[int] = []
    masked_fill = torch.Tensor.masked_fill

    def counted(self: torch.Tensor, *args: object) -> torch.Tensor:
        copies.append(1)
        return masked_fill(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.Tensor, "masked_fill", counted)
    expected, _, _ = by_hand(inputs)
    batch = inputs["qkv"].shape[0]
    out = attention.decode_attention(
        inputs["qkv"], inputs["cos"], inputs["sin"], inputs["keys"][:batch, :, :70],
        inputs["values"][:batch, :, :70], inputs["column"], inputs["valid"], SCALING, all_written=True)
    assert copies == []
    assert torch.allclose(out.double(), expected, atol=1e-5)
    masked = run(inputs, 70)  # the same step with the masked copies
    assert len(copies) == 2
    torch.testing.assert_close(out, masked, atol=1e-6, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("window", [64, 150, 320])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_matches_the_arithmetic_by_hand(window: int, dtype: torch.dtype) -> None:
    inputs = step_inputs("cuda", dtype, window)
    assert attention.triton_usable(inputs["qkv"], HEAD_DIM)
    untouched = inputs["keys"].clone()
    # bf16: inputs, the rotated query and key and the softmax weights are rounded to bf16.
    check(inputs, window, tolerance=1e-5 if dtype == torch.float32 else 3e-2)
    changed = (inputs["keys"] != untouched).any(dim=-1).nonzero()[:, 2].unique().tolist()
    assert changed == [int(inputs["column"])]


INTERPRETED = """
import sys
import torch
sys.path.insert(0, {root!r})
from flowrl.backends import decode_attention as attention
from tests.backends import test_decode_attention as case
# as many shares of 64 columns as the window has, then one share; last, shares of 128 columns
# whose last one ends in a block past the window (every column of it masked)
for least, window in [(64, 20), (64, 64), (64, 150), (64, 320), (128, 260)]:
    attention.MIN_SHARE_COLUMNS = least
    for fill in (10 ** 6, 0):
        attention.CUT_BELOW = attention.FILL_PER_PROCESSOR = fill
        inputs = case.step_inputs("cpu", torch.float32, window)
        untouched = inputs["keys"].clone()
        expected, new_keys, _ = case.by_hand(inputs)
        batch = inputs["qkv"].shape[0]
        try:
            out = attention._triton_attention(
                inputs["qkv"], inputs["cos"], inputs["sin"], inputs["keys"][:batch, :, :window],
                inputs["values"][:batch, :, :window], inputs["column"], inputs["valid"], case.SCALING)
        except Exception as error:
            if "only 0-dimensional arrays" not in str(error):
                raise
            print("UNSUPPORTED", repr(error)[:300])
            sys.exit(0)
        column = int(inputs["column"])
        assert (out.double() - expected).abs().max() < 1e-5, (window, fill)
        assert (inputs["keys"][:batch, :, column].double() - new_keys).abs().max() < 1e-5
        changed = (inputs["keys"] != untouched).any(dim=-1).nonzero()[:, 2].unique().tolist()
        assert changed == [column], changed
        print(window, attention.window_shares(window, case.KV_HEADS * batch, 1))
"""


def test_triton_kernel_in_the_interpreter_matches_by_hand_in_one_share_and_in_several() -> None:
    """The Triton kernels run on CPU tensors under Triton's interpreter (fp32: its bf16 is not
    faithful), the window in one share and cut into shares of 64 columns."""
    assert run_interpreted(INTERPRETED)[:10] == [
        "20 (1, 64)", "20 (1, 64)", "64 (1, 64)", "64 (1, 64)",
        "150 (3, 64)", "150 (1, 192)", "320 (5, 64)", "320 (1, 320)", "260 (3, 128)", "260 (1, 320)"]


def test_window_shares_cover_the_window_in_whole_blocks() -> None:
    for window in (1, 63, 64, 65, 150, 320, 1000, 1024, 5000):
        for programs in (1, 64, 512):
            shares, per_share = attention.window_shares(window, programs, 132)
            assert per_share % attention.BLOCK_COLUMNS == 0
            assert shares <= attention.MAX_SPLITS
            assert (shares - 1) * per_share < window <= shares * per_share
    # one program: as many shares of at least 128 columns as the window holds, at most 16
    assert attention.window_shares(320, 1, 132) == (3, 128)
    assert attention.window_shares(5000, 1, 132) == (16, 320)


def test_windows_are_cut_only_when_the_card_has_fewer_programs_than_half_its_processors() -> None:
    # 132 processors: batches of 256, 128 and 64 rows (x 2 KV heads) have 512, 256 and 128
    # programs, enough; uncut
    for programs in (512, 256, 128):
        assert attention.window_shares(288, programs, 132) == (1, 320)
    # 64 programs (a batch of 32) are too few: shares to give 2 programs per processor (5),
    # but none under 128 columns (3)
    assert attention.window_shares(288, 64, 132) == (3, 128)
    # 5 wanted over 1000 columns: 200 each, rounded up to whole blocks of 64, so 4 of 256
    assert attention.window_shares(1000, 64, 132) == (4, 256)
    assert attention.window_shares(200, 8, 132) == (2, 128)
    assert attention.window_shares(100, 8, 132) == (1, 128)
