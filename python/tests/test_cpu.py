"""The package without a GPU: op schemas, shape inference on meta tensors (both ops, rank 2 and
3, backward), torch.compile tracing in one graph, every argument check, and the library
lookup."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import csa
from csa import _lib
from csa.reference import compress_eager
from helpers import make_pack


def test_ops_are_registered_with_their_schemas() -> None:
    fwd = str(torch.ops.csa.compress_forward.default._schema)
    bwd = str(torch.ops.csa.compress_backward.default._schema)
    assert fwd == ("csa::compress_forward(Tensor kv, Tensor score, Tensor ape, Tensor? "
                   "cu_seqlens, Tensor? cu_seqlens_comp, SymInt ratio, SymInt coff, SymInt "
                   "total_comp) -> Tensor"), fwd
    assert bwd.startswith("csa::compress_backward(Tensor grad_out, Tensor kv, Tensor score, "
                          "Tensor ape, Tensor? cu_seqlens, Tensor? cu_seqlens_comp, SymInt "
                          "ratio, SymInt coff, bool deterministic) -> (Tensor, Tensor, Tensor)"), bwd


@pytest.mark.parametrize("rank3", [False, True])
@pytest.mark.parametrize("ratio,coff,head_dim", [(4, 2, 128), (128, 1, 512), (2, 2, 65)])
def test_meta_tensors_infer_shapes_both_ways(rank3: bool, ratio: int, coff: int,
                                             head_dim: int) -> None:
    p = make_pack(ratio, coff, head_dim, [3 * ratio, ratio + 1], device="meta", rank3=rank3,
                  requires_grad=True, seed_value=1)
    out = csa.compress(*p.args(), ratio=ratio, coff=coff, total_comp=p.total_comp)
    expected = (p.total_comp, 1, head_dim) if rank3 else (p.total_comp, head_dim)
    assert out.shape == expected and out.dtype == torch.bfloat16 and out.device.type == "meta"
    out.backward(torch.empty_like(out))
    assert p.kv.grad.shape == p.kv.shape and p.kv.grad.dtype == torch.bfloat16
    assert p.score.grad.shape == p.score.shape
    assert p.ape.grad.shape == p.ape.shape and p.ape.grad.dtype == torch.float32
    gkv, gs, gape = torch.ops.csa.compress_backward(
        torch.empty(expected, dtype=torch.bfloat16, device="meta"), p.kv, p.score, p.ape,
        p.cu_seqlens, p.cu_seqlens_comp, ratio, coff, True)
    assert (gkv.shape, gs.shape, gape.shape) == (p.kv.shape, p.score.shape, p.ape.shape)


def test_compile_traces_forward_and_backward_in_one_graph() -> None:
    torch._dynamo.reset()
    p = make_pack(4, 2, 64, [16, 9], device="meta", requires_grad=True, seed_value=2)
    graphs: list[torch.fx.GraphModule] = []

    def count(gm: torch.fx.GraphModule, example_inputs: object) -> object:
        graphs.append(gm)
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func
        return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward))(gm,
                                                                                example_inputs)

    def step(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, cu: torch.Tensor,
             cuc: torch.Tensor) -> torch.Tensor:
        out = csa.compress(kv, score, ape, cu, cuc, ratio=4, coff=2, total_comp=p.total_comp)
        return (out.float() * 2.0).sum()

    compiled = torch.compile(step, fullgraph=True, backend=count)
    loss = compiled(*p.args())
    loss.backward()
    assert len(graphs) == 1, "graph break"
    assert p.kv.grad is not None and p.kv.grad.shape == p.kv.shape
    targets = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert any("csa.compress_forward" in t for t in targets), targets
    torch._dynamo.reset()
    eager = torch.compile(step, fullgraph=True, backend="aot_eager")
    eager(*p.args()).backward()


def expect(error: type[Exception], needle: str, **changes: object) -> None:
    p = make_pack(4, 2, 32, [8, 13], device="meta", seed_value=3)
    args = dict(kv=p.kv, score=p.score, ape=p.ape, cu_seqlens=p.cu_seqlens,
                cu_seqlens_comp=p.cu_seqlens_comp)
    kw: dict[str, object] = dict(ratio=4, coff=2, total_comp=p.total_comp)
    for k, v in changes.items():
        (args if k in args else kw)[k] = v
    with pytest.raises(error, match=needle):
        csa.compress(*args.values(), **kw)  # type: ignore[arg-type]


def test_argument_errors_name_the_argument() -> None:
    m = dict(device="meta")
    expect(TypeError, "kv must be a torch.Tensor", kv=[1, 2])
    expect(TypeError, "kv must be a torch.bfloat16, torch.float16 or torch.float32 tensor, got "
           "torch.float64", kv=torch.empty(26, 64, dtype=torch.float64, **m))
    expect(TypeError, "score must be a torch.bfloat16",
           score=torch.empty(26, 64, dtype=torch.float32, **m))
    expect(TypeError, "score must be a torch.float16 tensor, got torch.bfloat16",
           kv=torch.empty(26, 64, dtype=torch.float16, **m))
    expect(ValueError, "given together", cu_seqlens=None)
    expect(ValueError, "without cu_seqlens kv is SBHD", cu_seqlens=None, cu_seqlens_comp=None)
    expect(TypeError, "ape must be a torch.float32", ape=torch.empty(4, 64, dtype=torch.bfloat16,
                                                                     **m))
    expect(TypeError, "cu_seqlens must be a torch.int32",
           cu_seqlens=torch.empty(3, dtype=torch.int64, **m))
    expect(TypeError, "cu_seqlens_comp must be a torch.int32",
           cu_seqlens_comp=torch.empty(3, dtype=torch.int64, **m))
    expect(ValueError, "kv must be \\(T, coff\\*head_dim\\)",
           kv=torch.empty(26, 2, 64, dtype=torch.bfloat16, **m))
    expect(ValueError, "score must have kv's shape",
           score=torch.empty(25, 64, dtype=torch.bfloat16, **m))
    expect(ValueError, "must be coff \\(2\\) \\* head_dim",
           kv=torch.empty(26, 63, dtype=torch.bfloat16, **m),
           score=torch.empty(26, 63, dtype=torch.bfloat16, **m))
    expect(ValueError, "ape must be \\(ratio, coff\\*head_dim\\) = \\(4, 64\\)",
           ape=torch.empty(2, 64, **m))
    expect(ValueError, "cu_seqlens must be 1-D",
           cu_seqlens=torch.empty(3, 1, dtype=torch.int32, **m))
    expect(ValueError, "cu_seqlens_comp must have cu_seqlens' shape",
           cu_seqlens_comp=torch.empty(4, dtype=torch.int32, **m))
    expect(ValueError, "ratio must be an integer in \\[1, 256\\]", ratio=0)
    expect(ValueError, "ratio must be an integer", ratio=4.0)
    expect(ValueError, "coff must be 1 or 2", coff=3)
    expect(ValueError, "total_comp must be a non-negative integer", total_comp=-1)
    expect(ValueError, "total_comp=None reads cu_seqlens_comp\\[-1\\]", total_comp=None)
    expect(ValueError, "kv must be on a CUDA device", kv=torch.empty(26, 64, dtype=torch.bfloat16),
           score=torch.empty(26, 64, dtype=torch.bfloat16), ape=torch.empty(4, 64),
           cu_seqlens=torch.zeros(3, dtype=torch.int32),
           cu_seqlens_comp=torch.zeros(3, dtype=torch.int32))
    expect(ValueError, "score is on cpu but kv is on meta",
           score=torch.empty(26, 64, dtype=torch.bfloat16))
    expect(ValueError, "kv's last dimension must be unit-stride",
           kv=torch.empty(64, 26, dtype=torch.bfloat16, **m).t(),
           score=torch.empty(64, 26, dtype=torch.bfloat16, **m).t())
    # Rows 68 elements apart: not a multiple of the 8 elements bf16 rows of head_dim 32 are
    # read with; 72 is fine (the half of a fused (T, 2W) output is the common case).
    expect(ValueError, "kv's rows are 68 elements apart",
           kv=torch.empty(26, 68, dtype=torch.bfloat16, **m)[:, :64])
    expect(ValueError, "score's rows are 68 elements apart",
           score=torch.empty(26, 68, dtype=torch.bfloat16, **m)[:, :64])
    expect(ValueError, "ape must be contiguous", ape=torch.empty(64, 4, **m).t())
    sbhd = dict(cu_seqlens=None, cu_seqlens_comp=None, total_comp=None)
    expect(ValueError, "must be evenly spaced",
           kv=torch.empty(13, 4, 64, dtype=torch.bfloat16, **m).transpose(0, 1),
           score=torch.empty(13, 4, 64, dtype=torch.bfloat16, **m).transpose(0, 1), **sbhd)
    expect(ValueError, "total_comp of SBHD inputs \\(S=13, B=2\\) is \\(S // ratio\\) \\* B = 6, "
           "got 5", kv=torch.empty(13, 2, 64, dtype=torch.bfloat16, **m),
           score=torch.empty(13, 2, 64, dtype=torch.bfloat16, **m), cu_seqlens=None,
           cu_seqlens_comp=None, total_comp=5)
    expect(ValueError, "head_dim = kv.shape\\[-1\\] / coff = 4097",
           kv=torch.empty(26, 8194, dtype=torch.bfloat16, **m),
           score=torch.empty(26, 8194, dtype=torch.bfloat16, **m))


def test_prewarm_arguments_are_checked_before_the_library() -> None:
    with pytest.raises(ValueError, match="together"):
        csa.prewarm(ratio=4)
    with pytest.raises(ValueError, match="coff must be 1 or 2"):
        csa.prewarm(ratio=4, coff=5, head_dim=128, device=0)
    with pytest.raises(ValueError, match="head_dim"):
        csa.prewarm(ratio=4, coff=2, head_dim=0, device=0)


def test_library_lookup_explains_how_to_get_one(tmp_path: Path) -> None:
    with pytest.raises(_lib.LibraryError, match="pip install .*CSA_LIBRARY"):
        _lib.find_library(tmp_path, environ={})
    with pytest.raises(_lib.LibraryError, match="CSA_LIBRARY='/nonexistent/libcsa.so' is not"):
        _lib.find_library(tmp_path, environ={"CSA_LIBRARY": "/nonexistent/libcsa.so"})
    (tmp_path / "libcsa.so.0").write_bytes(b"not a library")
    assert _lib.find_library(tmp_path, environ={}) == tmp_path / "libcsa.so.0"


def test_the_library_loads_and_reports_itself() -> None:
    assert csa.version() == csa.__version__
    info = csa.info()
    assert info["version"] == csa.__version__
    assert {"ratio": 4, "coff": 2, "head_dim": 512} in info["default_configs"]
    assert "layers" in info["cache"]
    if not torch.cuda.is_available():
        assert info["driver"]["available"] is False or info["devices"] == []
        with pytest.raises(csa.Error) as e:
            csa.prewarm(ratio=4, coff=2, head_dim=128, device=0)
        assert e.value.status_name in ("driver unavailable", "invalid argument")


def test_the_eager_reference_runs_on_the_cpu() -> None:
    p = make_pack(4, 2, 16, [9, 16], device="cpu", requires_grad=True, seed_value=4)
    out = compress_eager(*p.args(), ratio=4, coff=2, total_comp=p.total_comp)
    assert out.shape == (p.total_comp, 16)
    # A padding row equals row 0 (block 0 of the segment at token 0, here segment 0's own).
    assert torch.equal(out[p.rows], out[0])
    out.float().sum().backward()
    assert p.ape.grad is not None


def load_example() -> object:
    import importlib.util
    path = Path(__file__).resolve().parents[2] / "examples" / "megatron_compressor.py"
    spec = importlib.util.spec_from_file_location("megatron_compressor", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # torch.compile looks the module up by name
    spec.loader.exec_module(module)
    return module


def test_the_megatron_example_traces_on_the_meta_device() -> None:
    example = load_example()
    model = example.Compressor(64, 128, 4, device="meta")  # type: ignore[attr-defined]
    cu = torch.empty(4, dtype=torch.int32, device="meta")
    cap = example.static_capacity(8192, 3, 4096, 4)  # type: ignore[attr-defined]
    x = torch.empty(8192, 1, 64, dtype=torch.bfloat16, device="meta")
    out = model(x, cu, torch.empty_like(cu), cap)
    assert out.shape == (cap, 1, 128)
    out.float().sum().backward()
    assert model.ape.grad.shape == (4, 256)
    torch._dynamo.reset()
    fn = torch.compile(lambda xs: example.compress_thd(  # type: ignore[attr-defined]
        model.linear_wkv(xs), model.linear_wgate(xs), model.ape, cu, torch.empty_like(cu), cap,
        True), fullgraph=True, backend="aot_eager")
    y = fn(x)
    assert y.shape == (cap, 1, 128)
    y.float().sum().backward()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_types_layouts_and_row_strides_infer_shapes_both_ways(dtype: torch.dtype) -> None:
    ratio, coff, d = 4, 2, 64
    width = coff * d
    ape = torch.empty(ratio, width, device="meta", requires_grad=True)
    # SBHD (S, B, W) -> (S // ratio, B, d); the output rows come without offsets.
    kv = torch.empty(37, 3, width, dtype=dtype, device="meta", requires_grad=True)
    score = torch.empty(37, 3, width, dtype=dtype, device="meta", requires_grad=True)
    out = csa.compress(kv, score, ape, ratio=ratio, coff=coff)
    assert out.shape == (9, 3, d) and out.dtype == dtype
    out.backward(torch.empty_like(out))
    assert kv.grad.shape == kv.shape and kv.grad.dtype == dtype and ape.grad.shape == ape.shape
    # THD halves of one fused projection output (T, 2W): row-strided views.
    fused = torch.empty(50, 2 * width, dtype=dtype, device="meta", requires_grad=True)
    kv_view, score_view = fused.split(width, dim=-1)
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    out = csa.compress(kv_view, score_view, ape, cu, cu, ratio=ratio, coff=coff, total_comp=12)
    assert out.shape == (12, d) and out.dtype == dtype
    out.backward(torch.empty_like(out))
    assert fused.grad.shape == fused.shape and fused.grad.dtype == dtype


def test_compress_backward_infers_the_gradients_shapes() -> None:
    p = make_pack(4, 2, 32, [8, 13], device="meta", seed_value=5)
    g = torch.empty(p.total_comp, 32, dtype=torch.bfloat16, device="meta")
    gkv, gs, gape = csa.compress_backward(g, *p.args(), ratio=4, coff=2)
    assert (gkv.shape, gs.shape, gape.shape) == (p.kv.shape, p.score.shape, p.ape.shape)
    with pytest.raises(ValueError, match="grad_out must be \\(8, 32\\)"):
        csa.compress_backward(g[:, 1:], *p.args(), ratio=4, coff=2)
    with pytest.raises(TypeError, match="grad_out must be a torch.bfloat16"):
        csa.compress_backward(g.float(), *p.args(), ratio=4, coff=2)
