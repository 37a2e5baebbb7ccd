"""The fused tail after the pooling (RMSNorm, RoPE, Hadamard) as torch ops:
``torch.ops.csa.compress_tail_forward`` / ``compress_tail_backward``, CUDA implementations over
the version-3 C ABI, fake implementations and autograd (kv, score, ape and the norm weight)."""

from __future__ import annotations

import ctypes
import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from . import _checks, _lib, _ops

__all__ = ["TailSpec", "tail_spec", "tail_forward_impl", "tail_backward_impl"]

SHORT_WINDOW_MAX_RATIO = 16
TAIL_MAX_HEAD_DIM = 1024


class TailSpec(NamedTuple):
    norm: bool
    weight_bf16: bool
    eps: float
    rope_dim: int
    rope_interleaved: bool
    hadamard: bool

    def flags(self) -> int:
        f = 0
        if self.norm:
            f |= _lib.TAIL_NORM
            if self.weight_bf16:
                f |= _lib.TAIL_NORM_WEIGHT_BF16
        if self.rope_dim and not self.rope_interleaved:
            f |= _lib.TAIL_ROPE_HALF_SPLIT
        if self.hadamard:
            f |= _lib.TAIL_HADAMARD
        return f


def _table(name: str, t: object, half: Optional[int], device: torch.device) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {t.dtype}")
    if t.dim() != 2 or t.shape[0] < 1 or (half is not None and t.shape[1] != half):
        want = f"(max_blocks, {half})" if half is not None else "(max_blocks, rope_dim // 2)"
        raise ValueError(f"{name} must be {want}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but kv is on {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return t


# The short-window backward's row-stats form: where the whole-row form holds one row a CTA
# (head_dim 512 and more at windows of 7 slots or more), up to this many output elements.
ROW_STATS_MIN_HEAD_DIM = 512
ROW_STATS_MIN_WINDOW = 7
ROW_STATS_MAX_ELEMENTS = 1 << 20


def keeps_pooled(ratio: int, coff: int, head_dim: int, total_comp: int, spec: TailSpec) -> bool:
    """Whether the forward returns the fp32 pooled rows for the backward: the long-window
    family's (ratio > 16) tail backward reads them with the norm; a short-window tail with the
    norm and without the Hadamard transform takes its backward's row-stats form from them where
    that measured faster than recomputing each row whole (docs/performance.md)."""
    if ratio > SHORT_WINDOW_MAX_RATIO:
        return spec.norm
    return (spec.norm and not spec.hadamard and head_dim >= ROW_STATS_MIN_HEAD_DIM
            and ratio * coff >= ROW_STATS_MIN_WINDOW
            and total_comp * head_dim <= ROW_STATS_MAX_ELEMENTS)


def tail_spec(head_dim: int, ratio: int, device: torch.device, norm_weight: object, eps: object,
              rope_cos: object, rope_sin: object, rope_dim: object, rope_interleaved: object,
              hadamard: object) -> TailSpec:
    """The tail's options checked (TypeError / ValueError naming the argument), before anything
    is launched; metadata only, so meta and fake tensors pass through."""
    norm = norm_weight is not None
    weight_bf16 = False
    if norm:
        if not isinstance(norm_weight, Tensor):
            raise TypeError(f"norm_weight must be a torch.Tensor, got {type(norm_weight).__name__}")
        if norm_weight.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"norm_weight must be bfloat16 or float32, got {norm_weight.dtype}")
        if tuple(norm_weight.shape) != (head_dim,):
            raise ValueError(f"norm_weight must be ({head_dim},) (head_dim), got "
                             f"{tuple(norm_weight.shape)}")
        if norm_weight.device != device:
            raise ValueError(f"norm_weight is on {norm_weight.device} but kv is on {device}")
        if not norm_weight.is_contiguous():
            raise ValueError("norm_weight must be contiguous")
        weight_bf16 = norm_weight.dtype == torch.bfloat16
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if norm and not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be finite and > 0, got {eps}")
    if (rope_cos is None) != (rope_sin is None):
        raise ValueError("rope_cos and rope_sin go together (both or neither)")
    if rope_dim is not None and (isinstance(rope_dim, bool) or not isinstance(rope_dim, int)):
        raise TypeError(f"rope_dim must be an int, got {type(rope_dim).__name__}")
    dim = 0
    if rope_cos is not None:
        half = None if rope_dim is None else rope_dim // 2
        cos = _table("rope_cos", rope_cos, half, device)
        sin = _table("rope_sin", rope_sin, cos.shape[1], device)
        if tuple(sin.shape) != tuple(cos.shape):
            raise ValueError(f"rope_sin {tuple(sin.shape)} must match rope_cos "
                             f"{tuple(cos.shape)}")
        dim = 2 * cos.shape[1] if rope_dim is None else rope_dim
        if dim % 2 or not 0 < dim <= head_dim:
            raise ValueError(f"rope_dim must be even, in 2..head_dim {head_dim}, got {dim}")
    elif rope_dim:
        raise ValueError(f"rope_dim {rope_dim} needs rope_cos and rope_sin")
    if not isinstance(rope_interleaved, bool):
        raise TypeError(f"rope_interleaved must be a bool, got {type(rope_interleaved).__name__}")
    if not isinstance(hadamard, bool):
        raise TypeError(f"hadamard must be a bool, got {type(hadamard).__name__}")
    if hadamard and head_dim & (head_dim - 1):
        raise ValueError(f"hadamard needs a power-of-two head_dim, got {head_dim}")
    power_of_two = head_dim & (head_dim - 1) == 0
    if ratio > SHORT_WINDOW_MAX_RATIO:
        if head_dim > TAIL_MAX_HEAD_DIM or not power_of_two:
            raise ValueError(f"the fused tail at ratio {ratio} (the long-window family) needs "
                             f"head_dim a power of two, at most {TAIL_MAX_HEAD_DIM}, got "
                             f"{head_dim}")
    elif head_dim > TAIL_MAX_HEAD_DIM or not (power_of_two or head_dim % 32 == 0):
        raise ValueError(f"the fused tail needs head_dim a power of two or a multiple of 32, at "
                         f"most {TAIL_MAX_HEAD_DIM}, got {head_dim}")
    return TailSpec(norm, weight_bf16, float(eps), dim, rope_interleaved, hadamard)


