"""csa.compress with the fused tail (RMSNorm, RoPE, Hadamard). CPU: the ops' schemas, shape
inference and backward on meta tensors, torch.compile tracing in one frame, every argument
check. GPU: forward and all four gradients against the eager fp32 chain (csa.reference) over
ragged packs with padding rows, the unfused chain as the bound, opcheck, inductor, CUDA-graph
replay and determinism."""

from __future__ import annotations

import pytest
import torch

import csa
from csa.reference import block_index, compress_eager, tail_eager, tail_unfused
from helpers import make_pack, ragged_lens, seed

META = "meta"


def meta_inputs(ratio: int = 4, coff: int = 2, d: int = 128, rows: int = 16):
    t = rows * ratio
    kv = torch.empty(t, coff * d, device=META, dtype=torch.bfloat16, requires_grad=True)
    score = torch.empty(t, coff * d, device=META, dtype=torch.bfloat16, requires_grad=True)
    ape = torch.empty(ratio, coff * d, device=META, requires_grad=True)
    cu = torch.empty(2, dtype=torch.int32, device=META)
    cuc = torch.empty(2, dtype=torch.int32, device=META)
    w = torch.empty(d, device=META, requires_grad=True)
    cos = torch.empty(rows, 32, device=META)
    sin = torch.empty(rows, 32, device=META)
    return kv, score, ape, cu, cuc, w, cos, sin


def test_tail_ops_are_registered_with_their_schemas() -> None:
    fwd = str(torch.ops.csa.compress_tail_forward.default._schema)
    bwd = str(torch.ops.csa.compress_tail_backward.default._schema)
    assert "Tensor? norm_weight" in fwd and "bool hadamard" in fwd
    assert "-> (Tensor, Tensor, Tensor)" in fwd
    assert "Tensor? pooled" in bwd and "bool deterministic" in bwd
    assert "-> (Tensor, Tensor, Tensor, Tensor)" in bwd


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_meta_shapes_and_backward_reach_every_input(weight_dtype: torch.dtype) -> None:
    kv, score, ape, cu, cuc, w, cos, sin = meta_inputs()
    w = torch.empty(128, device=META, dtype=weight_dtype, requires_grad=True)
    y = csa.compress(kv, score, ape, cu, cuc, ratio=4, coff=2, total_comp=16, norm_weight=w,
                     rope_cos=cos, rope_sin=sin, hadamard=True)
    assert y.shape == (16, 128) and y.dtype == torch.bfloat16
    y.backward(torch.ones_like(y))
    assert kv.grad.shape == kv.shape and score.grad.shape == score.shape
    assert ape.grad.shape == ape.shape and ape.grad.dtype == torch.float32
    assert w.grad.shape == (128,) and w.grad.dtype == weight_dtype
    y3 = csa.compress(kv.detach().reshape(64, 1, 256), score.detach().reshape(64, 1, 256),
                      ape.detach(), cu, cuc, ratio=4, coff=2, total_comp=16,
                      norm_weight=w.detach())
    assert y3.shape == (16, 1, 128)
    fwd = torch.ops.csa.compress_tail_forward(kv, score, ape, cu, cuc, w, None, None, 4, 2, 16,
                                              1e-6, 0, True, False)
    assert fwd[1].shape == (16,) and fwd[1].dtype == torch.float32  # rstd
    assert fwd[2].shape == (0,)  # the short-window family keeps no pooled rows


