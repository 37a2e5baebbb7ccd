"""The torch ops ``torch.ops.csa.compress_forward`` / ``compress_backward``: CUDA
implementations over the C ABI, fake implementations (shapes and dtypes, no device access)
and autograd."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor

from . import _checks, _lib

__all__ = ["forward_impl", "backward_impl"]


@contextlib.contextmanager
def _on_device(index: int) -> Iterator[int]:
    """The device current for the launch (the C ABI launches in the calling thread's current
    context), and its current stream."""
    if torch.cuda.current_device() == index:
        yield torch.cuda.current_stream(index).cuda_stream
        return
    with torch.cuda.device(index):
        yield torch.cuda.current_stream(index).cuda_stream


def _launch(device: torch.device, entry: str, *args: object) -> None:
    lib = _lib.library()
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _on_device(index) as stream:
        # The thread's current context is the runtime's primary context of `index` after this
        # (a fresh thread may have none yet).
        _lib.check(lib.csa_set_device(index))
        _lib.check(getattr(lib, entry)(*args, stream))


def _out_shape(shape: _checks.Shape, total_comp: int) -> tuple[int, ...]:
    return (total_comp, 1, shape.head_dim) if shape.rank3 else (total_comp, shape.head_dim)


def forward_impl(kv: Tensor, score: Tensor, ape: Tensor, cu_seqlens: Tensor,
                 cu_seqlens_comp: Tensor, ratio: int, coff: int, total_comp: int,
                 launch: bool = True) -> Tensor:
    """``launch`` False: the fake implementation (outputs' metadata only)."""
    shape = _checks.inputs(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff)
    _checks.total_comp(total_comp)
    out = kv.new_empty(_out_shape(shape, total_comp))
    if not launch or kv.device.type != "cuda" or total_comp == 0:
        return out
    _checks.aligned({"kv": kv, "score": score, "ape": ape, "cu_seqlens": cu_seqlens,
                     "cu_seqlens_comp": cu_seqlens_comp})
    _launch(kv.device, "csa_compressor_forward", kv.data_ptr(), score.data_ptr(), ape.data_ptr(),
            cu_seqlens.data_ptr(), cu_seqlens_comp.data_ptr(), out.data_ptr(), shape.tokens,
            shape.segments, total_comp, ratio, shape.head_dim, coff)
    return out


def backward_impl(grad_out: Tensor, kv: Tensor, score: Tensor, ape: Tensor, cu_seqlens: Tensor,
                  cu_seqlens_comp: Tensor, ratio: int, coff: int,
                  deterministic: bool, launch: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    shape = _checks.inputs(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff)
    total_comp = grad_out.shape[0] if isinstance(grad_out, Tensor) else 0
    _checks.grad_out(grad_out, shape, total_comp, kv.device)
    # Every element of the three gradients is written by the kernels (exact zeros where
    # nothing is consumed; grad_ape overwritten): uninitialised memory is fine.
    grad_kv = torch.empty_like(kv)
    grad_score = torch.empty_like(score)
    grad_ape = torch.empty_like(ape)
    if not launch or kv.device.type != "cuda":
        return grad_kv, grad_score, grad_ape
    _checks.aligned({"grad_out": grad_out, "kv": kv, "score": score, "ape": ape,
                     "cu_seqlens": cu_seqlens, "cu_seqlens_comp": cu_seqlens_comp})
    flags = _lib.DETERMINISTIC if deterministic else 0
    _launch(kv.device, "csa_compressor_backward", kv.data_ptr(), score.data_ptr(),
            ape.data_ptr(), cu_seqlens.data_ptr(), cu_seqlens_comp.data_ptr(),
            grad_out.data_ptr(), grad_kv.data_ptr(), grad_score.data_ptr(), grad_ape.data_ptr(),
            shape.tokens, shape.segments, total_comp, ratio, shape.head_dim, coff, flags)
    return grad_kv, grad_score, grad_ape


@torch.library.custom_op("csa::compress_forward", mutates_args=(), device_types="cuda")
def compress_forward(kv: Tensor, score: Tensor, ape: Tensor, cu_seqlens: Tensor,
                     cu_seqlens_comp: Tensor, ratio: int, coff: int, total_comp: int) -> Tensor:
    """The pooled rows ``(total_comp, head_dim)`` (``(total_comp, 1, head_dim)`` for rank-3
    kv) of a THD pack."""
    return forward_impl(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp)


@compress_forward.register_fake
def _compress_forward_fake(kv: Tensor, score: Tensor, ape: Tensor, cu_seqlens: Tensor,
                           cu_seqlens_comp: Tensor, ratio: int, coff: int,
                           total_comp: int) -> Tensor:
    return forward_impl(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp,
                        launch=False)


@torch.library.custom_op("csa::compress_backward", mutates_args=(), device_types="cuda")
def compress_backward(grad_out: Tensor, kv: Tensor, score: Tensor, ape: Tensor,
                      cu_seqlens: Tensor, cu_seqlens_comp: Tensor, ratio: int, coff: int,
                      deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(grad_kv, grad_score, grad_ape)``; ``deterministic``: grad_ape in a fixed order."""
    return backward_impl(grad_out, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff,
                         deterministic)


@compress_backward.register_fake
def _compress_backward_fake(grad_out: Tensor, kv: Tensor, score: Tensor, ape: Tensor,
                            cu_seqlens: Tensor, cu_seqlens_comp: Tensor, ratio: int, coff: int,
                            deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    return backward_impl(grad_out, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff,
                         deterministic, launch=False)


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple[object, ...],
                   output: Tensor) -> None:
    kv, score, ape, cu, cuc, ratio, coff, _ = inputs
    ctx.save_for_backward(kv, score, ape, cu, cuc)
    ctx.ratio = ratio
    ctx.coff = coff


def _backward(ctx: torch.autograd.function.FunctionCtx,
              grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None, None, None, None]:
    kv, score, ape, cu, cuc = ctx.saved_tensors
    grad_kv, grad_score, grad_ape = torch.ops.csa.compress_backward(
        grad.contiguous(), kv, score, ape, cu, cuc, ctx.ratio, ctx.coff,
        torch.are_deterministic_algorithms_enabled())
    return grad_kv, grad_score, grad_ape, None, None, None, None, None


compress_forward.register_autograd(_backward, setup_context=_setup_context)


class EagerCompress(torch.autograd.Function):
    """The same forward and backward as the ops, called directly: eager CUDA calls skip the
    dispatcher's Python round trips (the ops serve tracing, torch.compile and meta tensors)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, kv: Tensor, score: Tensor,
                ape: Tensor, cu_seqlens: Tensor, cu_seqlens_comp: Tensor, ratio: int, coff: int,
                total_comp: int) -> Tensor:
        ctx.save_for_backward(kv, score, ape, cu_seqlens, cu_seqlens_comp)
        ctx.ratio = ratio
        ctx.coff = coff
        return forward_impl(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx,
                 grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None, None, None, None]:
        kv, score, ape, cu, cuc = ctx.saved_tensors
        grad_kv, grad_score, grad_ape = backward_impl(
            grad.contiguous(), kv, score, ape, cu, cuc, ctx.ratio, ctx.coff,
            torch.are_deterministic_algorithms_enabled())
        return grad_kv, grad_score, grad_ape, None, None, None, None, None