def _tail_args(shape: _checks.Shape, spec: TailSpec, ratio: int, coff: int, total_comp: int,
               kv: Tensor, score: Tensor, ape: Tensor, cu_seqlens: Optional[Tensor],
               cu_seqlens_comp: Optional[Tensor], norm_weight: Optional[Tensor],
               rope_cos: Optional[Tensor], rope_sin: Optional[Tensor]) -> _lib.CompressorArgs:
    a = _ops._args(shape, ratio, coff, total_comp, kv, score, ape, cu_seqlens, cu_seqlens_comp)
    a.struct_size = _lib.ARGS_SIZE_V3
    a.tail_flags = spec.flags()
    a.rope_dim = spec.rope_dim
    a.eps = spec.eps
    if norm_weight is not None:
        a.norm_weight = norm_weight.data_ptr()
    if rope_cos is not None and rope_sin is not None:
        a.rope_cos, a.rope_sin = rope_cos.data_ptr(), rope_sin.data_ptr()
        a.rope_max_blocks = rope_cos.shape[0]
    return a


def _check_pooled(pooled: object, total_comp: int, head_dim: int, device: torch.device) -> None:
    if not isinstance(pooled, Tensor):
        raise TypeError(f"pooled must be the forward's pooled rows (a torch.Tensor) where the "
                        f"forward keeps them (keeps_pooled), got {type(pooled).__name__}")
    if pooled.dtype != torch.float32:
        raise TypeError(f"pooled must be float32, got {pooled.dtype}")
    if tuple(pooled.shape) != (total_comp, head_dim):
        raise ValueError(f"pooled must be ({total_comp}, {head_dim}) (total_comp, head_dim), got "
                         f"{tuple(pooled.shape)}")
    if pooled.device != device:
        raise ValueError(f"pooled is on {pooled.device} but kv is on {device}")
    if not pooled.is_contiguous():
        raise ValueError("pooled must be contiguous")