def test_short_window_tail_keeps_the_pooled_rows_where_its_row_stats_backward_pays() -> None:
    kv, score, ape, cu, cuc, w, cos, sin = meta_inputs(ratio=4, coff=2, d=512, rows=16)
    args = (kv, score, ape, cu, cuc, w, None, None, 4, 2, 16, 1e-6, 0, True, False)
    fwd = torch.ops.csa.compress_tail_forward(*args)
    assert fwd[2].shape == (16, 512) and fwd[2].dtype == torch.float32  # pooled
    y = csa.compress(kv, score, ape, cu, cuc, ratio=4, coff=2, total_comp=16, norm_weight=w)
    y.backward(torch.ones_like(y))
    assert kv.grad.shape == kv.shape and w.grad.shape == (512,)
    g = torch.empty(16, 512, device=META, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="pooled must be the forward's pooled rows"):
        torch.ops.csa.compress_tail_backward(g, kv, score, ape, cu, cuc, w, None, None, None, 4,
                                             2, 1e-6, 0, True, False, False)
    # Not with the Hadamard transform, nor from 2^20 output elements on, nor at short windows.
    hadamard = args[:-1] + (True,)
    assert torch.ops.csa.compress_tail_forward(*hadamard)[2].shape == (0,)
    big = meta_inputs(ratio=4, coff=2, d=512, rows=4096)
    big_args = big[:6] + (None, None, 4, 2, 4096, 1e-6, 0, True, False)
    assert torch.ops.csa.compress_tail_forward(*big_args)[2].shape == (0,)
    short = meta_inputs(ratio=2, coff=2, d=512, rows=16)
    short_args = short[:6] + (None, None, 2, 2, 16, 1e-6, 0, True, False)
    assert torch.ops.csa.compress_tail_forward(*short_args)[2].shape == (0,)


def test_long_window_tail_keeps_the_pooled_rows_for_its_backward() -> None:
    kv, score, ape, cu, cuc, w, cos, sin = meta_inputs(ratio=32, coff=1, d=128, rows=4)
    y = csa.compress(kv, score, ape, cu, cuc, ratio=32, coff=1, total_comp=4, norm_weight=w,
                     rope_cos=cos, rope_sin=sin)
    assert y.shape == (4, 128)
    y.backward(torch.ones_like(y))
    assert kv.grad.shape == kv.shape and w.grad.shape == (128,)
    fwd = torch.ops.csa.compress_tail_forward(kv, score, ape, cu, cuc, w, None, None, 32, 1, 4,
                                              1e-6, 0, True, False)
    assert fwd[2].shape == (4, 128) and fwd[2].dtype == torch.float32  # pooled
    g = torch.empty(4, 128, device=META, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="pooled must be the forward's pooled rows"):
        torch.ops.csa.compress_tail_backward(g, kv, score, ape, cu, cuc, w, None, None, None, 32,
                                             1, 1e-6, 0, True, False, False)
    with pytest.raises(ValueError, match="pooled must be \\(4, 128\\)"):
        torch.ops.csa.compress_tail_backward(g, kv, score, ape, cu, cuc, w, None, None,
                                             torch.empty(3, 128, device=META), 32, 1, 1e-6, 0,
                                             True, False, False)


def test_compile_traces_forward_and_backward_in_one_frame() -> None:
    kv, score, ape, cu, cuc, w, cos, sin = meta_inputs()

    def loss(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor,
             w: torch.Tensor) -> torch.Tensor:
        y = csa.compress(kv, score, ape, cu, cuc, ratio=4, coff=2, total_comp=16, norm_weight=w,
                         rope_cos=cos, rope_sin=sin)
        return y.float().sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    compiled(kv, score, ape, w).backward()
    assert w.grad.shape == (128,)


@pytest.mark.parametrize("edit, error, match", [
    ({"norm_weight": torch.empty(129, device=META)}, ValueError, "norm_weight must be \\(128,\\)"),
    ({"norm_weight": torch.empty(128, device=META, dtype=torch.float16)}, TypeError,
     "norm_weight must be bfloat16 or float32"),
    ({"norm_weight": [1.0]}, TypeError, "norm_weight must be a torch.Tensor"),
    ({"eps": 0.0}, ValueError, "eps must be finite and > 0"),
    ({"eps": "x"}, TypeError, "eps must be a float"),
    ({"rope_sin": None}, ValueError, "rope_cos and rope_sin go together"),
    ({"rope_cos": torch.empty(16, 32, device=META, dtype=torch.float16)}, TypeError,
     "rope_cos must be float32"),
    ({"rope_cos": torch.empty(16, device=META)}, ValueError, "rope_cos must be"),
    ({"rope_sin": torch.empty(8, 32, device=META)}, ValueError, "rope_sin .* must match"),
    ({"rope_dim": 62}, ValueError, "rope_cos must be \\(max_blocks, 31\\)"),
    ({"rope_cos": None, "rope_sin": None, "rope_dim": 64}, ValueError, "needs rope_cos"),
    ({"rope_interleaved": 1}, TypeError, "rope_interleaved must be a bool"),
    ({"hadamard": "yes"}, TypeError, "hadamard must be a bool"),
])
def test_every_tail_argument_is_checked_naming_it(edit: dict, error: type, match: str) -> None:
    kv, score, ape, cu, cuc, w, cos, sin = meta_inputs()
    kwargs = {"norm_weight": w, "rope_cos": cos, "rope_sin": sin}
    kwargs.update(edit)
    with pytest.raises(error, match=match):
        csa.compress(kv, score, ape, cu, cuc, ratio=4, coff=2, total_comp=16, **kwargs)


