"""The torch ops ``torch.ops.csa.compress_forward`` / ``compress_backward``: CUDA
implementations over the C ABI, fake implementations (shapes and dtypes, no device access)
and autograd; and the eager fast path that calls the same implementations directly."""

from __future__ import annotations

import ctypes
import threading
from typing import Optional

import torch
from torch import Tensor

from . import _checks, _lib

__all__ = ["forward_impl", "backward_impl", "dense_like", "EagerCompress"]

_ready = threading.local()  # devices whose context this thread has made current


def _raw_stream(index: int) -> int:
    return torch.cuda.current_stream(index).cuda_stream


if hasattr(torch._C, "_cuda_getCurrentRawStream"):
    _raw_stream = torch._C._cuda_getCurrentRawStream  # noqa: F811  # the same, without a Stream


def _launch(index: Optional[int], entry: str, *args: object) -> None:
    """Calls the C ABI entry with the current stream of device `index`, that device current
    (the C ABI launches in the calling thread's current context)."""
    lib = _lib.library()
    current = torch.cuda.current_device()
    if index is None:
        index = current
    if index != current:
        with torch.cuda.device(index):
            _launch(index, entry, *args)
        return
    devices = getattr(_ready, "devices", None)
    if devices is None:
        devices = _ready.devices = set()
    if index not in devices:
        # A thread that has made no CUDA runtime call yet has no current context.
        _lib.check(lib.csa_set_device(index))
        devices.add(index)
    _lib.check(getattr(lib, entry)(*args, _raw_stream(index)))


def _args(shape: _checks.Shape, ratio: int, coff: int, total_comp: int, kv: Tensor,
          score: Tensor, ape: Tensor, cu_seqlens: Optional[Tensor],
          cu_seqlens_comp: Optional[Tensor]) -> _lib.CompressorArgs:
    """The versioned arguments of a call the original entry points cannot take (another
    element type, SBHD, row strides)."""
    a = _lib.CompressorArgs()
    a.struct_size = _lib.ARGS_SIZE
    a.ratio, a.head_dim, a.coff = ratio, shape.head_dim, coff
    a.dtype, a.layout = shape.dtype, 1 if shape.sbhd else 0
    a.total_tokens, a.total_comp, a.seq_len = shape.tokens, total_comp, shape.seq_len
    a.num_segments = shape.segments
    a.kv_stride, a.score_stride = shape.kv_stride, shape.score_stride
    a.kv, a.score, a.ape = kv.data_ptr(), score.data_ptr(), ape.data_ptr()
    if cu_seqlens is not None and cu_seqlens_comp is not None:
        a.cu_seqlens, a.cu_seqlens_comp = cu_seqlens.data_ptr(), cu_seqlens_comp.data_ptr()
    return a


def dense_like(t: Tensor, row_stride: int) -> Tensor:
    """An uninitialised contiguous tensor of t's shape and dtype: ``empty_like`` (the cheaper
    call) where t is contiguous itself (``row_stride`` 0), else ``new_empty``."""
    return torch.empty_like(t) if row_stride == 0 else t.new_empty(t.shape)


def _offsets(cu_seqlens: Optional[Tensor], cu_seqlens_comp: Optional[Tensor]) -> dict[str, int]:
    if cu_seqlens is None or cu_seqlens_comp is None:
        return {}
    return {"cu_seqlens": cu_seqlens.data_ptr(), "cu_seqlens_comp": cu_seqlens_comp.data_ptr()}


