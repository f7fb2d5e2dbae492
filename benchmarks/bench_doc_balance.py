"""Benchmark "Balance" of issue 16: packed documents, global zig-zag vs the document-aware layout.

    .venv/bin/python benchmarks/bench_doc_balance.py            # S = 64k, 128k; N = 4, 8; 8 seeds (~1 min)
    .venv/bin/python benchmarks/bench_doc_balance.py --quick    # S = 16k; N = 4; 2 seeds (seconds)
    .venv/bin/python benchmarks/bench_doc_balance.py --sigma 1.5 --min-chunk 128

A work model, no attention is computed (:mod:`cp_compile.document_layout`): document
lengths are drawn log-normal (mean ``--mean`` = 2048 tokens, ``--sigma`` = 1.0 of the
underlying normal), packed into S tokens (the last document is cut at S), and for each
layout the work of every rank is counted exactly as visible (query, key) pairs
(causal inside a document, nothing across documents), per ring step: rank r's queries
against the K/V block of rank (r - t) mod N, the rectangles benchmark 2 counts. Two
granularities: **pairs** (a kernel that computes only visible pairs, e.g. the aten path
split into per-document sub-rectangles) and **tiles** (a tile-skipping kernel: a
``--block-m`` x ``--block-n`` tile of local rows costs its whole area when any pair in
it is visible, as the Triton kernels do). Reported per (S, N), over seeds (mean and
max): busiest / idlest rank (total work over the whole ring); the synchronous-ring
makespan (sum over steps of the slowest rank, as benchmark 2) over the perfectly
balanced one (total / N); and the ring speed-up, zig-zag's makespan over the
document-aware layout's (both in the same unit, so at tile granularity it includes
the extra partly masked tiles the document-aware fragments cost). Target (issue 16):
document-aware busiest / idlest <= 1.05.

Writes results/doc_balance.json and results/doc_balance.png (matplotlib), or
results/doc_balance.csv with the plotted numbers if matplotlib is not installed.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time
from typing import Any, Dict, List

import common

TARGET = 1.05


def packing(seq_len: int, seed: int, mean: float, sigma: float) -> List[int]:
    """Log-normal document lengths (mean ``mean``) filling ``seq_len`` tokens; the last one is cut."""
    rng = random.Random(seed)
    mu = math.log(mean) - sigma**2 / 2  # E[exp(N(mu, sigma^2))] = mean
    out: List[int] = []
    total = 0
    while total < seq_len:
        n = min(max(1, round(rng.lognormvariate(mu, sigma))), seq_len - total)
        out.append(n)
        total += n
    return out


def measure(lengths: List[int], layout, world: int, args) -> Dict[str, float]:
    """Balance numbers of one layout: per-rank and per-step, in pairs and in tiles."""
    from cp_compile.document_layout import imbalance, step_pairs, step_tiles, sync_makespan

    out: Dict[str, float] = {}
    for unit, steps in (("pairs", step_pairs(lengths, layout)),
                        ("tiles", step_tiles(lengths, layout, args.block_m, args.block_n))):
        per_rank = steps.sum(1)  # (N,)
        out[f"{unit}_ratio"] = imbalance(per_rank.tolist())
        out[f"{unit}_busiest"] = int(per_rank.max())
        out[f"{unit}_makespan"] = sync_makespan(steps)
        out[f"{unit}_sync"] = sync_makespan(steps) / (float(steps.sum()) / world)
        out[f"{unit}_total"] = int(steps.sum())
    return out


def run_case(seq_len: int, world: int, seed: int, args) -> Dict[str, Any]:
    """One packing: global zig-zag and the document-aware layout side by side."""
    from cp_compile.document_layout import document_positions, zigzag_layout

    lengths = packing(seq_len, seed, args.mean, args.sigma)
    t0 = time.perf_counter()
    doc = document_positions(lengths, world, min_chunk=args.min_chunk)
    layout_s = time.perf_counter() - t0  # informational only
    row: Dict[str, Any] = {"seq_len": seq_len, "world": world, "seed": seed, "docs": len(lengths),
                           "longest": max(lengths), "layout_s": round(layout_s, 3)}
    for name, layout in (("zigzag", zigzag_layout(seq_len, world)), ("doc", doc)):
        row.update({f"{name}_{k}": v for k, v in measure(lengths, layout, world, args).items()})
    for unit in ("pairs", "tiles"):
        row[f"{unit}_speedup"] = row[f"zigzag_{unit}_makespan"] / row[f"doc_{unit}_makespan"]
    return row


def summarise(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per (S, N): mean and max over seeds of every ratio (min for the speed-ups)."""
    out = []
    for key in sorted({(r["seq_len"], r["world"]) for r in rows}):
        grp = [r for r in rows if (r["seq_len"], r["world"]) == key]
        s: Dict[str, Any] = {"seq_len": key[0], "world": key[1], "seeds": len(grp),
                             "docs_mean": sum(r["docs"] for r in grp) / len(grp)}
        for k in grp[0]:
            if k.endswith(("_ratio", "_sync", "_speedup")):
                vals = [r[k] for r in grp]
                s[k + "_mean"] = sum(vals) / len(vals)
                s[k + ("_min" if k.endswith("_speedup") else "_max")] = (min if k.endswith("_speedup") else max)(vals)
        out.append(s)
    return out


