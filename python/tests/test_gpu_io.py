"""The layout and element-type seams through the torch ops on a GPU: SBHD tensors and row-
strided views (halves of a fused projection's output) give the bits of the THD-contiguous call
on the same data, fp16 and fp32 follow the eager fp32 region, and the ops keep their opcheck,
torch.compile and autograd behaviour. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

import csa
from csa.reference import compress_eager
from helpers import seed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TYPES = [torch.bfloat16, torch.float16, torch.float32]
CONFIGS = [(4, 2, 128), (2, 2, 512), (16, 1, 65), (128, 1, 512)]


def sbhd_data(ratio: int, coff: int, d: int, seq: int, batch: int, dtype: torch.dtype,
              s: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(s)
    w = coff * d
    kv = torch.randn(seq, batch, w, generator=g).to(dtype).cuda()
    score = (1.5 * torch.randn(seq, batch, w, generator=g)).to(dtype).cuda()
    ape = (0.25 * torch.randn(ratio, w, generator=g)).cuda()
    grad = torch.randn(seq // ratio, batch, d, generator=g).to(dtype).cuda()
    return kv, score, ape, grad


def thd_of(x: torch.Tensor) -> torch.Tensor:
    """(S, B, W) as the THD pack of its B columns, segment after segment."""
    return x.transpose(0, 1).reshape(-1, x.shape[-1]).contiguous()


def offsets(seq: int, batch: int, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * seq
    return cu, torch.arange(batch + 1, dtype=torch.int32, device="cuda") * (seq // ratio)


def run(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, grad: torch.Tensor,
        *offs: torch.Tensor, ratio: int, coff: int, total_comp: int | None = None
        ) -> tuple[torch.Tensor, ...]:
    kv = kv.detach().requires_grad_()
    score = score.detach().requires_grad_()
    ape = ape.detach().requires_grad_()
    with torch.random.fork_rng(devices=[]):
        out = csa.compress(kv, score, ape, *offs, ratio=ratio, coff=coff, total_comp=total_comp)
    out.backward(grad)
    return out.detach(), kv.grad, score.grad, ape.grad


@pytest.mark.parametrize("dtype", TYPES)
@pytest.mark.parametrize("ratio,coff,d", CONFIGS)
def test_sbhd_and_strided_views_match_thd_bitwise(dtype: torch.dtype, ratio: int, coff: int,
                                                  d: int) -> None:
    s = seed()
    seq, batch = ratio * 9 + ratio - 1, 3
    kv, score, ape, grad = sbhd_data(ratio, coff, d, seq, batch, dtype, s)
    torch.use_deterministic_algorithms(True)  # fixed-order grad_ape on both sides
    try:
        out_s, gkv_s, gs_s, gape_s = run(kv, score, ape, grad, ratio=ratio, coff=coff)
        cu, cuc = offsets(seq, batch, ratio)
        rows = (seq // ratio) * batch
        out_t, gkv_t, gs_t, gape_t = run(thd_of(kv), thd_of(score), ape, thd_of(grad), cu, cuc,
                                         ratio=ratio, coff=coff, total_comp=rows)
        # The halves of one (T, 2W') tensor, as a fused wkv/wgate projection gives them (W'
        # rounds W up to 16 bytes so that the second half starts aligned).
        w = coff * d
        wp = -(-w * kv.element_size() // 16) * 16 // kv.element_size()
        pad = torch.zeros(kv.shape[0] * batch, wp - w, dtype=dtype, device="cuda")
        fused = torch.cat([thd_of(kv), pad, thd_of(score), pad], dim=-1).requires_grad_()
        kv_v, score_v = fused[:, :w], fused[:, wp:wp + w]
        out_v = csa.compress(kv_v, score_v, ape, cu, cuc, ratio=ratio, coff=coff,
                             total_comp=rows)
        out_v.backward(thd_of(grad))
    finally:
        torch.use_deterministic_algorithms(False)
    msg = f"{dtype} ratio={ratio} coff={coff} d={d} seed={s} (CSA_TEST_SEED)"
    assert out_s.shape == (seq // ratio, batch, d) and out_s.dtype == dtype, msg
    assert torch.equal(thd_of(out_s), out_t), msg
    assert torch.equal(thd_of(gkv_s), gkv_t) and torch.equal(thd_of(gs_s), gs_t), msg
    torch.testing.assert_close(gape_s, gape_t, atol=1e-3, rtol=0, msg=msg)
    assert torch.equal(out_v, out_t), msg
    assert torch.equal(fused.grad[:, :w], gkv_t), msg
    assert torch.equal(fused.grad[:, wp:wp + w], gs_t), msg


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("ratio,coff,d", [(4, 2, 128), (16, 1, 65)])
def test_fp16_and_fp32_follow_the_eager_region(dtype: torch.dtype, ratio: int, coff: int,
                                               d: int) -> None:
    s = seed()
    seq, batch = ratio * 20 + 1, 2
    kv, score, ape, grad = sbhd_data(ratio, coff, d, seq, batch, dtype, s)
    cu, cuc = offsets(seq, batch, ratio)
    rows = (seq // ratio) * batch
    got = run(thd_of(kv), thd_of(score), ape, thd_of(grad), cu, cuc, ratio=ratio, coff=coff,
              total_comp=rows)
    kv_e = thd_of(kv).requires_grad_()
    score_e = thd_of(score).requires_grad_()
    ape_e = ape.clone().requires_grad_()
    ref = compress_eager(kv_e, score_e, ape_e, cu, cuc, ratio=ratio, coff=coff, total_comp=rows,
                         serial=True)
    ref.backward(thd_of(grad))
    msg = f"{dtype} ratio={ratio} coff={coff} d={d} seed={s} (CSA_TEST_SEED)"
    # One rounding of the type apart at most (the eager region's exp is torch's, not CUDA's
    # expf); fp32 within a few ulps.
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got[0], ref.detach(), msg=msg, **tol)
    torch.testing.assert_close(got[1], kv_e.grad, msg=msg, **tol)
    torch.testing.assert_close(got[2], score_e.grad, msg=msg, **tol)
    torch.testing.assert_close(got[3], ape_e.grad, atol=1e-3, rtol=1e-3, msg=msg)


def test_opcheck_and_compile_on_sbhd_and_strided_inputs() -> None:
    kv, score, ape, grad = sbhd_data(4, 2, 64, 37, 2, torch.float16, 7)
    torch.library.opcheck(torch.ops.csa.compress_forward.default,
                          (kv, score, ape, None, None, 4, 2, 18))
    torch.library.opcheck(torch.ops.csa.compress_backward.default,
                          (grad, kv, score, ape, None, None, 4, 2, True))
    fused = torch.cat([thd_of(kv), thd_of(score)], dim=-1).float()
    cu, cuc = offsets(37, 2, 4)
    torch.library.opcheck(torch.ops.csa.compress_forward.default,
                          (fused[:, :128], fused[:, 128:], ape, cu, cuc, 4, 2, 18))

    def f(k: torch.Tensor, s: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return csa.compress(k, s, a, ratio=4, coff=2).float().square().sum()

    torch._dynamo.reset()
    explain = torch._dynamo.explain(f)(kv, score, ape)
    assert explain.graph_break_count == 0, explain.break_reasons
    compiled = torch.compile(f, fullgraph=True)
    assert torch.equal(compiled(kv, score, ape), f(kv, score, ape))
