"""Seeded THD packs for the tests: kv, grad ~ N(0, 1), score ~ N(0, 1.5^2), ape ~ N(0, 0.25^2),
ragged segments with empty and short ones, and spare row capacity (padding rows)."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Optional, Sequence

import torch


def seed() -> int:
    """CSA_TEST_SEED, else a fresh one (tests print it on failure)."""
    value = os.environ.get("CSA_TEST_SEED")
    return int(value) if value else random.SystemRandom().randrange(1 << 31)


@dataclass
class Pack:
    kv: torch.Tensor
    score: torch.Tensor
    ape: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_comp: torch.Tensor
    total_comp: int
    ratio: int
    coff: int
    head_dim: int
    seed: int

    @property
    def rows(self) -> int:
        return int(self.cu_seqlens_comp[-1])

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.kv, self.score, self.ape, self.cu_seqlens, self.cu_seqlens_comp

    def describe(self) -> str:
        lens = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()
        return (f"ratio={self.ratio} coff={self.coff} head_dim={self.head_dim} lens={lens} "
                f"total_comp={self.total_comp} seed={self.seed} (CSA_TEST_SEED)")


def make_pack(ratio: int, coff: int, head_dim: int, lens: Sequence[int], *,
              spare_rows: int = 3, spare_tokens: int = 5, device: str = "cuda",
              seed_value: Optional[int] = None, rank3: bool = False,
              requires_grad: bool = False) -> Pack:
    s = seed() if seed_value is None else seed_value
    g = torch.Generator().manual_seed(s)
    width = coff * head_dim
    cu = [0]
    cuc = [0]
    for n in lens:
        cu.append(cu[-1] + n)
        cuc.append(cuc[-1] + n // ratio)
    tokens = max(cu[-1] + spare_tokens, ratio)
    shape = (tokens, 1, width) if rank3 else (tokens, width)
    kv = torch.randn(shape, generator=g).to(torch.bfloat16)
    score = (1.5 * torch.randn(shape, generator=g)).to(torch.bfloat16)
    ape = 0.25 * torch.randn(ratio, width, generator=g)
    tensors = [t.to(device) for t in (kv, score, ape)]
    if requires_grad:
        for t in tensors:
            t.requires_grad_(True)
    return Pack(tensors[0], tensors[1], tensors[2],
                torch.tensor(cu, dtype=torch.int32, device=device),
                torch.tensor(cuc, dtype=torch.int32, device=device), cuc[-1] + spare_rows,
                ratio, coff, head_dim, s)


def ragged_lens(ratio: int) -> list[int]:
    """Empty, shorter than ratio, with tails, and long segments."""
    return [0, max(ratio - 1, 0), 5 * ratio + 3, 2 * ratio, 0, 11 * ratio + ratio // 2 + 1]
