#!/usr/bin/env python3
"""csa.compress against the eager PyTorch region and torch.compile of that region, on one GPU.

Per shape: the wall clock per call of the forward and of forward + backward (back-to-back calls
on the current stream, inputs requiring grad, the backward through torch.autograd as in
training; for csa also its two functions called directly, as a custom autograd.Function
would), and the time per call of each captured in a CUDA graph over input sets rotated past
the L2 (the DRAM-bound figure, as `csa bench` measures its kernels). The region is measured in
two forms: the fp32 comparator of csa.reference and the op sequence of Megatron-LM's THD
Compressor (compress_megatron_thd), each eager and under torch.compile. With --csa-bench JSON (from `csa bench --save`), csa's graph
figure is compared with the kernel sum csa bench reports for the shape.

    python3 tools/bench_torch.py --save out.json [--csa-bench bench.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from typing import Callable

import torch

import csa
from csa.reference import compress_eager, compress_megatron_thd

SHAPES = ["4,2,128,1x8192", "4,2,512,3x8192", "128,1,512,1x4096", "2,2,512,1x4096"]
TARGET_WALL_FWD_US = 20.0
TARGET_WALL_FWD_BWD_US = 45.0
TARGET_GRAPH_VS_KERNELS = 1.10
TARGET_SPEEDUP_VS_COMPILE = 5.0


def parse_shape(text: str) -> tuple[int, int, int, list[int]]:
    ratio, coff, d, pack = text.split(",")
    count, length = pack.split("x")
    return int(ratio), int(coff), int(d), [int(length)] * int(count)


def make_set(ratio: int, coff: int, d: int, lens: list[int], gen: torch.Generator
             ) -> dict[str, torch.Tensor]:
    tokens = sum(lens)
    w = coff * d
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(lens), 0)), dtype=torch.int32)
    cuc = torch.tensor([0] + list(torch.cumsum(torch.tensor(lens) // ratio, 0)),
                       dtype=torch.int32)
    s = {
        "kv": torch.randn(tokens, w, generator=gen, device="cuda").bfloat16(),
        "score": (1.5 * torch.randn(tokens, w, generator=gen, device="cuda")).bfloat16(),
        "ape": 0.25 * torch.randn(ratio, w, generator=gen, device="cuda"),
        "cu": cu.cuda(),
        "cuc": cuc.cuda(),
    }
    for k in ("kv", "score", "ape"):
        s[k].requires_grad_(True)
    s["grad"] = torch.randn(int(cuc[-1]), d, generator=gen, device="cuda").bfloat16()
    return s


def region(fn: Callable[..., torch.Tensor], ratio: int, coff: int, total_comp: int
           ) -> Callable[[dict[str, torch.Tensor], bool], object]:
    def call(s: dict[str, torch.Tensor], backward: bool) -> object:
        out = fn(s["kv"], s["score"], s["ape"], s["cu"], s["cuc"], ratio=ratio, coff=coff,
                 total_comp=total_comp)
        if backward:
            return torch.autograd.grad(out, (s["kv"], s["score"], s["ape"]), s["grad"])
        return out
    return call


def direct(ratio: int, coff: int, total_comp: int
           ) -> Callable[[dict[str, torch.Tensor], bool], object]:
    """csa's forward and backward functions, without torch.autograd."""
    def call(s: dict[str, torch.Tensor], backward: bool) -> object:
        with torch.no_grad():
            out = csa.compress(s["kv"], s["score"], s["ape"], s["cu"], s["cuc"], ratio=ratio,
                               coff=coff, total_comp=total_comp)
            if backward:
                return csa.compress_backward(s["grad"], s["kv"], s["score"], s["ape"], s["cu"],
                                             s["cuc"], ratio=ratio, coff=coff)
        return out
    return call


def wall_us(call: Callable[[dict[str, torch.Tensor], bool], object], s: dict[str, torch.Tensor],
            backward: bool, calls: int = 200, reps: int = 7) -> float:
    for _ in range(20):
        call(s, backward)
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            call(s, backward)
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def graph_us(call: Callable[[dict[str, torch.Tensor], bool], object],
             sets: list[dict[str, torch.Tensor]], backward: bool, reps: int = 7) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            for s in sets:
                call(s, backward)
    torch.cuda.current_stream().wait_stream(stream)
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


def kernel_sum_us(bench: dict[str, object], shape: str) -> float | None:
    rows = [r for r in bench.get("rows", []) if r["shape"].endswith(shape.split(",")[-1])
            and r["shape"].startswith(csa_label(shape))]
    fwd = [r["kernel_us"] for r in rows if r["direction"] == "fwd"]
    bwd = [r["kernel_us"] for r in rows if r["direction"] == "bwd"]
    return fwd[0] + bwd[0] if fwd and bwd else None


