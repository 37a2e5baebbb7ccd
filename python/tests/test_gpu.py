"""csa's torch ops on a GPU, against the eager PyTorch region with fp32 intermediates
(csa.reference): bits and contracts over ragged packs, opcheck, torch.compile, CUDA graphs,
deterministic mode, and training. Skipped without a GPU."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

import csa
from csa.reference import compress_eager
from helpers import Pack, make_pack, ragged_lens, seed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

REPO = Path(__file__).resolve().parents[2]


def poison_allocator() -> None:
    """Fills the caching allocator's free blocks with 0xFF (NaN in bf16 and fp32), so that an
    output element a kernel leaves unwritten shows up as NaN."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    blocks = [torch.empty(1 << 20, dtype=torch.uint8, device="cuda") for _ in range(64)]
    blocks.append(torch.empty(768 << 20, dtype=torch.uint8, device="cuda"))
    for b in blocks:
        b.fill_(0xFF)
    del blocks
    torch.cuda.synchronize()


def csa_pass(p: Pack, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    kv, score, ape = (t.detach().clone().requires_grad_(True) for t in (p.kv, p.score, p.ape))
    poison_allocator()
    out = csa.compress(kv, score, ape, p.cu_seqlens, p.cu_seqlens_comp, ratio=p.ratio,
                       coff=p.coff, total_comp=p.total_comp)
    out.backward(g)
    return out.detach(), kv.grad, score.grad, ape.grad


def eager_pass(p: Pack, g: torch.Tensor, serial: bool = False) -> tuple[torch.Tensor, ...]:
    kv, score, ape = (t.detach().clone().requires_grad_(True) for t in (p.kv, p.score, p.ape))
    out = compress_eager(kv, score, ape, p.cu_seqlens, p.cu_seqlens_comp, ratio=p.ratio,
                         coff=p.coff, total_comp=p.total_comp, serial=serial)
    masked = g.clone()
    masked[p.rows:] = 0  # csa ignores gradients on padding rows; downstream gives them none
    out.backward(masked)
    return out.detach(), kv.grad, score.grad, ape.grad


def grad_for(p: Pack) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(p.seed + 1)
    shape = (p.total_comp, p.head_dim)
    return torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16)


def differing(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.float() != b.float()).sum())


def beyond_one_step(a: torch.Tensor, ref: torch.Tensor) -> int:
    """Elements further from the reference than one bf16 step of its magnitude (and than the
    fp32 summation-order floor of 1e-6, for values that cancel to near zero)."""
    r = ref.float()
    step = torch.maximum(r.abs() * 2.0**-7, torch.full_like(r, 1e-6))
    return int(((a.float() - r).abs() > step).sum())


def assert_written(*tensors: torch.Tensor) -> None:
    for t in tensors:
        assert not torch.isnan(t).any(), "an element was left unwritten (NaN poison)"


SHORT = [(r, c, d) for r in (1, 2, 4, 8, 16) for c in (1, 2) for d in (65, 128, 512)]


