"""csa: fused CUDA kernels for the Compressor of compressed sparse attention (CSA / HCA).

``csa.compress`` pools every ``ratio`` tokens of a packed (THD) sequence into one compressed
KV row with a gated softmax, forward and backward, as one kernel each way. It works under
autograd, ``torch.compile``, CUDA graphs and ``torch.use_deterministic_algorithms``; the ops
behind it are ``torch.ops.csa.compress_forward`` and ``torch.ops.csa.compress_backward``. With
``norm_weight=``, ``rope_cos=`` / ``rope_sin=`` or ``hadamard=True`` it fuses the tail that
follows the pooling (RMSNorm, RoPE, the Hadamard transform) into the same kernels
(``torch.ops.csa.compress_tail_forward`` / ``compress_tail_backward``).
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional, Union

import torch
from torch import Tensor

from . import _checks, _lib, _ops, _tail
from ._lib import Error, LibraryError

__version__ = "0.1.0"
__all__ = ["compress", "compress_backward", "prewarm", "version", "info", "Error",
           "LibraryError", "__version__"]


def compress(kv: Tensor, score: Tensor, ape: Tensor, cu_seqlens: Optional[Tensor] = None,
             cu_seqlens_comp: Optional[Tensor] = None, *, ratio: int, coff: int,
             total_comp: Optional[int] = None, norm_weight: Optional[Tensor] = None,
             eps: float = 1e-6, rope_cos: Optional[Tensor] = None,
             rope_sin: Optional[Tensor] = None, rope_dim: Optional[int] = None,
             rope_interleaved: bool = True, hadamard: bool = False) -> Tensor:
    """Gated-softmax pooling of every ``ratio`` tokens into one compressed row.

    Args:
        kv, score: THD ``(T, coff*head_dim)`` or ``(T, 1, coff*head_dim)`` with offsets, or
            SBHD ``(S, B, coff*head_dim)`` without (every batch column one sequence); bf16,
            fp16 or fp32 (both the same), unit stride in the last dimension, rows any
            aligned distance apart (a slice of a fused projection's output works as is).
        ape: ``(ratio, coff*head_dim)`` fp32 position bias.
        cu_seqlens: ``(B+1,)`` int32 token offsets of the B segments (THD; None for SBHD).
        cu_seqlens_comp: ``(B+1,)`` int32 row offsets; ``cuc[s+1] - cuc[s]`` is the segment's
            length // ratio (THD; None for SBHD).
        ratio: tokens pooled per row, 1..256.
        coff: 2 for the overlapping window (the previous block's first half and the own
            block's second half of the columns), 1 for the own block only.
        total_comp: rows of the output (a static capacity: rows past ``cu_seqlens_comp[-1]``
            are padding rows). None reads ``cu_seqlens_comp[-1]`` (one synchronisation; not
            allowed while a CUDA graph is being captured). SBHD: ``(S // ratio) * B``, its only
            value, which None gives without a synchronisation.

    Returns:
        ``(total_comp, head_dim)``, ``(total_comp, 1, head_dim)`` for rank-3 THD inputs, or
        ``(S // ratio, B, head_dim)`` for SBHD, in kv's dtype.
        Differentiable in kv, score and ape; under
        ``torch.use_deterministic_algorithms(True)`` ape's gradient is summed in a fixed
        order (bitwise run to run).

    The fused tail (each stage optional; head_dim at most 1024, a power of two or, at ratio
    <= 16, a multiple of 32), ``y = H(rope(rmsnorm(x) * w))`` in fp32 with one rounding:
        norm_weight: ``(head_dim,)`` bf16 or fp32 RMSNorm weight (differentiable), with
            ``eps``.
        rope_cos, rope_sin: ``(max_blocks, rope_dim // 2)`` fp32 tables; row ``b`` rotates a
            row of block ``b`` of its segment (position ``b * ratio``; padding rows: block 0;
            rows past the table take its last row). RoPE turns the last ``rope_dim`` columns
            (default ``2 * rope_cos.shape[1]``) in pairs ``(2i, 2i+1)``, or ``(i, i +
            rope_dim/2)`` with ``rope_interleaved=False``.
        hadamard: the Hadamard transform of size head_dim, scaled by ``head_dim ** -0.5``.
        The weight's gradient is summed as ape's is: in a fixed order (bitwise) under
        ``torch.use_deterministic_algorithms(True)``, else atomically where the call's
        schedule adds ape's gradient so.
    """
    if total_comp is None and cu_seqlens_comp is not None:
        total_comp = _static_rows(cu_seqlens_comp)
    # Checked first, so that a wrong argument is a TypeError / ValueError naming it rather
    # than the dispatcher's schema error.
    shape = _checks.inputs(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff)
    if shape.sbhd:
        total_comp = _checks.sbhd_rows(shape, ratio, total_comp)
    _checks.total_comp(total_comp)
    if norm_weight is not None or rope_cos is not None or rope_sin is not None or hadamard or (
            rope_dim is not None):
        spec = _tail.tail_spec(shape.head_dim, ratio, kv.device, norm_weight, eps, rope_cos,
                               rope_sin, rope_dim, rope_interleaved, hadamard)
        y, _, _ = torch.ops.csa.compress_tail_forward(
            kv, score, ape, cu_seqlens, cu_seqlens_comp, norm_weight, rope_cos, rope_sin, ratio,
            coff, total_comp, spec.eps, spec.rope_dim, spec.rope_interleaved, spec.hadamard)
        return y
    if torch.compiler.is_compiling() or type(kv) is not Tensor or not kv.is_cuda:
        return torch.ops.csa.compress_forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio,
                                              coff, total_comp)
    if torch.is_grad_enabled() and (kv.requires_grad or score.requires_grad or ape.requires_grad):
        return _ops.EagerCompress.apply(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff,
                                        total_comp, shape)
    return _ops.forward_impl(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff,
                             total_comp, shape=shape)


def compress_backward(grad_out: Tensor, kv: Tensor, score: Tensor, ape: Tensor,
                      cu_seqlens: Optional[Tensor] = None,
                      cu_seqlens_comp: Optional[Tensor] = None, *, ratio: int, coff: int,
                      deterministic: Optional[bool] = None) -> tuple[Tensor, Tensor, Tensor]:
    """The backward of :func:`compress` on its own, for code that drives its own autograd
    (a custom ``torch.autograd.Function``): ``(grad_kv, grad_score, grad_ape)`` from
    ``grad_out`` (``compress``'s output shape; gradients on padding rows are ignored).
    ``deterministic`` None follows ``torch.are_deterministic_algorithms_enabled()``."""
    shape = _checks.inputs(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff)
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    if torch.compiler.is_compiling() or type(kv) is not Tensor or not kv.is_cuda:
        return torch.ops.csa.compress_backward(grad_out, kv, score, ape, cu_seqlens,
                                               cu_seqlens_comp, ratio, coff, deterministic)
    return _ops.backward_impl(grad_out, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff,
                              deterministic, shape=shape)


def _static_rows(cu_seqlens_comp: object) -> int:
    if not isinstance(cu_seqlens_comp, Tensor):
        raise TypeError(f"cu_seqlens_comp must be a torch.Tensor, got "
                        f"{type(cu_seqlens_comp).__name__}")
    if cu_seqlens_comp.device.type == "meta":
        raise ValueError("total_comp=None reads cu_seqlens_comp[-1], which meta tensors do not "
                         "hold: pass total_comp (the output's row capacity)")
    if cu_seqlens_comp.is_cuda and torch.cuda.is_current_stream_capturing():
        raise ValueError("total_comp=None reads cu_seqlens_comp[-1] from the device, which a "
                         "CUDA graph capture cannot do: pass total_comp, the static row "
                         "capacity of the captured calls (rows past cu_seqlens_comp[-1] are "
                         "padding rows)")
    if cu_seqlens_comp.dim() != 1 or cu_seqlens_comp.numel() < 1:
        raise ValueError(f"cu_seqlens_comp must be 1-D and non-empty, got "
                         f"{tuple(cu_seqlens_comp.shape)}")
    return int(cu_seqlens_comp[-1].item())




def prewarm(*, ratio: Optional[int] = None, coff: Optional[int] = None,
            head_dim: Optional[int] = None, dtype: torch.dtype = torch.bfloat16,
            layout: str = "thd", strided: bool = False,
            device: Union[int, torch.device, None] = None) -> list[dict[str, int]]:
    """Compiles (or loads from the kernel cache) every kernel of one configuration, or of the
    production set when none is given, for a device (default: the current one). Do it before
    capturing CUDA graphs. ``dtype`` (bf16, fp16, fp32) and ``layout`` ("thd", "sbhd") pick
    the kernels; ``strided`` adds those of THD inputs with row strides (views). Returns the
    configurations prewarmed."""
    if dtype not in _checks.DTYPES:
        raise TypeError(f"dtype must be torch.bfloat16, torch.float16 or torch.float32, got "
                        f"{dtype}")
    if layout not in ("thd", "sbhd"):
        raise ValueError(f"layout must be 'thd' or 'sbhd', got {layout!r}")
    given = [x is not None for x in (ratio, coff, head_dim)]
    if any(given) and not all(given):
        raise ValueError("prewarm takes ratio, coff and head_dim together, or none of them "
                         "(the production set)")
    if all(given):
        _checks.config(ratio, coff)
        if not isinstance(head_dim, int) or not 1 <= head_dim <= _checks.MAX_HEAD_DIM:
            raise ValueError(f"head_dim must be an integer in [1, {_checks.MAX_HEAD_DIM}], got "
                             f"{head_dim!r}")
        configs = [{"ratio": ratio, "coff": coff, "head_dim": head_dim}]
    else:
        configs = list(_lib.info()["default_configs"])
    if device is None:
        index = torch.cuda.current_device()
    elif isinstance(device, torch.device):
        if device.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {device}")
        index = device.index if device.index is not None else torch.cuda.current_device()
    elif isinstance(device, int) and not isinstance(device, bool):
        index = device
    else:
        raise TypeError(f"device must be an int or a torch.device, got {type(device).__name__}")
    lib = _lib.library()
    plain = dtype is torch.bfloat16 and layout == "thd" and not strided
    for c in configs:
        if plain:
            _lib.check(lib.csa_prewarm(c["ratio"], c["head_dim"], c["coff"], index))
            continue
        a = _lib.CompressorArgs()
        a.struct_size = _lib.ARGS_SIZE
        a.ratio, a.head_dim, a.coff = c["ratio"], c["head_dim"], c["coff"]
        a.dtype, a.layout = _checks.DTYPES[dtype], 1 if layout == "sbhd" else 0
        a.kv_stride = 1 if strided else 0  # any nonzero stride: the strided kernels too
        _lib.check(lib.csa_prewarm_ex(ctypes.byref(a), index))
    return configs


def version() -> str:
    """The version of the loaded libcsa."""
    return _lib.version()


def info() -> dict[str, Any]:
    """libcsa, NVRTC, driver, devices and kernel-cache state (``csa info --json``'s fields)."""
    return _lib.info()