def csa_label(shape: str) -> str:
    ratio, coff, d, _ = shape.split(",")
    return f"ratio={ratio},coff={coff},head_dim={d}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", action="append", help="R,C,D,NxLEN (default: the four shapes)")
    ap.add_argument("--save", help="write the results as JSON to this file")
    ap.add_argument("--csa-bench", help="`csa bench --save` output of the same shapes")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    shapes = args.shape or SHAPES
    bench = json.load(open(args.csa_bench)) if args.csa_bench else {}
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    rows = []
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, csa "
          f"{csa.version()}")
    header = (f"{'shape':<18} {'impl':<17} {'wall fwd':>9} {'wall f+b':>9} {'graph fwd':>10} "
              f"{'graph f+b':>10}")
    print(header + "   (µs per call)")
    for shape in shapes:
        ratio, coff, d, lens = parse_shape(shape)
        total_comp = sum(n // ratio for n in lens)
        bytes_per_call = 2 * sum(lens) * coff * d * 2 * 2 + total_comp * d * 2 * 3
        sets_n = max(2, min(32, math.ceil(3 * l2 / bytes_per_call)))
        sets = [make_set(ratio, coff, d, lens, gen) for _ in range(sets_n)]
        csa.prewarm(ratio=ratio, coff=coff, head_dim=d)
        torch._dynamo.reset()
        impls = {
            "csa": region(csa.compress, ratio, coff, total_comp),
            "csa direct": direct(ratio, coff, total_comp),
            "eager": region(compress_eager, ratio, coff, total_comp),
            "torch.compile": region(torch.compile(compress_eager, fullgraph=True, dynamic=False),
                                    ratio, coff, total_comp),
            "megatron eager": region(compress_megatron_thd, ratio, coff, total_comp),
            "megatron compile": region(
                torch.compile(compress_megatron_thd, fullgraph=True, dynamic=False), ratio, coff,
                total_comp),
        }
        result: dict[str, object] = {"shape": shape, "input_sets": sets_n}
        for name, call in impls.items():
            fig = {
                "wall_fwd_us": wall_us(call, sets[0], False),
                "wall_fwd_bwd_us": wall_us(call, sets[0], True),
                "graph_fwd_us": graph_us(call, sets, False),
                "graph_fwd_bwd_us": graph_us(call, sets, True),
            }
            result[name] = fig
            print(f"{shape:<18} {name:<17} {fig['wall_fwd_us']:>9.1f} "
                  f"{fig['wall_fwd_bwd_us']:>9.1f} {fig['graph_fwd_us']:>10.1f} "
                  f"{fig['graph_fwd_bwd_us']:>10.1f}")
        c = result["csa"]
        for key, name in (("compile", "torch.compile"), ("eager", "eager"),
                          ("megatron_compile", "megatron compile"),
                          ("megatron_eager", "megatron eager")):
            result[f"speedup_vs_{key}_graph"] = (result[name]["graph_fwd_bwd_us"]
                                                 / c["graph_fwd_bwd_us"])
        kernels = kernel_sum_us(bench, shape)
        if kernels is not None:
            result["csa_bench_kernel_sum_us"] = kernels
            result["graph_vs_kernel_sum"] = c["graph_fwd_bwd_us"] / kernels
        rows.append(result)
    print()
    print("CUDA graphs, forward + backward, µs per call (× = how much faster csa is):")
    print("| shape | csa | × csa bench kernels | torch.compile fp32 region | × | torch.compile "
          "Megatron region | × | eager fp32 region | eager Megatron region |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio_k = f"{r['graph_vs_kernel_sum']:.2f}" if "graph_vs_kernel_sum" in r else "n/a"
        g = {k: r[k]["graph_fwd_bwd_us"] for k in impls}
        print(f"| {r['shape']} | {g['csa']:.1f} | {ratio_k} | {g['torch.compile']:.1f} | "
              f"{r['speedup_vs_compile_graph']:.1f} | {g['megatron compile']:.1f} | "
              f"{r['speedup_vs_megatron_compile_graph']:.1f} | {g['eager']:.1f} | "
              f"{g['megatron eager']:.1f} |")
    print()
    print("Wall clock per call, µs (forward / forward + backward):")
    print("| shape | csa, autograd | csa, functions | torch.compile fp32 region | eager fp32 "
          "region |")
    print("|---|---|---|---|---|")
    for r in rows:
        w = {k: f"{r[k]['wall_fwd_us']:.1f} / {r[k]['wall_fwd_bwd_us']:.1f}" for k in impls}
        print(f"| {r['shape']} | {w['csa']} | {w['csa direct']} | {w['torch.compile']} | "
              f"{w['eager']} |")
    targets = {
        "wall_fwd_us": TARGET_WALL_FWD_US,
        "wall_fwd_bwd_us": TARGET_WALL_FWD_BWD_US,
        "graph_vs_kernel_sum": TARGET_GRAPH_VS_KERNELS,
        "speedup_vs_compile_graph": TARGET_SPEEDUP_VS_COMPILE,
    }
    if args.save:
        with open(args.save, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "csa": csa.version(), "targets": targets, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