def tail_forward_impl(kv: Tensor, score: Tensor, ape: Tensor, cu_seqlens: Optional[Tensor],
                      cu_seqlens_comp: Optional[Tensor], norm_weight: Optional[Tensor],
                      rope_cos: Optional[Tensor], rope_sin: Optional[Tensor], ratio: int,
                      coff: int, total_comp: int, eps: float, rope_dim: int,
                      rope_interleaved: bool, hadamard: bool,
                      launch: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, rstd, pooled)``; rstd is ``(total_comp,)`` fp32 with the norm, else empty; pooled
    the ``(total_comp, head_dim)`` fp32 rows before the tail where the backward reads them
    (keeps_pooled), else empty."""
    shape = _checks.inputs(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff)
    _checks.total_comp(total_comp)
    if shape.sbhd:
        _checks.sbhd_rows(shape, ratio, total_comp)
    spec = tail_spec(shape.head_dim, ratio, kv.device, norm_weight, eps, rope_cos, rope_sin,
                     rope_dim or None, rope_interleaved, hadamard)
    y = kv.new_empty(_checks.out_shape(shape, total_comp))
    rstd = kv.new_empty((total_comp if spec.norm else 0,), dtype=torch.float32)
    keep = keeps_pooled(ratio, coff, shape.head_dim, total_comp, spec)
    pooled = kv.new_empty((total_comp, shape.head_dim) if keep else (0,), dtype=torch.float32)
    if not launch or total_comp == 0 or not kv.is_cuda:
        return y, rstd, pooled
    a = _tail_args(shape, spec, ratio, coff, total_comp, kv, score, ape, cu_seqlens,
                   cu_seqlens_comp, norm_weight, rope_cos, rope_sin)
    a.out = y.data_ptr()
    if spec.norm:
        a.rstd = rstd.data_ptr()
    if keep:
        a.pooled = pooled.data_ptr()
    _checks.aligned({"kv": a.kv, "score": a.score, "ape": a.ape},
                    _ops._offsets(cu_seqlens, cu_seqlens_comp))
    _ops._launch(kv.device.index, "csa_compressor_forward_ex", ctypes.byref(a))
    return y, rstd, pooled


def tail_backward_impl(grad_y: Tensor, kv: Tensor, score: Tensor, ape: Tensor,
                       cu_seqlens: Optional[Tensor], cu_seqlens_comp: Optional[Tensor],
                       norm_weight: Optional[Tensor], rope_cos: Optional[Tensor],
                       rope_sin: Optional[Tensor], pooled: Optional[Tensor], ratio: int,
                       coff: int, eps: float,
                       rope_dim: int, rope_interleaved: bool, hadamard: bool,
                       deterministic: bool,
                       launch: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(grad_kv, grad_score, grad_ape, grad_w)``; grad_w is ``(head_dim,)`` fp32 with the
    norm, else empty, summed as grad_ape is (the fixed order when ``deterministic``)."""
    shape = _checks.inputs(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff)
    spec = tail_spec(shape.head_dim, ratio, kv.device, norm_weight, eps, rope_cos, rope_sin,
                     rope_dim or None, rope_interleaved, hadamard)
    if shape.sbhd:
        total_comp = (shape.seq_len // ratio) * shape.segments
    else:
        total_comp = grad_y.shape[0] if isinstance(grad_y, Tensor) and grad_y.dim() else 0
    _checks.grad_out(grad_y, shape, total_comp, kv.device)
    keep = keeps_pooled(ratio, coff, shape.head_dim, total_comp, spec)
    if keep:
        _check_pooled(pooled, total_comp, shape.head_dim, kv.device)
    grad_kv = _ops.dense_like(kv, shape.kv_stride)
    grad_score = _ops.dense_like(score, shape.score_stride)
    grad_ape = torch.empty_like(ape)
    grad_w = kv.new_empty((shape.head_dim if spec.norm else 0,), dtype=torch.float32)
    if not launch or not kv.is_cuda:
        return grad_kv, grad_score, grad_ape, grad_w
    a = _tail_args(shape, spec, ratio, coff, total_comp, kv, score, ape, cu_seqlens,
                   cu_seqlens_comp, norm_weight, rope_cos, rope_sin)
    a.grad_out, a.grad_kv = grad_y.data_ptr(), grad_kv.data_ptr()
    a.grad_score, a.grad_ape = grad_score.data_ptr(), grad_ape.data_ptr()
    if spec.norm:
        a.grad_norm_weight = grad_w.data_ptr()
    if keep and pooled is not None:
        a.pooled = pooled.data_ptr()
    a.flags = _lib.DETERMINISTIC if deterministic else 0
    _checks.aligned({"kv": a.kv, "score": a.score, "ape": a.ape, "grad_out": a.grad_out},
                    _ops._offsets(cu_seqlens, cu_seqlens_comp))
    _ops._launch(kv.device.index, "csa_compressor_backward_ex", ctypes.byref(a))
    return grad_kv, grad_score, grad_ape, grad_w


@torch.library.custom_op("csa::compress_tail_forward", mutates_args=(), device_types="cuda")
def compress_tail_forward(kv: Tensor, score: Tensor, ape: Tensor, cu_seqlens: Optional[Tensor],
                          cu_seqlens_comp: Optional[Tensor], norm_weight: Optional[Tensor],
                          rope_cos: Optional[Tensor], rope_sin: Optional[Tensor], ratio: int,
                          coff: int, total_comp: int, eps: float, rope_dim: int,
                          rope_interleaved: bool,
                          hadamard: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, rstd, pooled)``: the pooled rows through RMSNorm, RoPE and the Hadamard transform
    (each optional), as :func:`csa.compress` returns them, each row's rstd with the norm, and
    the fp32 pooled rows the backward reads where it reads them (keeps_pooled; else empty)."""
    return tail_forward_impl(kv, score, ape, cu_seqlens, cu_seqlens_comp, norm_weight, rope_cos,
                             rope_sin, ratio, coff, total_comp, eps, rope_dim, rope_interleaved,
                             hadamard)


@compress_tail_forward.register_fake
def _compress_tail_forward_fake(kv: Tensor, score: Tensor, ape: Tensor,
                                cu_seqlens: Optional[Tensor], cu_seqlens_comp: Optional[Tensor],
                                norm_weight: Optional[Tensor], rope_cos: Optional[Tensor],
                                rope_sin: Optional[Tensor], ratio: int, coff: int,
                                total_comp: int, eps: float, rope_dim: int,
                                rope_interleaved: bool,
                                hadamard: bool) -> tuple[Tensor, Tensor, Tensor]:
    return tail_forward_impl(kv, score, ape, cu_seqlens, cu_seqlens_comp, norm_weight, rope_cos,
                             rope_sin, ratio, coff, total_comp, eps, rope_dim, rope_interleaved,
                             hadamard, launch=False)


@torch.library.custom_op("csa::compress_tail_backward", mutates_args=(), device_types="cuda")
def compress_tail_backward(grad_y: Tensor, kv: Tensor, score: Tensor, ape: Tensor,
                           cu_seqlens: Optional[Tensor], cu_seqlens_comp: Optional[Tensor],
                           norm_weight: Optional[Tensor], rope_cos: Optional[Tensor],
                           rope_sin: Optional[Tensor], pooled: Optional[Tensor], ratio: int,
                           coff: int, eps: float,
                           rope_dim: int, rope_interleaved: bool, hadamard: bool,
                           deterministic: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(grad_kv, grad_score, grad_ape, grad_w)`` from grad_y (grad_w: fp32, empty without
    the norm); pooled: the forward's third output (read where the forward keeps it)."""
    return tail_backward_impl(grad_y, kv, score, ape, cu_seqlens, cu_seqlens_comp, norm_weight,
                              rope_cos, rope_sin, pooled, ratio, coff, eps, rope_dim,
                              rope_interleaved, hadamard, deterministic)


@compress_tail_backward.register_fake
def _compress_tail_backward_fake(grad_y: Tensor, kv: Tensor, score: Tensor, ape: Tensor,
                                 cu_seqlens: Optional[Tensor], cu_seqlens_comp: Optional[Tensor],
                                 norm_weight: Optional[Tensor], rope_cos: Optional[Tensor],
                                 rope_sin: Optional[Tensor], pooled: Optional[Tensor],
                                 ratio: int, coff: int, eps: float,
                                 rope_dim: int, rope_interleaved: bool, hadamard: bool,
                                 deterministic: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return tail_backward_impl(grad_y, kv, score, ape, cu_seqlens, cu_seqlens_comp, norm_weight,
                              rope_cos, rope_sin, pooled, ratio, coff, eps, rope_dim,
                              rope_interleaved, hadamard, deterministic, launch=False)


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple[object, ...],
                   output: tuple[Tensor, Tensor, Tensor]) -> None:
    (kv, score, ape, cu, cuc, weight, cos, sin, ratio, coff, _, eps, rope_dim, interleaved,
     hadamard) = inputs
    ctx.save_for_backward(kv, score, ape, cu, cuc, weight, cos, sin, output[2])
    ctx.options = (ratio, coff, eps, rope_dim, interleaved, hadamard)
    # rstd and the pooled rows: saved values, not results to train on
    ctx.mark_non_differentiable(output[1], output[2])


def _backward(ctx: torch.autograd.function.FunctionCtx, grad_y: Tensor,
              _grad_rstd: Optional[Tensor],
              _grad_pooled: Optional[Tensor]) -> tuple[Optional[Tensor], ...]:
    kv, score, ape, cu, cuc, weight, cos, sin, pooled = ctx.saved_tensors
    ratio, coff, eps, rope_dim, interleaved, hadamard = ctx.options
    grad_kv, grad_score, grad_ape, grad_w = torch.ops.csa.compress_tail_backward(
        grad_y.contiguous(), kv, score, ape, cu, cuc, weight, cos, sin, pooled, ratio, coff, eps,
        rope_dim, interleaved, hadamard, torch.are_deterministic_algorithms_enabled())
    grad_weight = grad_w.to(weight.dtype) if weight is not None else None
    return (grad_kv, grad_score, grad_ape, None, None, grad_weight) + (None,) * 9


compress_tail_forward.register_autograd(_backward, setup_context=_setup_context)
