"""Argument checks of the Python API, made before anything is launched: TypeError for a wrong
type or dtype, ValueError for a wrong shape, device, layout or value, each naming the
argument. They read only metadata, so they run on meta and fake tensors too."""

from __future__ import annotations

from typing import NamedTuple

import torch

MAX_RATIO = 256
MAX_HEAD_DIM = 4096
_DATA_ALIGN = 16
_OFFSET_ALIGN = 4


class Shape(NamedTuple):
    tokens: int  # rows of kv / score (SBHD: S * B)
    head_dim: int
    width: int
    segments: int  # SBHD: the batch B
    rank3: bool
    dtype: int = 0  # csa_dtype
    sbhd: bool = False
    seq_len: int = 0  # SBHD: S
    kv_stride: int = 0  # elements between rows; 0: dense
    score_stride: int = 0
    plain: bool = True  # bf16, THD, dense rows: the original entry points serve it


# csa_dtype codes of the element types kv, score and out may have.
DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_ELEMENT_BYTES = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}


def _tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _dtype(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise TypeError(f"{name} must be a {dtype} tensor, got {t.dtype}")


def _contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")


def config(ratio: object, coff: object) -> None:
    if not isinstance(ratio, int) or isinstance(ratio, bool) or not 1 <= ratio <= MAX_RATIO:
        raise ValueError(f"ratio must be an integer in [1, {MAX_RATIO}], got {ratio!r}")
    if coff not in (1, 2) or isinstance(coff, bool):
        raise ValueError(f"coff must be 1 or 2, got {coff!r}")


_BF16 = torch.bfloat16
_F32 = torch.float32
_I32 = torch.int32


def inputs(kv: object, score: object, ape: object, cu_seqlens: object, cu_seqlens_comp: object,
           ratio: int, coff: int) -> Shape:
    """Checks the inputs both directions share; returns the call's sizes. One expression
    accepts the common call (bf16, THD, contiguous: it runs on every call); every other call
    takes the detailed checks, which name what a rejected one got wrong."""
    try:
        if (type(ratio) is int and 1 <= ratio <= MAX_RATIO and type(coff) is int
                and (coff == 1 or coff == 2) and kv.dtype is _BF16  # type: ignore[union-attr]
                and score.dtype is _BF16 and ape.dtype is _F32  # type: ignore[union-attr]
                and cu_seqlens.dtype is _I32 and cu_seqlens_comp.dtype is _I32):  # type: ignore
            shape = kv.shape  # type: ignore[union-attr]
            rank = len(shape)
            width = shape[-1] if rank else 0
            device = kv.device  # type: ignore[union-attr]
            if ((rank == 2 or (rank == 3 and shape[1] == 1)) and score.shape == shape
                    and width % coff == 0 and 0 < width // coff <= MAX_HEAD_DIM
                    and ape.shape == (ratio, width) and cu_seqlens.dim() == 1
                    and cu_seqlens.shape[0] >= 1 and cu_seqlens_comp.shape == cu_seqlens.shape
                    and score.device == device and ape.device == device
                    and cu_seqlens.device == device and cu_seqlens_comp.device == device
                    and device.type in ("cuda", "meta") and kv.is_contiguous()
                    and score.is_contiguous() and ape.is_contiguous()
                    and cu_seqlens.is_contiguous() and cu_seqlens_comp.is_contiguous()):
                return Shape(shape[0], width // coff, width, cu_seqlens.shape[0] - 1, rank == 3)
    except AttributeError:
        pass  # not a tensor: explained below
    return _general(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff)


def _row_stride(name: str, t: torch.Tensor, sbhd: bool) -> int:
    """Elements from one row of t to the next (0: dense rows); the last dimension must be
    unit-stride and, in SBHD, the B rows of one step of S evenly spaced."""
    if t.numel() == 0 or t.is_contiguous():
        return 0
    if t.stride(-1) != 1:
        raise ValueError(f"{name}'s last dimension must be unit-stride (stride(-1) == 1), got "
                         f"strides {t.stride()}; call .contiguous() first")
    if not sbhd:
        return t.stride(0)
    seq, batch = t.shape[0], t.shape[1]
    if batch == 1:
        return t.stride(0)
    if seq > 1 and t.stride(0) != batch * t.stride(1):
        raise ValueError(f"{name}'s (S, B) rows must be evenly spaced (stride(0) == "
                         f"B * stride(1)), got strides {t.stride()}")
    return t.stride(1)


def _check_stride(name: str, stride: int, width: int, head_dim: int, dtype: torch.dtype) -> None:
    if stride == 0:
        return
    align = min(16 // _ELEMENT_BYTES[dtype], head_dim & -head_dim)
    if stride < width or stride % align != 0:
        raise ValueError(f"{name}'s rows are {stride} elements apart: they must be at least the "
                         f"row width {width} apart and a multiple of {align} elements (the "
                         f"alignment of dense {dtype} rows of head_dim {head_dim}); call "
                         f".contiguous() first")


def _general(kv: object, score: object, ape: object, cu_seqlens: object,
             cu_seqlens_comp: object, ratio: int, coff: int) -> Shape:
    config(ratio, coff)
    kv = _tensor("kv", kv)
    score = _tensor("score", score)
    ape = _tensor("ape", ape)
    sbhd = cu_seqlens is None and cu_seqlens_comp is None
    if not sbhd and (cu_seqlens is None or cu_seqlens_comp is None):
        raise ValueError("cu_seqlens and cu_seqlens_comp are given together (THD) or both None "
                         "(SBHD)")
    if kv.dtype not in DTYPES:
        raise TypeError(f"kv must be a torch.bfloat16, torch.float16 or torch.float32 tensor, "
                        f"got {kv.dtype}")
    _dtype("score", score, kv.dtype)
    _dtype("ape", ape, torch.float32)
    device = kv.device
    if sbhd:
        if kv.dim() != 3:
            raise ValueError(f"without cu_seqlens kv is SBHD (S, B, coff*head_dim), got "
                             f"{tuple(kv.shape)}")
        seq, batch = kv.shape[0], kv.shape[1]
        if batch < 1:
            raise ValueError(f"kv's batch dimension B must be >= 1, got {tuple(kv.shape)}")
    else:
        cu = _tensor("cu_seqlens", cu_seqlens)
        cuc = _tensor("cu_seqlens_comp", cu_seqlens_comp)
        _dtype("cu_seqlens", cu, torch.int32)
        _dtype("cu_seqlens_comp", cuc, torch.int32)
        if kv.dim() not in (2, 3) or (kv.dim() == 3 and kv.shape[1] != 1):
            raise ValueError(f"kv must be (T, coff*head_dim) or (T, 1, coff*head_dim), got "
                             f"{tuple(kv.shape)}")
    if score.shape != kv.shape:
        raise ValueError(f"score must have kv's shape {tuple(kv.shape)}, got "
                         f"{tuple(score.shape)}")
    width = kv.shape[-1]
    if width % coff != 0:
        raise ValueError(f"kv's last dimension ({width}) must be coff ({coff}) * head_dim")
    head_dim = width // coff
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim = kv.shape[-1] / coff = {head_dim} must be in "
                         f"[1, {MAX_HEAD_DIM}]")
    if ape.shape != (ratio, width):
        raise ValueError(f"ape must be (ratio, coff*head_dim) = ({ratio}, {width}), got "
                         f"{tuple(ape.shape)}")
    others: list[tuple[str, torch.Tensor]] = [("score", score), ("ape", ape)]
    if not sbhd:
        if cu.dim() != 1 or cu.numel() < 1:
            raise ValueError(f"cu_seqlens must be 1-D with num_segments + 1 >= 1 entries, got "
                             f"{tuple(cu.shape)}")
        if cuc.shape != cu.shape:
            raise ValueError(f"cu_seqlens_comp must have cu_seqlens' shape {tuple(cu.shape)}, "
                             f"got {tuple(cuc.shape)}")
        others += [("cu_seqlens", cu), ("cu_seqlens_comp", cuc)]
    for name, t in others:
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but kv is on {device}: all inputs must "
                             f"be on one device")
    if device.type not in ("cuda", "meta"):
        raise ValueError(f"kv must be on a CUDA device (or meta, for shape inference), got "
                         f"{device}")
    for name, t in others[1:]:
        _contiguous(name, t)
    kv_stride = _row_stride("kv", kv, sbhd)
    score_stride = _row_stride("score", score, sbhd)
    _check_stride("kv", kv_stride, width, head_dim, kv.dtype)
    _check_stride("score", score_stride, width, head_dim, kv.dtype)
    plain = kv.dtype is _BF16 and not sbhd and kv_stride == 0 and score_stride == 0
    if sbhd:
        return Shape(seq * batch, head_dim, width, batch, True, DTYPES[kv.dtype], True, seq,
                     kv_stride, score_stride, plain)
    return Shape(kv.shape[0], head_dim, width, cu.shape[0] - 1, kv.dim() == 3, DTYPES[kv.dtype],
                 False, 0, kv_stride, score_stride, plain)


def total_comp(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"total_comp must be a non-negative integer, got {value!r}")
    return value


def out_shape(shape: Shape, total_comp: int) -> tuple[int, ...]:
    """compress's output: (total_comp, d), (total_comp, 1, d), or SBHD (S // ratio, B, d)."""
    if shape.sbhd:
        return (total_comp // shape.segments, shape.segments, shape.head_dim)
    return (total_comp, 1, shape.head_dim) if shape.rank3 else (total_comp, shape.head_dim)


def sbhd_rows(shape: Shape, ratio: int, total: object) -> int:
    """total_comp of an SBHD call: (S // ratio) * B, the only value it can have."""
    rows = (shape.seq_len // ratio) * shape.segments
    if total is not None and total != rows:
        raise ValueError(f"total_comp of SBHD inputs (S={shape.seq_len}, B={shape.segments}) is "
                         f"(S // ratio) * B = {rows}, got {total!r}")
    return rows


_TYPES = {0: torch.bfloat16, 1: torch.float16, 2: torch.float32}


def grad_out(g: object, shape: Shape, total: int, device: torch.device) -> torch.Tensor:
    expected = out_shape(shape, total)
    dtype = _TYPES[shape.dtype]
    if (isinstance(g, torch.Tensor) and g.dtype is dtype and g.shape == expected
            and g.device == device and g.is_contiguous()):
        return g
    g = _tensor("grad_out", g)
    _dtype("grad_out", g, dtype)
    if tuple(g.shape) != expected:
        raise ValueError(f"grad_out must be {expected}, got {tuple(g.shape)}")
    if g.device != device:
        raise ValueError(f"grad_out is on {g.device} but kv is on {device}")
    _contiguous("grad_out", g)
    return g


def aligned(data: dict[str, int], offsets: dict[str, int]) -> None:
    """Data pointers (of real tensors): 16 bytes for data, 4 for the offsets. `data` and
    `offsets` map names to data_ptr()s; empty tensors may hold any pointer."""
    mask = 0
    for ptr in data.values():
        mask |= ptr
    omask = 0
    for ptr in offsets.values():
        omask |= ptr
    if mask % _DATA_ALIGN == 0 and omask % _OFFSET_ALIGN == 0:
        return
    for names, align in ((data, _DATA_ALIGN), (offsets, _OFFSET_ALIGN)):
        for name, ptr in names.items():
            if ptr % align != 0:
                raise ValueError(f"{name} (data_ptr {ptr:#x}) is not {align}-byte aligned; pass "
                                 f"a tensor that starts at an aligned offset (.clone() one)")
