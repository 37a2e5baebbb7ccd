"""csa in Megatron-style code: a Compressor module on a THD pack, and a drop-in for the fused
dispatch of Megatron's Compressor (kv/score (T, 1, coff*d), ape, cu_seqlens, cu_seqlens_comp
and the static capacity in, (total_comp, 1, d) out).

    python examples/megatron_compressor.py      # a few training steps (GPU), or shapes (CPU)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import csa


def compressed_offsets(cu_seqlens: Tensor, ratio: int) -> Tensor:
    """cu_seqlens_comp of a pack: each segment gives length // ratio rows (on the device, no
    synchronisation)."""
    rows = torch.div(cu_seqlens[1:] - cu_seqlens[:-1], ratio, rounding_mode="floor")
    return torch.cat([cu_seqlens.new_zeros(1), torch.cumsum(rows, 0).to(cu_seqlens.dtype)])


def static_capacity(total_tokens: int, num_segments: int, max_seqlen: int, ratio: int) -> int:
    """Megatron's host-known row bound of a pack (no synchronisation)."""
    return min(total_tokens // ratio, num_segments * (max_seqlen // ratio))


def compress_thd(kv: Tensor, score: Tensor, ape: Tensor, cu_seqlens: Tensor,
                 cu_seqlens_comp: Tensor, total_comp: int, overlap: bool) -> Tensor:
    """The fused-dispatch region of Megatron's Compressor._forward_thd: patch it in where the
    module would call its fused kernel (it runs on every GPU csa supports, under
    torch.compile and deterministic mode too)."""
    return csa.compress(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio=ape.shape[0],
                        coff=2 if overlap else 1, total_comp=total_comp)


class Compressor(nn.Module):
    """wkv and wgate projections, the position bias, csa's pooling and RMSNorm over head_dim:
    (T, 1, hidden) tokens to (total_comp, 1, head_dim) compressed rows."""

    def __init__(self, hidden: int, head_dim: int, ratio: int, *, eps: float = 1e-6,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.ratio = ratio
        self.overlap = ratio == 4
        coff = 2 if self.overlap else 1
        self.linear_wkv = nn.Linear(hidden, coff * head_dim, bias=False, device=device,
                                    dtype=dtype)
        self.linear_wgate = nn.Linear(hidden, coff * head_dim, bias=False, device=device,
                                      dtype=dtype)
        self.ape = nn.Parameter(torch.empty(ratio, coff * head_dim, device=device,
                                            dtype=torch.float32))
        self.norm = nn.RMSNorm(head_dim, eps=eps, device=device, dtype=dtype)
        if self.ape.device.type != "meta":
            nn.init.normal_(self.ape, std=0.25)

    def forward(self, x: Tensor, cu_seqlens: Tensor, cu_seqlens_comp: Tensor,
                total_comp: int) -> Tensor:
        kv = self.linear_wkv(x)
        score = self.linear_wgate(x)
        pooled = compress_thd(kv, score, self.ape, cu_seqlens, cu_seqlens_comp, total_comp,
                              self.overlap)
        return self.norm(pooled)


def _demo() -> None:
    device = "cuda" if torch.cuda.is_available() else "meta"
    lens = [1000, 4096, 3000]
    cu = torch.tensor([0, 1000, 5096, 8096], dtype=torch.int32, device=device)
    model = Compressor(hidden=256, head_dim=128, ratio=4, device=device)
    cap = static_capacity(8096, 3, max(lens), 4)
    x = torch.randn(8096, 1, 256, device=device, dtype=torch.bfloat16)
    if device == "meta":
        cuc = torch.empty_like(cu)
        out = model(x, cu, cuc, cap)
        out.float().sum().backward()
        print(f"meta: out {tuple(out.shape)}, ape grad {tuple(model.ape.grad.shape)}")
        return
    cuc = compressed_offsets(cu, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    target = torch.randn(cap, 1, 128, device=device, dtype=torch.bfloat16)
    for step in range(5):
        loss = (model(x, cu, cuc, cap).float() - target.float()).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step}: loss {loss.item():.5f}")


if __name__ == "__main__":
    _demo()