def forward_impl(kv: Tensor, score: Tensor, ape: Tensor, cu_seqlens: Optional[Tensor],
                 cu_seqlens_comp: Optional[Tensor], ratio: int, coff: int, total_comp: int,
                 launch: bool = True, shape: Optional[_checks.Shape] = None) -> Tensor:
    """``launch`` False: the fake implementation (outputs' metadata only). ``shape``: the
    inputs were checked already."""
    if shape is None:
        shape = _checks.inputs(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff)
        _checks.total_comp(total_comp)
        if shape.sbhd:
            _checks.sbhd_rows(shape, ratio, total_comp)
    out = kv.new_empty(_checks.out_shape(shape, total_comp))
    if not launch or total_comp == 0 or not kv.is_cuda:
        return out
    if not shape.plain:
        a = _args(shape, ratio, coff, total_comp, kv, score, ape, cu_seqlens, cu_seqlens_comp)
        a.out = out.data_ptr()
        _checks.aligned({"kv": a.kv, "score": a.score, "ape": a.ape}, _offsets(cu_seqlens,
                                                                             cu_seqlens_comp))
        _launch(kv.device.index, "csa_compressor_forward_ex", ctypes.byref(a))
        return out
    assert cu_seqlens is not None and cu_seqlens_comp is not None
    ptrs = (kv.data_ptr(), score.data_ptr(), ape.data_ptr(), cu_seqlens.data_ptr(),
            cu_seqlens_comp.data_ptr(), out.data_ptr())
    _checks.aligned({"kv": ptrs[0], "score": ptrs[1], "ape": ptrs[2]},
                    {"cu_seqlens": ptrs[3], "cu_seqlens_comp": ptrs[4]})
    _launch(kv.device.index, "csa_compressor_forward", *ptrs, shape.tokens, shape.segments,
            total_comp, ratio, shape.head_dim, coff)
    return out