def test_tails_the_kernels_do_not_serve_are_refused() -> None:
    kv, score, ape, cu, cuc, _, _, _ = meta_inputs(ratio=32, coff=1, d=96, rows=4)
    with pytest.raises(ValueError, match="the long-window family\\) needs head_dim a power of two"):
        csa.compress(kv, score, ape, cu, cuc, ratio=32, coff=1, total_comp=4,
                     norm_weight=torch.empty(96, device=META))
    kv, score, ape, cu, cuc, _, _, _ = meta_inputs(d=96)
    with pytest.raises(ValueError, match="hadamard needs a power-of-two head_dim"):
        csa.compress(kv, score, ape, cu, cuc, ratio=4, coff=2, total_comp=16, hadamard=True)
    kv, score, ape, cu, cuc, _, _, _ = meta_inputs(d=65)
    with pytest.raises(ValueError, match="power of two or a multiple of 32"):
        csa.compress(kv, score, ape, cu, cuc, ratio=4, coff=2, total_comp=16,
                     norm_weight=torch.empty(65, device=META))


# ---- GPU -------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TAILS = [
    (4, 2, 512, dict(norm=True, rope_dim=64)),
    (4, 2, 128, dict(norm=True, rope_dim=64, hadamard=True)),
    (2, 2, 128, dict(norm=True, rope_dim=64, hadamard=True)),
    (4, 1, 128, dict(norm=False, rope_dim=32, interleaved=False)),
    # the long-window family (ratio > 16)
    (128, 1, 512, dict(norm=True, rope_dim=64)),
    (32, 2, 128, dict(norm=True, rope_dim=64, hadamard=True)),
]


def tail_tensors(d: int, max_blocks: int, norm: bool, rope_dim: int, s: int):
    g = torch.Generator().manual_seed(s)
    w = (1 + 0.1 * torch.randn(d, generator=g)).cuda() if norm else None
    if not rope_dim:
        return w, None, None
    pos = torch.arange(max_blocks, dtype=torch.float64)[:, None]
    freq = 10000.0 ** (-2 * torch.arange(rope_dim // 2, dtype=torch.float64) / rope_dim)
    angle = pos * freq[None, :]
    return w, angle.cos().float().cuda(), angle.sin().float().cuda()


def rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.double() - b.double()).abs() / b.double().abs().clamp(min=1)).max())


