#!/usr/bin/env python3
"""Eight ranks on one node sharing one cold kernel cache (torchrun, NCCL, NVLink multicast
off): every rank prewarms into the same directory, then trains the tiny model of the Python
tests (projections, csa.compress, a readout) under DistributedDataParallel; rank 0 replays the
same global batch on one GPU and compares the losses, and checks the cache directory.

    torchrun --nproc-per-node 8 tools/dist_train.py --cache DIR --out result.json [--prebuilt]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

for var, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                   ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(var, value)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import csa  # noqa: E402

RATIO, COFF, HEAD_DIM, HIDDEN = 4, 2, 128, 96
LENS = [512, 300, 1024]


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1234)
        w = COFF * HEAD_DIM
        self.wkv = torch.nn.Linear(HIDDEN, w, bias=False, dtype=torch.bfloat16)
        self.wgate = torch.nn.Linear(HIDDEN, w, bias=False, dtype=torch.bfloat16)
        self.ape = torch.nn.Parameter(0.25 * torch.randn(RATIO, w))
        self.readout = torch.nn.Linear(HEAD_DIM, 1, bias=False, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor, cu: torch.Tensor, cuc: torch.Tensor,
                rows: int) -> torch.Tensor:
        pooled = csa.compress(self.wkv(x), self.wgate(x), self.ape, cu, cuc, ratio=RATIO,
                              coff=COFF, total_comp=rows)
        return self.readout(pooled).float()


def shard(rank: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(100 + rank)
    tokens = sum(LENS)
    cu = torch.tensor([0] + [sum(LENS[:i + 1]) for i in range(len(LENS))], dtype=torch.int32)
    cuc = torch.tensor([0] + [sum(n // RATIO for n in LENS[:i + 1]) for i in range(len(LENS))],
                       dtype=torch.int32)
    x = torch.randn(tokens, HIDDEN, generator=g).bfloat16()
    target = torch.randn(int(cuc[-1]), 1, generator=g)
    return tuple(t.to(device) for t in (x, cu, cuc, target))


def loss_of(model: torch.nn.Module, data: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, cu, cuc, target = data
    return (model(x, cu, cuc, target.shape[0]) - target).pow(2).mean()


def check_cache(directory: Path) -> dict[str, object]:
    entries, temps, foreign = [], [], []
    for f in sorted(directory.iterdir()) if directory.is_dir() else []:
        if ".tmp." in f.name:
            temps.append(f.name)
        elif re.fullmatch(r"[A-Za-z0-9_.-]+-[0-9a-f]{32}\.cubin", f.name):
            if f.read_bytes()[:8] == b"CSACUB01":
                entries.append(f.name)
            else:
                foreign.append(f.name)
        else:
            foreign.append(f.name)
    keys = [e.rsplit("-", 1)[1] for e in entries]
    return {"entries": len(entries), "distinct_keys": len(set(keys)), "temp_files": temps,
            "invalid": foreign}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", required=True, help="the shared cache directory (cold)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prebuilt", action="store_true", help="search the prebuilt layer")
    args = ap.parse_args()
    os.environ["CSA_CACHE_DIR"] = args.cache
    os.environ["CSA_PREBUILT_KERNELS"] = "1" if args.prebuilt else "0"
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)

    dist.barrier()
    start = time.perf_counter()
    csa.prewarm(device=local)  # the production set
    csa.prewarm(ratio=RATIO, coff=COFF, head_dim=HEAD_DIM, device=local)
    cold_start = time.perf_counter() - start

    model = Tiny().to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    data = shard(rank, device)
    losses = []
    for _ in range(args.steps):
        loss = loss_of(ddp, data)
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        losses.append(mean.item())
    starts = [None] * world
    dist.all_gather_object(starts, cold_start)
    if rank == 0:
        # The same global batch on one GPU: the mean of the shards' losses.
        single = Tiny().to(device)
        sopt = torch.optim.SGD(single.parameters(), lr=0.05)
        shards = [shard(r, device) for r in range(world)]
        reference = []
        for _ in range(args.steps):
            loss = torch.stack([loss_of(single, s) for s in shards]).mean()
            sopt.zero_grad()
            loss.backward()
            sopt.step()
            reference.append(loss.item())
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
        result = {"world": world, "prebuilt": args.prebuilt, "cold_start_s": starts,
                  "losses": losses, "single_gpu_losses": reference, "worst_relative": worst,
                  "cache": check_cache(Path(args.cache))}
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(json.dumps({k: v for k, v in result.items() if "losses" not in k}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
