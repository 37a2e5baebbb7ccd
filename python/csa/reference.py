"""The PyTorch region csa replaces, in plain eager PyTorch with fp32 intermediates (the
comparator of csa's numerics contract): gather each row's window, add the position bias,
softmax over the window in fp32, weight and sum in fp32, one rounding to the input dtype.
Differentiable by autograd; slow (it materialises every window)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["compress_eager"]


def compress_eager(kv: Tensor, score: Tensor, ape: Tensor, cu_seqlens: Tensor,
                   cu_seqlens_comp: Tensor, *, ratio: int, coff: int,
                   total_comp: int) -> Tensor:
    """The same contract as :func:`csa.compress` (padding rows past ``cu_seqlens_comp[-1]``
    are block 0 of a segment starting at token 0)."""
    rank3 = kv.dim() == 3
    width = kv.shape[-1]
    kv2 = kv.reshape(-1, width)
    score2 = score.reshape(-1, width)
    device = kv.device
    cu = cu_seqlens.long()
    cuc = cu_seqlens_comp.long()
    segments = cu.numel() - 1
    rows = torch.arange(total_comp, device=device)
    seg = torch.bucketize(rows, cuc[1:], right=True).clamp(max=max(segments - 1, 0))
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
    weights = torch.softmax(score_w, dim=1)
    out = (kv_w * weights).sum(dim=1).to(kv.dtype)
    return out.unsqueeze(1) if rank3 else out