@gpu
@pytest.mark.parametrize("ratio, coff, d, tail", TAILS)
def test_forward_and_gradients_match_the_fp32_chain(ratio: int, coff: int, d: int,
                                                    tail: dict) -> None:
    s = seed()
    lens = ragged_lens(ratio) + [1000]
    p = make_pack(ratio, coff, d, lens, seed_value=s)
    max_blocks = max(lens) // ratio + 1  # a table row for every block
    w, cos, sin = tail_tensors(d, max_blocks, tail.get("norm", False), tail.get("rope_dim", 0),
                               s)
    opts = dict(eps=1e-6, rope_cos=cos, rope_sin=sin,
                rope_interleaved=tail.get("interleaved", True),
                hadamard=tail.get("hadamard", False))
    gen = torch.Generator(device="cuda").manual_seed(s + 1)
    g = torch.randn(p.total_comp, d, generator=gen, device="cuda").to(torch.bfloat16)

    def fused():
        leaves = [t.detach().clone().requires_grad_(True) for t in (p.kv, p.score, p.ape)]
        wl = w.detach().clone().requires_grad_(True) if w is not None else None
        y = csa.compress(*leaves, p.cu_seqlens, p.cu_seqlens_comp, ratio=ratio, coff=coff,
                         total_comp=p.total_comp, norm_weight=wl, **opts)
        y.backward(g)
        return y.detach(), *(t.grad for t in leaves), (wl.grad if wl is not None else None)

    def eager(dtype: torch.dtype):
        # fp32: the chain reference; fp64: the oracle (ape and the weight in fp64 too).
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        leaves = [t.detach().clone().to(dtype if i < 2 else wide).requires_grad_(True)
                  for i, t in enumerate((p.kv, p.score, p.ape))]
        wl = w.detach().clone().to(wide).requires_grad_(True) if w is not None else None
        x = compress_eager(*leaves, p.cu_seqlens, p.cu_seqlens_comp, ratio=ratio, coff=coff,
                           total_comp=p.total_comp)
        blk = block_index(p.cu_seqlens_comp, p.total_comp)
        y = tail_eager(x, blk, norm_weight=wl, rope_dim=tail.get("rope_dim", 0), **opts)
        masked = g.to(y.dtype).clone()
        masked[p.rows:] = 0
        y.backward(masked)
        return y.detach(), *(t.grad for t in leaves), (wl.grad if wl is not None else None)

    got = fused()
    ref = eager(torch.float32)  # fp32 inputs: the unrounded pooled row, fp32 chain
    oracle = eager(torch.float64)
    names = ["y", "grad_kv", "grad_score", "grad_ape", "grad_w"]
    for name, a, b, o in zip(names, got, ref, oracle):
        if a is None:
            continue
        assert torch.isfinite(a.float()).all(), f"{name}: non-finite ({p.describe()})"
        assert rel_max(a, o) <= 1.5 * rel_max(b.to(a.dtype), o) + 2e-2, \
            f"{name}: further from fp64 than the fp32 chain ({p.describe()})"
    # The unfused chain a trainer runs today: y no closer to fp64 than the fused one.
    pooled = compress_eager(p.kv, p.score, p.ape, p.cu_seqlens, p.cu_seqlens_comp, ratio=ratio,
                            coff=coff, total_comp=p.total_comp)
    blk = block_index(p.cu_seqlens_comp, p.total_comp)
    unfused = tail_unfused(pooled, blk, norm_weight=w, rope_dim=tail.get("rope_dim", 0), **opts)
    err = lambda a: float(((a.double() - oracle[0]) ** 2).sum())  # noqa: E731
    assert err(got[0]) <= err(unfused), p.describe()