@pytest.mark.parametrize("ratio,coff,head_dim", SHORT)
def test_short_window_matches_the_eager_region(ratio: int, coff: int, head_dim: int) -> None:
    # Enough rows for the 0.01 % rule to mean something (at least 65536 output elements).
    p = make_pack(ratio, coff, head_dim, ragged_lens(ratio) + [ratio * -(-65536 // head_dim)])
    g = grad_for(p)
    out, gkv, gs, gape = csa_pass(p, g)
    ref_out, ref_gkv, ref_gs, ref_gape = eager_pass(p, g)
    serial_out = eager_pass(p, g, serial=True)[0]
    assert_written(out, gkv, gs, gape)
    where = p.describe()
    # out: bitwise against the region summed in the contract's (serial) order; within one bf16
    # step of torch's softmax / .sum order, which rounds differently on a few elements (more
    # of them the wider the window: ~0.013 % at ratio 16, coff 2).
    assert torch.equal(out, serial_out), f"out: {differing(out, serial_out)} differ from the " \
        f"serial-order region, {where}"
    assert beyond_one_step(out, ref_out) == 0, where
    assert torch.equal(gkv, ref_gkv), f"grad_kv not bitwise: {differing(gkv, ref_gkv)} {where}"
    assert torch.equal(gs, ref_gs), f"grad_score not bitwise: {differing(gs, ref_gs)} {where}"
    assert (gape - ref_gape).abs().max().item() <= 1e-3, where


@pytest.mark.parametrize("ratio,coff,head_dim",
                         [(r, c, d) for r in (32, 128, 256) for c in (1, 2) for d in (128, 512)])
def test_long_window_meets_the_tolerance_contract(ratio: int, coff: int, head_dim: int) -> None:
    p = make_pack(ratio, coff, head_dim, [0, ratio - 1, 40 * ratio + 7, 3 * ratio, 90 * ratio])
    g = grad_for(p)
    got = csa_pass(p, g)
    ref = eager_pass(p, g)
    assert_written(*got)
    for name, a, b in zip(("out", "grad_kv", "grad_score"), got[:3], ref[:3]):
        n = differing(a, b)
        assert n <= max(1, math.ceil(1e-3 * a.numel())), f"{name}: {n} differ, {p.describe()}"
        assert (a.float() - b.float()).abs().max().item() <= 1.6e-2, f"{name} {p.describe()}"
    assert (got[3] - ref[3]).abs().max().item() <= 1e-3 * max(1.0, ref[3].abs().max().item())


def test_opcheck_both_ops() -> None:
    p = make_pack(4, 2, 64, [37, 64, 3], seed_value=seed())
    args = (p.kv, p.score, p.ape, p.cu_seqlens, p.cu_seqlens_comp, 4, 2, p.total_comp)
    grad_args = (p.kv, p.score, p.ape)
    for t in grad_args:
        t.requires_grad_(True)
    torch.library.opcheck(torch.ops.csa.compress_forward.default, args)
    g = grad_for(p)
    torch.library.opcheck(torch.ops.csa.compress_backward.default,
                          (g, p.kv.detach(), p.score.detach(), p.ape.detach(), p.cu_seqlens,
                           p.cu_seqlens_comp, 4, 2, True))


class TinyModel(torch.nn.Module):
    """Projections, csa.compress (or the eager region) and a readout."""

    def __init__(self, hidden: int, head_dim: int, ratio: int, coff: int, fused: bool) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.ratio, self.coff, self.fused = ratio, coff, fused
        self.wkv = torch.nn.Linear(hidden, coff * head_dim, bias=False, dtype=torch.bfloat16)
        self.wgate = torch.nn.Linear(hidden, coff * head_dim, bias=False, dtype=torch.bfloat16)
        self.ape = torch.nn.Parameter(0.25 * torch.randn(ratio, coff * head_dim))
        self.readout = torch.nn.Linear(head_dim, 1, bias=False, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor, cu: torch.Tensor, cuc: torch.Tensor,
                total_comp: int) -> torch.Tensor:
        fn = csa.compress if self.fused else compress_eager
        pooled = fn(self.wkv(x), self.wgate(x), self.ape, cu, cuc, ratio=self.ratio,
                    coff=self.coff, total_comp=total_comp)
        return self.readout(pooled).float()


def test_compile_has_no_graph_break_and_the_same_bits() -> None:
    torch._dynamo.reset()
    p = make_pack(4, 2, 128, [200, 64, 13])
    model = TinyModel(64, 128, 4, 2, fused=True).cuda()
    x = torch.randn(p.kv.shape[0], 64, device="cuda", dtype=torch.bfloat16)
    g = grad_for(p)

    def pooled(m: TinyModel, xs: torch.Tensor) -> torch.Tensor:
        return csa.compress(m.wkv(xs), m.wgate(xs), m.ape, p.cu_seqlens, p.cu_seqlens_comp,
                            ratio=4, coff=2, total_comp=p.total_comp)

    def run(fn: object) -> tuple[torch.Tensor, ...]:
        model.zero_grad()
        out = fn(model, x)  # type: ignore[operator]
        out.backward(g)
        return (out.detach(),) + tuple(q.grad.clone() for q in (model.wkv.weight,
                                                                  model.wgate.weight, model.ape))

    eager = run(pooled)
    explanation = torch._dynamo.explain(pooled)(model, x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = run(torch.compile(pooled, fullgraph=True))
    assert torch.equal(compiled[0], eager[0])
    for a, b in zip(compiled[1:3], eager[1:3]):
        assert torch.equal(a, b)
    assert (compiled[3] - eager[3]).abs().max().item() <= 1e-3  # atomic grad_ape


def test_cuda_graph_replays_at_static_capacity_after_lengths_change() -> None:
    ratio, coff, d = 4, 2, 128
    capacity_tokens = 4096
    cap = capacity_tokens // ratio
    gen = torch.Generator(device="cuda").manual_seed(seed())
    kv = torch.randn(capacity_tokens, coff * d, device="cuda", generator=gen).bfloat16()
    score = (1.5 * torch.randn(capacity_tokens, coff * d, device="cuda",
                               generator=gen)).bfloat16()
    ape = (0.25 * torch.randn(ratio, coff * d, device="cuda", generator=gen)).requires_grad_()
    kv.requires_grad_()
    score.requires_grad_()
    cu = torch.tensor([0, 1000, 3000], dtype=torch.int32, device="cuda")
    cuc = torch.tensor([0, 250, 750], dtype=torch.int32, device="cuda")
    g = torch.randn(cap, d, device="cuda", generator=gen).bfloat16()
    csa.prewarm(ratio=ratio, coff=coff, head_dim=d)

    def run() -> tuple[torch.Tensor, ...]:
        out = csa.compress(kv, score, ape, cu, cuc, ratio=ratio, coff=coff, total_comp=cap)
        gkv, gs, gape = torch.autograd.grad(out, (kv, score, ape), g)
        return out, gkv, gs, gape

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    for lens in ([1000, 2000], [4096, 0], [3, 4093], [0, 0]):
        cu.copy_(torch.tensor([0, lens[0], lens[0] + lens[1]], dtype=torch.int32))
        rows = [n // ratio for n in lens]
        cuc.copy_(torch.tensor([0, rows[0], rows[0] + rows[1]], dtype=torch.int32))
        graph.replay()
        direct = run()
        for a, b in zip(captured[:3], direct[:3]):
            assert torch.equal(a, b), lens
        assert (captured[3] - direct[3]).abs().max().item() <= 1e-3


def test_deterministic_mode_gives_bitwise_grad_ape() -> None:
    p = make_pack(4, 2, 512, [4096, 1000, 3000], spare_rows=0)
    g = grad_for(p)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = [csa_pass(p, g)[3] for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(was)
    assert all(torch.equal(runs[0], r) for r in runs[1:])


def test_training_follows_the_eager_region() -> None:
    p = make_pack(4, 2, 128, [512, 300, 1024], spare_rows=5)
    hidden = 96
    fused = TinyModel(hidden, 128, 4, 2, fused=True).cuda()
    eager = TinyModel(hidden, 128, 4, 2, fused=False).cuda()
    eager.load_state_dict(fused.state_dict())
    gen = torch.Generator(device="cuda").manual_seed(p.seed)
    x = torch.randn(p.kv.shape[0], hidden, device="cuda", generator=gen).bfloat16()
    target = torch.randn(p.total_comp, 1, device="cuda", generator=gen)
    target[p.rows:] = 0
    mask = torch.zeros(p.total_comp, 1, device="cuda")
    mask[:p.rows] = 1
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (fused, eager)]
    for step in range(50):
        losses = []
        for m, opt in zip((fused, eager), opts):
            out = m(x, p.cu_seqlens, p.cu_seqlens_comp, p.total_comp)
            loss = ((out - target) * mask).pow(2).sum() / mask.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= 1e-2 * abs(losses[1]), (step, losses, p.describe())


def test_the_megatron_example_runs_and_matches_eager() -> None:
    spec = importlib.util.spec_from_file_location("megatron_compressor",
                                                  REPO / "examples" / "megatron_compressor.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example
    spec.loader.exec_module(example)
    p = make_pack(4, 2, 128, [300, 4096, 17], rank3=True)
    cap = example.static_capacity(p.kv.shape[0], 3, 4096, 4)
    cuc = example.compressed_offsets(p.cu_seqlens, 4)
    assert torch.equal(cuc, p.cu_seqlens_comp)
    out = example.compress_thd(p.kv, p.score, p.ape, p.cu_seqlens, cuc, cap, True)
    ref = compress_eager(p.kv, p.score, p.ape, p.cu_seqlens, cuc, ratio=4, coff=2,
                         total_comp=cap)
    assert out.shape == (cap, 1, 128)
    assert differing(out, ref) <= max(1, math.ceil(1e-4 * out.numel()))
    module = example.Compressor(64, 128, 4, device="cuda")
    x = torch.randn(p.kv.shape[0], 1, 64, device="cuda", dtype=torch.bfloat16)
    y = module(x, p.cu_seqlens, cuc, cap)
    y.float().sum().backward()
    assert y.shape == (cap, 1, 128) and module.ape.grad is not None


def test_errors_from_the_library_and_from_checks() -> None:
    p = make_pack(4, 2, 64, [32, 8])
    misaligned = torch.empty(p.kv.numel() + 8, dtype=torch.bfloat16, device="cuda")[1:]
    kv = misaligned[:p.kv.numel()].view(p.kv.shape)
    with pytest.raises(ValueError, match="kv \\(data_ptr .*\\) is not 16-byte aligned"):
        csa.compress(kv, p.score, p.ape, p.cu_seqlens, p.cu_seqlens_comp, ratio=4, coff=2,
                     total_comp=p.total_comp)
    # The tokens must cover the first window: a library-side check, raised as csa.Error.
    small = make_pack(4, 2, 64, [], spare_tokens=2)
    with pytest.raises(csa.Error) as e:
        csa.compress(small.kv[:2], small.score[:2], small.ape, small.cu_seqlens,
                     small.cu_seqlens_comp, ratio=4, coff=2, total_comp=3)
    assert e.value.status == 1 and "total_tokens" in str(e.value)
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        with pytest.raises(ValueError, match="static row capacity"):
            csa.compress(*p.args(), ratio=4, coff=2)
