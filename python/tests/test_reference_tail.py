"""The eager tail the fused kernels are compared with, on the CPU: each stage on hand-computed
rows (the same rows as the C++ reference's tests), the block indices of THD rows, the unfused
chain rounding between stages, and autograd through every stage (gradcheck in fp64)."""

from __future__ import annotations

import math

import pytest
import torch

from csa.reference import block_index, tail_eager, tail_unfused


def tables(blocks: int, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    b = torch.arange(blocks, dtype=torch.float64)[:, None] + 1
    i = torch.arange(rope_dim // 2, dtype=torch.float64)[None, :] + 1
    angle = 0.3 * b * i
    return angle.cos().float(), angle.sin().float()


def test_norm_scales_each_row_by_its_rms_and_the_weight() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [-2.0, 0.0, 0.0, 2.0]])
    w = torch.tensor([1.0, 0.5, 2.0, -1.0])
    y = tail_eager(x, torch.zeros(2, dtype=torch.long), norm_weight=w, eps=1e-6)
    r0 = 1 / math.sqrt(30 / 4 + 1e-6)
    r1 = 1 / math.sqrt(8 / 4 + 1e-6)
    want = torch.tensor([[r0, r0, 6 * r0, -4 * r0], [-2 * r1, 0.0, 0.0, -2 * r1]])
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_rotates_pairs_of_the_last_columns_at_each_rows_block(interleaved: bool) -> None:
    x = torch.tensor([[5.0, 1.0, 2.0, 3.0, 4.0, 6.0]]).repeat(3, 1)
    cos, sin = tables(3, 4)
    block = torch.arange(3)
    y = tail_eager(x, block, rope_cos=cos, rope_sin=sin, rope_dim=4,
                   rope_interleaved=interleaved)
    pairs = [(2, 3), (4, 5)] if interleaved else [(2, 4), (3, 5)]
    want = x.clone().double()
    for b in range(3):
        for i, (a, c) in enumerate(pairs):
            cs, sn = float(cos[b, i]), float(sin[b, i])
            u, v = float(x[b, a]), float(x[b, c])
            want[b, a] = u * cs - v * sn
            want[b, c] = u * sn + v * cs
    torch.testing.assert_close(y.double(), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(y[:, :2], x[:, :2])  # the first columns untouched


def test_hadamard_is_the_scaled_sylvester_transform_and_its_own_inverse() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    y = tail_eager(x, torch.zeros(1, dtype=torch.long), hadamard=True)
    torch.testing.assert_close(y, torch.tensor([[5.0, -1.0, -2.0, 0.0]]))
    z = torch.randn(3, 16, generator=torch.Generator().manual_seed(3))
    twice = tail_eager(tail_eager(z, torch.zeros(3, dtype=torch.long), hadamard=True),
                       torch.zeros(3, dtype=torch.long), hadamard=True)
    torch.testing.assert_close(twice, z, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="power of two"):
        tail_eager(torch.ones(1, 6), torch.zeros(1, dtype=torch.long), hadamard=True)


def test_block_index_counts_rows_within_segments_and_padding_rows_are_block_zero() -> None:
    cuc = torch.tensor([0, 4, 7], dtype=torch.int32)
    assert block_index(cuc, 9).tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 0]


def test_the_unfused_chain_rounds_between_stages() -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 64, generator=g)
    w = torch.rand(64, generator=g) + 0.5
    cos, sin = tables(8, 16)
    kw = dict(norm_weight=w, rope_cos=cos, rope_sin=sin, rope_dim=16)
    block = torch.arange(8)
    fused = tail_eager(x, block, out_dtype=torch.bfloat16, **kw)
    unfused = tail_unfused(x.to(torch.bfloat16), block, **kw)
    exact = tail_eager(x.double(), block, out_dtype=torch.float64, **kw)
    assert unfused.dtype == torch.bfloat16
    # One rounding is at least as close to the exact chain as four.
    err_fused = (fused.double() - exact).abs().max()
    err_unfused = (unfused.double() - exact).abs().max()
    assert err_fused <= err_unfused
    assert not torch.equal(fused, unfused)


def test_autograd_flows_through_every_stage() -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = (torch.rand(8, dtype=torch.float64, generator=g) + 0.5).requires_grad_()
    cos, sin = tables(3, 4)

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return tail_eager(x, torch.arange(3), norm_weight=w, eps=1e-3, rope_cos=cos.double(),
                          rope_sin=sin.double(), rope_dim=4, hadamard=True)

    # fp64 rows are computed in fp64, so gradcheck's finite differences hold.
    assert f(x, w).dtype == torch.float64
    assert torch.autograd.gradcheck(f, (x, w))