@gpu
def test_opcheck_compile_graphs_and_determinism() -> None:
    s = seed()
    p = make_pack(4, 2, 128, [37, 64, 3, 300], seed_value=s)
    w, cos, sin = tail_tensors(128, 100, True, 64, s)
    args = (p.kv, p.score, p.ape, p.cu_seqlens, p.cu_seqlens_comp, w, cos, sin, 4, 2,
            p.total_comp, 1e-6, 64, True, True)
    for t in (p.kv, p.score, p.ape, w):
        t.requires_grad_(True)
    torch.library.opcheck(torch.ops.csa.compress_tail_forward.default, args)
    g = torch.randn(p.total_comp, 128, device="cuda").to(torch.bfloat16)
    det = (g, p.kv.detach(), p.score.detach(), p.ape.detach(), p.cu_seqlens, p.cu_seqlens_comp,
           w.detach(), cos, sin, None, 4, 2, 1e-6, 64, True, True, True)
    torch.library.opcheck(torch.ops.csa.compress_tail_backward.default, det)
    runs = [torch.ops.csa.compress_tail_backward(*det) for _ in range(3)]
    for r in runs[1:]:
        for a, b in zip(runs[0], r):
            assert torch.equal(a, b), "not bitwise run to run"

    def step(kv, score, ape, weight):
        return csa.compress(kv, score, ape, p.cu_seqlens, p.cu_seqlens_comp, ratio=4, coff=2,
                            total_comp=p.total_comp, norm_weight=weight, rope_cos=cos,
                            rope_sin=sin, hadamard=True)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    eager_y = step(p.kv, p.score, p.ape, w)
    assert torch.equal(compiled(p.kv, p.score, p.ape, w), eager_y)

    # A CUDA graph of forward and backward (both grad_ape forms) at a static capacity,
    # replayed after the lengths change, equals direct calls: bitwise in the fixed order; the
    # default one-launch form adds grad_ape and grad_w atomically (same gradients of kv and
    # score, sums in any order).
    static = [t.detach().clone() for t in (p.kv, p.score, p.ape)]
    wg = w.detach().clone()
    csa.prewarm(ratio=4, coff=2, head_dim=128)
    fwd = lambda: torch.ops.csa.compress_tail_forward(  # noqa: E731
        *static, p.cu_seqlens, p.cu_seqlens_comp, wg, cos, sin, 4, 2, p.total_comp, 1e-6, 64,
        True, True)

    def bwd(deterministic: bool) -> tuple[torch.Tensor, ...]:
        return torch.ops.csa.compress_tail_backward(
            g, *static, p.cu_seqlens, p.cu_seqlens_comp, wg, cos, sin, None, 4, 2, 1e-6, 64,
            True, True, deterministic)

    fwd(), bwd(True), bwd(False)  # warm the kernels and the allocator
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_g, _, _ = fwd()
        grads_g = bwd(True)
        atomic_g = bwd(False)
    p.cu_seqlens.copy_(torch.tensor([0, 20, 64, 67, 404], dtype=torch.int32, device="cuda"))
    p.cu_seqlens_comp.copy_(torch.tensor([0, 5, 16, 16, 100], dtype=torch.int32, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_g, fwd()[0])
    direct = bwd(True)
    for a, b in zip(grads_g, direct):
        assert torch.equal(a, b)
    for i, (a, b) in enumerate(zip(atomic_g, direct)):
        if i < 2:
            assert torch.equal(a, b), "grad_kv / grad_score differ between the grad_ape forms"
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@gpu
def test_long_window_tail_opcheck_graphs_and_determinism() -> None:
    # ratio 128: the forward's column slices meet at each row's last one; the backward reads
    # the pooled rows the forward returned.
    s = seed()
    p = make_pack(128, 1, 512, [1000, 0, 300, 2047], seed_value=s)
    w, cos, sin = tail_tensors(512, 32, True, 64, s)
    args = (p.kv, p.score, p.ape, p.cu_seqlens, p.cu_seqlens_comp, w, cos, sin, 128, 1,
            p.total_comp, 1e-6, 64, True, False)
    torch.library.opcheck(torch.ops.csa.compress_tail_forward.default, args)
    y, rstd, pooled = torch.ops.csa.compress_tail_forward(*args)
    assert pooled.shape == (p.total_comp, 512)
    g = torch.randn(p.total_comp, 512, device="cuda").to(torch.bfloat16)
    det = (g, p.kv, p.score, p.ape, p.cu_seqlens, p.cu_seqlens_comp, w, cos, sin, pooled, 128,
           1, 1e-6, 64, True, False, True)
    torch.library.opcheck(torch.ops.csa.compress_tail_backward.default, det)
    runs = [torch.ops.csa.compress_tail_backward(*det) for _ in range(3)]
    for r in runs[1:]:
        for a, b in zip(runs[0], r):
            assert torch.equal(a, b), "not bitwise run to run"
    csa.prewarm(ratio=128, coff=1, head_dim=512)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        y_g, _, pooled_g = torch.ops.csa.compress_tail_forward(*args)
        grads_g = torch.ops.csa.compress_tail_backward(*det[:9], pooled_g, *det[10:])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_g, y) and torch.equal(pooled_g, pooled)
    for a, b in zip(grads_g, runs[0]):
        assert torch.equal(a, b)
