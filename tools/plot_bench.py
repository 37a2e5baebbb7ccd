#!/usr/bin/env python3
"""Draws docs/performance.png from `csa bench --save` JSON (kernel time against the DRAM
floor per shape) and, optionally, tools/bench_torch.py --save JSON (csa against the PyTorch
region in CUDA graphs).

    python3 tools/plot_bench.py BENCH.json [--torch TORCH.json] [--out docs/performance.png]
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def short(shape: str) -> str:
    """ratio=4,coff=2,head_dim=512,pack=1x4096 -> 4,2,512 1x4096"""
    parts = dict(p.split("=", 1) for p in shape.split(",") if "=" in p)
    pack = shape.split(",")[-1].split("=")[-1]
    return f"{parts.get('ratio')},{parts.get('coff')},{parts.get('head_dim')}\n{pack}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bench")
    ap.add_argument("--torch")
    ap.add_argument("--out", default="docs/performance.png")
    args = ap.parse_args()
    bench = json.load(open(args.bench))
    rows = bench["rows"]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    panels = 2 if args.torch else 1
    fig, axes = plt.subplots(panels, 1, figsize=(13, 4.8 * panels))
    axes = axes if panels > 1 else [axes]
    ax = axes[0]
    width = 0.2
    for i, (direction, colour) in enumerate((("fwd", "#4c72b0"), ("bwd", "#dd8452"),
                                             ("bwd-det", "#c44e52"))):
        ratios = []
        for s in shapes:
            match = [r for r in rows if r["shape"] == s and r["direction"] == direction]
            ratios.append(match[0]["ratio_to_floor"] if match else 0.0)
        xs = [k + (i - 1) * width for k in range(len(shapes))]
        ax.bar(xs, ratios, width, label=direction, color=colour)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels([short(s) for s in shapes], fontsize=8)
    ax.set_ylabel("kernel time / DRAM floor")
    ax.set_title(f"csa kernels on the {bench['device']} (copy bandwidth "
                 f"{bench['copy_bandwidth_tb_s']:.2f} TB/s): time over the DRAM floor, lower is "
                 f"better")
    ax.legend()
    if args.torch:
        t = json.load(open(args.torch))
        ax = axes[1]
        impls = [("csa", "csa", "#4c72b0"), ("torch.compile", "torch.compile, fp32 region",
                                             "#55a868"),
                 ("megatron compile", "torch.compile, Megatron region", "#8172b2"),
                 ("eager", "eager PyTorch, fp32 region", "#937860")]
        tshapes = [r["shape"] for r in t["rows"]]
        for i, (key, label, colour) in enumerate(impls):
            ys = [r[key]["graph_fwd_bwd_us"] for r in t["rows"]]
            xs = [k + (i - 1.5) * width for k in range(len(tshapes))]
            ax.bar(xs, ys, width, label=label, color=colour)
        ax.set_yscale("log")
        ax.set_xticks(range(len(tshapes)))
        ax.set_xticklabels([s.replace(",", ",", 2) for s in tshapes], fontsize=9)
        ax.set_ylabel("µs per forward + backward (log)")
        ax.set_title("Forward + backward in CUDA graphs, µs per call (inputs rotated past the L2)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
