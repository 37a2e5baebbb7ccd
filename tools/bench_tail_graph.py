#!/usr/bin/env python3
"""The fused tail in CUDA graphs against csa's plain pooling followed by the fastest unfused
tail, on one GPU, in one run.

Per shape, forward and forward + backward as a trainer runs them, each captured in one CUDA
graph over input sets rotated past the L2, time per call (median of replays):

- fused:    ``torch.ops.csa.compress_tail_forward`` then ``compress_tail_backward``;
- unfused:  ``torch.ops.csa.compress_forward`` (the pooled rows in bf16), the tail
            (RMSNorm, RoPE, Hadamard: ``csa.reference.tail_eager`` in fp32 with one rounding)
            under ``torch.compile(fullgraph=True)`` with its backward by autograd, then
            ``torch.ops.csa.compress_backward`` from the pooled rows' gradient.

    python3 tools/bench_tail_graph.py [--shape 4,2,128,1x4096 ...] [--save out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from typing import Callable

import torch

import csa
from csa.reference import block_index, tail_eager

# (shape, rope_dim, hadamard): the production tails
CASES = [("4,2,512,1x4096", 64, False), ("4,2,128,1x4096", 64, True),
         ("128,1,512,1x4096", 64, False)]
TARGET_SPEEDUP = 1.5
EPS = 1e-6

Set = dict[str, torch.Tensor]


def parse_shape(text: str) -> tuple[int, int, int, list[int]]:
    ratio, coff, d, pack = text.split(",")
    count, length = pack.split("x")
    return int(ratio), int(coff), int(d), [int(length)] * int(count)


def make_set(ratio: int, coff: int, d: int, lens: list[int], rope_dim: int,
             gen: torch.Generator) -> Set:
    w = coff * d
    cu = torch.tensor([0] + torch.cumsum(torch.tensor(lens), 0).tolist(), dtype=torch.int32)
    cuc = torch.tensor([0] + torch.cumsum(torch.tensor(lens) // ratio, 0).tolist(),
                       dtype=torch.int32)
    total_comp = int(cuc[-1])
    blocks = max(lens) // ratio + 1
    pos = torch.arange(blocks, dtype=torch.float64)[:, None]
    freq = 10000.0 ** (-2 * torch.arange(rope_dim // 2, dtype=torch.float64) / rope_dim)
    return {
        "kv": torch.randn(sum(lens), w, generator=gen, device="cuda").bfloat16(),
        "score": (1.5 * torch.randn(sum(lens), w, generator=gen, device="cuda")).bfloat16(),
        "ape": 0.25 * torch.randn(ratio, w, generator=gen, device="cuda"),
        "cu": cu.cuda(),
        "cuc": cuc.cuda(),
        "w": (1 + 0.1 * torch.randn(d, generator=gen, device="cuda")).requires_grad_(True),
        "cos": (pos * freq).cos().float().cuda(),
        "sin": (pos * freq).sin().float().cuda(),
        "block": block_index(cuc.cuda(), total_comp),
        "grad": torch.randn(total_comp, d, generator=gen, device="cuda").bfloat16(),
    }


def fused(ratio: int, coff: int, total_comp: int, rope_dim: int, hadamard: bool
          ) -> Callable[[Set, bool], object]:
    def call(s: Set, backward: bool) -> object:
        with torch.no_grad():
            y, _, pooled = torch.ops.csa.compress_tail_forward(
                s["kv"], s["score"], s["ape"], s["cu"], s["cuc"], s["w"], s["cos"], s["sin"],
                ratio, coff, total_comp, EPS, rope_dim, True, hadamard)
            if not backward:
                return y
            return torch.ops.csa.compress_tail_backward(
                s["grad"], s["kv"], s["score"], s["ape"], s["cu"], s["cuc"], s["w"], s["cos"],
                s["sin"], pooled if pooled.numel() else None, ratio, coff, EPS, rope_dim, True,
                hadamard, False)
    return call


def unfused(ratio: int, coff: int, total_comp: int, rope_dim: int, hadamard: bool
            ) -> Callable[[Set, bool], object]:
    def tail(x: torch.Tensor, block: torch.Tensor, w: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> torch.Tensor:
        return tail_eager(x, block, norm_weight=w, eps=EPS, rope_cos=cos, rope_sin=sin,
                          rope_dim=rope_dim, hadamard=hadamard)

    compiled = torch.compile(tail, fullgraph=True, dynamic=False)

    def call(s: Set, backward: bool) -> object:
        with torch.no_grad():
            pooled = torch.ops.csa.compress_forward(s["kv"], s["score"], s["ape"], s["cu"],
                                                    s["cuc"], ratio, coff, total_comp)
        if not backward:
            with torch.no_grad():
                return compiled(pooled, s["block"], s["w"], s["cos"], s["sin"])
        x = pooled.requires_grad_(True)
        y = compiled(x, s["block"], s["w"], s["cos"], s["sin"])
        grad_x, grad_w = torch.autograd.grad(y, (x, s["w"]), s["grad"])
        with torch.no_grad():
            grads = torch.ops.csa.compress_backward(grad_x, s["kv"], s["score"], s["ape"],
                                                    s["cu"], s["cuc"], ratio, coff, False)
        return grads, grad_w
    return call


def graph_us(call: Callable[[Set, bool], object], sets: list[Set], backward: bool,
             reps: int = 9) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            for s in sets:
                call(s, backward)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for s in sets:
            call(s, backward)
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / len(sets))
    del graph
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--save", help="write the results as JSON to this file")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--shape", action="append", choices=[case[0] for case in CASES],
                    help="only this production shape (repeatable; default: all)")
    args = ap.parse_args()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, csa "
          f"{csa.version()}")
    print(f"{'shape':<18} {'tail':<22} {'dir':<4} {'fused us':>9} {'unfused us':>11} "
          f"{'speedup':>8}")
    rows = []
    for shape, rope_dim, hadamard in CASES:
        if args.shape and shape not in args.shape:
            continue
        ratio, coff, d, lens = parse_shape(shape)
        total_comp = sum(n // ratio for n in lens)
        bytes_per_call = 2 * sum(lens) * coff * d * 2 * 2 + total_comp * d * 2 * 3
        sets = [make_set(ratio, coff, d, lens, rope_dim, gen)
                for _ in range(max(2, min(32, math.ceil(3 * l2 / bytes_per_call))))]
        csa.prewarm(ratio=ratio, coff=coff, head_dim=d)
        torch._dynamo.reset()
        label = "norm+rope64" + ("+hadamard" if hadamard else "")
        impls = {"fused": fused(ratio, coff, total_comp, rope_dim, hadamard),
                 "unfused": unfused(ratio, coff, total_comp, rope_dim, hadamard)}
        for backward in (False, True):
            t = {name: graph_us(call, sets, backward) for name, call in impls.items()}
            speedup = t["unfused"] / t["fused"]
            direction = "f+b" if backward else "fwd"
            print(f"{shape:<18} {label:<22} {direction:<4} {t['fused']:>9.2f} "
                  f"{t['unfused']:>11.2f} {speedup:>8.3f}")
            rows.append({"shape": shape, "tail": label, "direction": direction,
                         "fused_us": t["fused"], "unfused_us": t["unfused"],
                         "speedup": speedup,
                         "meets_target": (not backward) or speedup >= TARGET_SPEEDUP})
    if args.save:
        with open(args.save, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "target_speedup_fwd_bwd": TARGET_SPEEDUP, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