def table(summary: List[Dict[str, Any]], unit: str) -> str:
    """Markdown table of one granularity."""
    head = ["S", "N", "#docs (mean)", "zig-zag busiest/idlest mean", "max", "document-aware mean", "max",
            "sync makespan / ideal: zig-zag (mean)", "document-aware (mean)",
            "ring speed-up, zig-zag / doc-aware makespan: mean", "min"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summary:
        cells = [f"{s['seq_len'] // 1024}k", s["world"], f"{s['docs_mean']:.1f}",
                 f"{s[f'zigzag_{unit}_ratio_mean']:.2f}", f"{s[f'zigzag_{unit}_ratio_max']:.2f}",
                 f"{s[f'doc_{unit}_ratio_mean']:.3f}", f"{s[f'doc_{unit}_ratio_max']:.3f}",
                 f"{s[f'zigzag_{unit}_sync_mean']:.2f}", f"{s[f'doc_{unit}_sync_mean']:.3f}",
                 f"{s[f'{unit}_speedup_mean']:.2f}", f"{s[f'{unit}_speedup_min']:.2f}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def plot(summary: List[Dict[str, Any]], args) -> str:
    """busiest / idlest per (S, N), both layouts, both granularities: a PNG, or a CSV without matplotlib."""
    series = [(f"{lay} ({unit})", [s[f"{lay}_{unit}_ratio_mean"] for s in summary])
              for unit in ("pairs", "tiles") for lay in ("zigzag", "doc")]
    labels = [f"S={s['seq_len'] // 1024}k N={s['world']}" for s in summary]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        path = os.path.join(common.RESULTS, "doc_balance.csv")
        with open(path, "w") as f:
            f.write("case," + ",".join(name for name, _ in series) + "\n")
            for i, lab in enumerate(labels):
                f.write(lab + "," + ",".join(f"{vals[i]:.4f}" for _, vals in series) + "\n")
        return path
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(series)
    for j, (name, vals) in enumerate(series):
        ax.bar([i + j * width for i in range(len(labels))], vals, width, label=name)
    ax.axhline(TARGET, color="k", linestyle="--", linewidth=0.8, label=f"target {TARGET}")
    ax.set_yscale("log")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels, fontsize=8)
    ax.set_ylabel("busiest / idlest rank work (mean over seeds)")
    ax.set_title(f"log-normal documents, mean {args.mean:g}, sigma {args.sigma:g}", fontsize=9)
    ax.legend(fontsize=7)
    for j, unit in enumerate(("pairs", "tiles")):
        ax2.bar([i + j * 0.4 for i in range(len(labels))], [s[f"{unit}_speedup_mean"] for s in summary], 0.4,
                label=f"{unit}" if unit == "pairs" else f"{args.block_m}x{args.block_n} tiles")
    ax2.axhline(1.0, color="k", linewidth=0.8)
    ax2.set_xticks([i + 0.2 for i in range(len(labels))], labels, fontsize=8)
    ax2.set_ylabel("zig-zag / document-aware sync-ring makespan")
    ax2.set_title("ring speed-up of the document-aware layout (mean over seeds)", fontsize=9)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(common.RESULTS, "doc_balance.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--seq-lens", type=common.int_list, default=[65536, 131072], help="packed lengths S, e.g. 64k,128k")
    p.add_argument("--worlds", type=common.int_list, default=[4, 8], help="ring sizes N")
    p.add_argument("--seeds", type=int, default=8, help="packings per (S, N)")
    p.add_argument("--mean", type=float, default=2048.0, help="mean document length (tokens)")
    p.add_argument("--sigma", type=float, default=1.0, help="sigma of the log-normal's underlying normal")
    p.add_argument("--min-chunk", type=int, default=None, help="document_positions min_chunk (default: automatic)")
    p.add_argument("--block-m", type=int, default=128, help="kernel tile: query rows")
    p.add_argument("--block-n", type=int, default=64, help="kernel tile: key rows")
    p.add_argument("--quick", action="store_true", help="S = 16k, N = 4, 2 seeds (a smoke test)")
    args = p.parse_args(argv)
    if args.quick:
        args.seq_lens, args.worlds, args.seeds = [16384], [4], 2
    started = time.perf_counter()
    rows = []
    for seq_len in args.seq_lens:
        for world in args.worlds:
            common.log(f"S={seq_len} N={world}: {args.seeds} packings")
            rows += [run_case(seq_len, world, seed, args) for seed in range(args.seeds)]
    summary = summarise(rows)
    for unit in ("pairs", "tiles"):
        print(f"\n{unit} ({'visible pairs' if unit == 'pairs' else f'{args.block_m}x{args.block_n} tiles'}):")
        print(table(summary, unit))
    worst = max(s["doc_pairs_ratio_max"] for s in summary)
    common.log(f"\ndocument-aware busiest/idlest (pairs), worst over all: {worst:.4f} "
               f"(target <= {TARGET}: {'met' if worst <= TARGET else 'missed'})")
    common.log(f"wrote {os.path.relpath(plot(summary, args), common.ROOT)}")
    common.write_result("doc_balance", {"rows": rows, "summary": summary, "target": TARGET,
                                        "table_pairs": table(summary, "pairs"),
                                        "table_tiles": table(summary, "tiles")}, started, args)


if __name__ == "__main__":
    main()