def backward_impl(grad_out: Tensor, kv: Tensor, score: Tensor, ape: Tensor,
                  cu_seqlens: Optional[Tensor], cu_seqlens_comp: Optional[Tensor], ratio: int,
                  coff: int, deterministic: bool, launch: bool = True,
                  shape: Optional[_checks.Shape] = None) -> tuple[Tensor, Tensor, Tensor]:
    if shape is None:
        shape = _checks.inputs(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff)
    if shape.sbhd:
        total_comp = (shape.seq_len // ratio) * shape.segments
    else:
        total_comp = grad_out.shape[0] if isinstance(grad_out, Tensor) and grad_out.dim() else 0
    _checks.grad_out(grad_out, shape, total_comp, kv.device)
    # Every element of the three gradients is written by the kernels (exact zeros where
    # nothing is consumed; grad_ape overwritten): uninitialised memory is fine. Dense, whatever
    # the inputs' row strides.
    grad_kv = dense_like(kv, shape.kv_stride)
    grad_score = dense_like(score, shape.score_stride)
    grad_ape = torch.empty_like(ape)
    if not launch or not kv.is_cuda:
        return grad_kv, grad_score, grad_ape
    if not shape.plain:
        a = _args(shape, ratio, coff, total_comp, kv, score, ape, cu_seqlens, cu_seqlens_comp)
        a.grad_out, a.grad_kv = grad_out.data_ptr(), grad_kv.data_ptr()
        a.grad_score, a.grad_ape = grad_score.data_ptr(), grad_ape.data_ptr()
        a.flags = _lib.DETERMINISTIC if deterministic else 0
        _checks.aligned({"kv": a.kv, "score": a.score, "ape": a.ape, "grad_out": a.grad_out},
                        _offsets(cu_seqlens, cu_seqlens_comp))
        _launch(kv.device.index, "csa_compressor_backward_ex", ctypes.byref(a))
        return grad_kv, grad_score, grad_ape
    assert cu_seqlens is not None and cu_seqlens_comp is not None
    ptrs = (kv.data_ptr(), score.data_ptr(), ape.data_ptr(), cu_seqlens.data_ptr(),
            cu_seqlens_comp.data_ptr(), grad_out.data_ptr(), grad_kv.data_ptr(),
            grad_score.data_ptr(), grad_ape.data_ptr())
    _checks.aligned({"kv": ptrs[0], "score": ptrs[1], "ape": ptrs[2], "grad_out": ptrs[5]},
                    {"cu_seqlens": ptrs[3], "cu_seqlens_comp": ptrs[4]})
    flags = _lib.DETERMINISTIC if deterministic else 0
    _launch(kv.device.index, "csa_compressor_backward", *ptrs, shape.tokens, shape.segments,
            total_comp, ratio, shape.head_dim, coff, flags)
    return grad_kv, grad_score, grad_ape


@torch.library.custom_op("csa::compress_forward", mutates_args=(), device_types="cuda")
def compress_forward(kv: Tensor, score: Tensor, ape: Tensor, cu_seqlens: Optional[Tensor],
                     cu_seqlens_comp: Optional[Tensor], ratio: int, coff: int,
                     total_comp: int) -> Tensor:
    """The pooled rows ``(total_comp, head_dim)`` (``(total_comp, 1, head_dim)`` for rank-3
    kv) of a THD pack, or ``(S // ratio, B, head_dim)`` of SBHD kv (offsets None)."""
    return forward_impl(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp)


@compress_forward.register_fake
def _compress_forward_fake(kv: Tensor, score: Tensor, ape: Tensor, cu_seqlens: Optional[Tensor],
                           cu_seqlens_comp: Optional[Tensor], ratio: int, coff: int,
                           total_comp: int) -> Tensor:
    return forward_impl(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp,
                        launch=False)


@torch.library.custom_op("csa::compress_backward", mutates_args=(), device_types="cuda")
def compress_backward(grad_out: Tensor, kv: Tensor, score: Tensor, ape: Tensor,
                      cu_seqlens: Optional[Tensor], cu_seqlens_comp: Optional[Tensor],
                      ratio: int, coff: int,
                      deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(grad_kv, grad_score, grad_ape)``; ``deterministic``: grad_ape in a fixed order."""
    return backward_impl(grad_out, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff,
                         deterministic)


@compress_backward.register_fake
def _compress_backward_fake(grad_out: Tensor, kv: Tensor, score: Tensor, ape: Tensor,
                            cu_seqlens: Optional[Tensor], cu_seqlens_comp: Optional[Tensor],
                            ratio: int, coff: int,
                            deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    return backward_impl(grad_out, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff,
                         deterministic, launch=False)


_NO_GRADS = (None, None, None, None, None)


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple[object, ...],
                   output: Tensor) -> None:
    kv, score, ape, cu, cuc, ratio, coff, _ = inputs
    ctx.save_for_backward(kv, score, ape, cu, cuc)
    ctx.ratio = ratio
    ctx.coff = coff


def _backward(ctx: torch.autograd.function.FunctionCtx,
              grad: Tensor) -> tuple[Optional[Tensor], ...]:
    kv, score, ape, cu, cuc = ctx.saved_tensors
    grads = torch.ops.csa.compress_backward(grad.contiguous(), kv, score, ape, cu, cuc,
                                            ctx.ratio, ctx.coff,
                                            torch.are_deterministic_algorithms_enabled())
    return tuple(grads) + _NO_GRADS


compress_forward.register_autograd(_backward, setup_context=_setup_context)


class EagerCompress(torch.autograd.Function):
    """The same forward and backward as the ops, called directly: eager CUDA calls skip the
    dispatcher's Python round trips (the ops serve tracing, torch.compile and meta tensors)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, kv: Tensor, score: Tensor,
                ape: Tensor, cu_seqlens: Optional[Tensor], cu_seqlens_comp: Optional[Tensor],
                ratio: int, coff: int, total_comp: int, shape: _checks.Shape) -> Tensor:
        ctx.save_for_backward(kv, score, ape, cu_seqlens, cu_seqlens_comp)
        ctx.ratio = ratio
        ctx.coff = coff
        ctx.shape = shape
        return forward_impl(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp,
                            shape=shape)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx,
                 grad: Tensor) -> tuple[Optional[Tensor], ...]:
        kv, score, ape, cu, cuc = ctx.saved_tensors
        grads = backward_impl(grad.contiguous(), kv, score, ape, cu, cuc, ctx.ratio, ctx.coff,
                              torch.are_deterministic_algorithms_enabled(), shape=ctx.shape)
        return grads + _NO_GRADS + (None,)
