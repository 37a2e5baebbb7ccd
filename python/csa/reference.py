"""The PyTorch region csa replaces, in plain eager PyTorch with fp32 intermediates (the
comparator of csa's numerics contract): gather each row's window, add the position bias,
softmax over the window in fp32, weight and sum in fp32, one rounding to the input dtype.
Differentiable by autograd; slow (it materialises every window). Also the tail that follows
the pooling (RMSNorm, RoPE, Hadamard), fused in fp32 or unfused as trainers run it today."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["block_index", "compress_eager", "compress_megatron_thd", "tail_eager", "tail_unfused"]


def compress_eager(kv: Tensor, score: Tensor, ape: Tensor, cu_seqlens: Tensor,
                   cu_seqlens_comp: Tensor, *, ratio: int, coff: int, total_comp: int,
                   serial: bool = False) -> Tensor:
    """The same contract as :func:`csa.compress` (padding rows past ``cu_seqlens_comp[-1]``
    are block 0 of a segment starting at token 0). ``serial``: the softmax's denominator and
    the weighted sum add the window's slots one after the other, in slot order (the previous
    block's first), as the numerics contract's fp32 reference does; otherwise as
    ``torch.softmax`` and ``.sum`` reduce."""
    rank3 = kv.dim() == 3
    width = kv.shape[-1]
    kv2 = kv.reshape(-1, width)
    score2 = score.reshape(-1, width)
    device = kv.device
    cu = cu_seqlens.long()
    cuc = cu_seqlens_comp.long()
    segments = cu.numel() - 1
    rows = torch.arange(total_comp, device=device)
    # The segment of each row: how many segment ends lie at or before it (a comparison rather
    # than bucketize, which inductor cannot lower over a slice).
    seg = (rows[:, None] >= cuc[None, 1:]).sum(dim=1).clamp(max=max(segments - 1, 0))
    valid = rows < cuc[-1]
    block = torch.where(valid, rows - cuc[seg], torch.zeros_like(rows))
    start = torch.where(valid, cu[seg] + block * ratio, torch.zeros_like(rows))
    index = start[:, None] + torch.arange(ratio, device=device)[None, :]  # (rows, ratio)
    kv_w = kv2[index].float()
    score_w = score2[index].float() + ape[None]
    if coff == 2:
        d = width // 2
        first = (block == 0)[:, None, None]
        # The previous block's first-half columns: the row before (the same segment's previous
        # block), or nothing for a segment's first block.
        prev_kv = torch.roll(kv_w[..., :d], shifts=1, dims=0).masked_fill(first, 0.0)
        prev_score = torch.roll(score_w[..., :d], shifts=1, dims=0).masked_fill(
            first, float("-inf"))
        kv_w = torch.cat([prev_kv, kv_w[..., d:]], dim=1)
        score_w = torch.cat([prev_score, score_w[..., d:]], dim=1)
    if serial:
        e = torch.exp(score_w - score_w.amax(dim=1, keepdim=True))
        den = e[:, 0]
        for k in range(1, e.shape[1]):
            den = den + e[:, k]
        weights = e / den[:, None]
        acc = kv_w[:, 0] * weights[:, 0]
        for k in range(1, e.shape[1]):
            acc = acc + kv_w[:, k] * weights[:, k]
        out = acc.to(kv.dtype)
    else:
        weights = torch.softmax(score_w, dim=1)
        out = (kv_w * weights).sum(dim=1).to(kv.dtype)
    return out.unsqueeze(1) if rank3 else out


def compress_megatron_thd(kv: Tensor, score: Tensor, ape: Tensor, cu_seqlens: Tensor,
                          cu_seqlens_comp: Tensor, *, ratio: int, coff: int,
                          total_comp: int) -> Tensor:
    """The same region in the op sequence of Megatron-LM's THD Compressor (its eager path,
    and what ``torch.compile`` of that code sees): an index gather of (rows, ratio) windows,
    the position bias added in fp32, the overlap transform by filling a new (rows, 2*ratio)
    window, an fp32 softmax whose weights are rounded to bf16, bf16 products and a sum. Its
    numerics differ from the fp32 comparator (weights and products rounded): for speed
    comparisons, not for the contract."""
    rank3 = kv.dim() == 3
    width = kv.shape[-1]
    kv3 = kv.reshape(-1, 1, width)
    score3 = score.reshape(-1, 1, width)
    device = kv.device
    cuc = cu_seqlens_comp
    rows = torch.arange(total_comp, device=device, dtype=cuc.dtype)
    segments = cuc.numel() - 1
    batch = (rows[:, None] >= cuc[None, 1:]).sum(dim=1).clamp(max=max(segments - 1, 0))
    valid = rows < cuc[-1]
    local = torch.where(valid, rows - cuc[batch], torch.zeros_like(rows))
    base = cu_seqlens[batch].unsqueeze(1) + local.unsqueeze(1) * ratio
    base = torch.where(valid.unsqueeze(1), base, torch.zeros_like(base))
    index = base + torch.arange(ratio, device=device, dtype=base.dtype).unsqueeze(0)
    kv_g = kv3[index]  # (rows, ratio, 1, width)
    score_g = score3[index] + ape.view(1, ratio, 1, -1)
    if coff == 2:
        first = local == 0
        kv_g = _overlap(kv_g, first, 0.0)
        score_g = _overlap(score_g, first, float("-inf"))
    weights = torch.softmax(score_g, dim=1, dtype=torch.float32).to(kv_g.dtype)
    out = (kv_g * weights).sum(dim=1)
    return out if rank3 else out.squeeze(1)


def _overlap(t: Tensor, first: Tensor, fill: float) -> Tensor:
    rows, ratio, _, width = t.shape
    d = width // 2
    new = t.new_full((rows, 2 * ratio, 1, d), fill)
    new[:, ratio:] = t[:, :, :, d:]
    prev = torch.roll(t[:, :, :, :d], shifts=1, dims=0)
    prev[first] = fill
    new[:, :ratio] = prev
    return new


def block_index(cu_seqlens_comp: Tensor, total_comp: int) -> Tensor:
    """Each of ``total_comp`` THD output rows' block index in its segment (its position is
    ``block * ratio``); padding rows past ``cu_seqlens_comp[-1]`` are block 0. For SBHD rows
    ``i * B + b`` the block is ``i``."""
    cuc = cu_seqlens_comp.long()
    rows = torch.arange(total_comp, device=cuc.device)
    segments = cuc.numel() - 1
    seg = (rows[:, None] >= cuc[None, 1:]).sum(dim=1).clamp(max=max(segments - 1, 0))
    valid = rows < cuc[-1]
    return torch.where(valid, rows - cuc[seg], torch.zeros_like(rows))


def _rope_pairs(d: int, rope_dim: int, interleaved: bool) -> tuple[Tensor, Tensor]:
    first = d - rope_dim
    i = torch.arange(rope_dim // 2)
    if interleaved:
        return first + 2 * i, first + 2 * i + 1
    return first + i, first + i + rope_dim // 2


def _hadamard(x: Tensor) -> Tensor:
    """The Sylvester transform over the last dim (a power of two), scaled by d^-1/2: log2(d)
    butterfly stages (a + b, a - b) with strides 1, 2, 4, ..., then one product."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"hadamard: head_dim {d} is not a power of two")
    lead = x.shape[:-1]
    h = 1
    while h < d:
        y = x.reshape(*lead, d // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = torch.stack([a + b, a - b], dim=-2).reshape(*lead, d)
        h *= 2
    return x * torch.tensor(d ** -0.5, dtype=x.dtype, device=x.device)


def _rope(y: Tensor, block: Tensor, cos: Tensor, sin: Tensor, rope_dim: int,
          interleaved: bool) -> Tensor:
    ia, ib = _rope_pairs(y.shape[-1], rope_dim, interleaved)
    ia, ib = ia.to(y.device), ib.to(y.device)
    c = cos[block].to(y.dtype)
    s = sin[block].to(y.dtype)
    a, b = y[:, ia], y[:, ib]
    y = y.clone()
    y[:, ia] = a * c - b * s
    y[:, ib] = a * s + b * c
    return y


def tail_eager(x: Tensor, block: Tensor, *, norm_weight: Tensor | None = None,
               eps: float = 1e-6, rope_cos: Tensor | None = None,
               rope_sin: Tensor | None = None, rope_dim: int = 0,
               rope_interleaved: bool = True, hadamard: bool = False,
               out_dtype: torch.dtype | None = None) -> Tensor:
    """``y = H(rope(rmsnorm(x) * w))`` of pooled rows ``x`` ``(rows, d)`` in fp32 with one
    rounding to ``out_dtype`` (default ``x.dtype``): the comparator of csa's fused tail. Pass
    the unrounded pooled rows (``compress_eager`` of fp32 inputs). ``block``: each row's block
    index in its segment (:func:`block_index`); ``rope_cos``/``rope_sin``:
    ``(max_blocks, rope_dim // 2)`` tables; RoPE rotates the last ``rope_dim`` columns in pairs
    ``(2i, 2i+1)``, or ``(i, i + rope_dim/2)`` with ``rope_interleaved=False``. fp64 rows are
    computed in fp64 (the oracle). Differentiable by autograd (``norm_weight`` too)."""
    out_dtype = out_dtype or x.dtype
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32  # fp64: an oracle
    y = x.to(compute)
    if norm_weight is not None:
        rstd = torch.rsqrt(y.pow(2).mean(dim=-1, keepdim=True) + eps)
        y = (y * rstd) * norm_weight.to(compute)
    if rope_dim:
        if rope_cos is None or rope_sin is None:
            raise ValueError("rope_dim needs rope_cos and rope_sin")
        y = _rope(y, block, rope_cos.to(compute), rope_sin.to(compute), rope_dim,
                  rope_interleaved)
    if hadamard:
        y = _hadamard(y)
    return y.to(out_dtype)


def tail_unfused(pooled: Tensor, block: Tensor, *, norm_weight: Tensor | None = None,
                 eps: float = 1e-6, rope_cos: Tensor | None = None,
                 rope_sin: Tensor | None = None, rope_dim: int = 0,
                 rope_interleaved: bool = True, hadamard: bool = False) -> Tensor:
    """The same tail as a PyTorch trainer runs it today, one op after the other on the rounded
    pooled rows: RMSNorm in fp32 rounded to the rows' dtype, RoPE with the tables cast to that
    dtype (its products rounded), the Hadamard transform in that dtype."""
    dtype = pooled.dtype
    y = pooled
    if norm_weight is not None:
        rstd = torch.rsqrt(y.float().pow(2).mean(dim=-1, keepdim=True) + eps)
        y = ((y.float() * rstd) * norm_weight.float()).to(dtype)
    if rope_dim:
        if rope_cos is None or rope_sin is None:
            raise ValueError("rope_dim needs rope_cos and rope_sin")
        y = _rope(y, block, rope_cos.to(dtype), rope_sin.to(dtype), rope_dim, rope_interleaved)
    if hadamard:
        y = _hadamard(y)
    return y
