"""Decode attention (one query per row over a static KV cache) against a softmax written out."""

from __future__ import annotations

import pytest
import torch

from flowrl.backends import decode_attention as attention


def written_out(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor,
                scaling: float) -> torch.Tensor:
    """Per row and KV head: scores over the valid columns only, softmax, weighted values (fp64)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for row in range(q.shape[0]):
        columns = valid[row].nonzero().flatten()
        for head in range(q.shape[1]):
            k = keys[row, head, columns].double()
            v = values[row, head, columns].double()
            scores = q[row, head].double() @ k.T * scaling
            out[row, head] = torch.softmax(scores, dim=-1) @ v
    return out


def cache_views(device: str, dtype: torch.dtype, window: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Queries, and key/value views [:batch, :, :window] into a larger cache (as a decode step
    slices its buffers), with left padding of different widths and one row with a single key."""
    generator = torch.Generator().manual_seed(seed)
    batch, kv_heads, group, head_dim, columns = 5, 2, 7, 64, window + 40

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    keys = draw(batch + 2, kv_heads, columns, head_dim)[:batch, :, :window]
    values = draw(batch + 2, kv_heads, columns, head_dim)[:batch, :, :window]
    q = draw(batch, kv_heads, group, head_dim)
    valid = torch.ones(batch, window, dtype=torch.bool, device=device)
    valid[0, :window // 2] = False
    valid[1, :3] = False
    valid[2, :window - 1] = False  # only the newest column
    valid[3, window - 5:] = False  # columns not yet written at the end of the window
    return q, keys, values, valid


def test_fallback_matches_the_written_out_softmax() -> None:
    q, keys, values, valid = cache_views("cpu", torch.float32, window=70)
    out = attention.decode_attention(q, keys, values, valid, scaling=0.125)
    expected = written_out(q, keys, values, valid, 0.125)
    assert torch.allclose(out.double(), expected, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("window", [64, 150, 320])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_matches_the_written_out_softmax(window: int, dtype: torch.dtype) -> None:
    q, keys, values, valid = cache_views("cuda", dtype, window)
    assert attention.triton_usable(q)
    out = attention.decode_attention(q, keys, values, valid, scaling=0.125)
    expected = written_out(q.cpu(), keys.cpu(), values.cpu(), valid.cpu(), 0.125)
    # fp32: exact products; bf16: inputs and the weights fed to the second product are bf16.
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.cpu().double(), expected, atol=tolerance), (out.cpu().double() - expected).abs().max()
