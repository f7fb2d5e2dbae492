"""Detail sections and plots of ``RESULTS.md`` (one function per benchmark record)."""

from __future__ import annotations

import os
from typing import Any, Dict, List

import common
from report import Rec, _f, _table

PLOTS = {"memory": "memory_vs_seq.png", "balance": "makespan_vs_world.png", "error": "error_vs_ring.png"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def memory(r: Rec) -> str:
    rows = []
    for x in r["rows"]:
        if "error" in x:
            rows.append([x["model"], x["seq_len"], x["world"], "failed: " + x["error"], "", "", "", ""])
            continue
        rows.append([x["model"], x["seq_len"], x["world"], _f(x["peak_above_mib"], 1), _f(x.get("ratio_above", 1)),
                     _f(x["peak_rss_mib"], 1), _f(x.get("ratio_rss", 1)),
                     _f(x["ratio_vs_no_ac"]) if "ratio_vs_no_ac" in x else ""])
    text = _table(["model", "S", "N", "peak above baseline (MiB, max rank)", "× N=1", "peak RSS (MiB)", "× N=1",
                   "× same N without AC"], rows)
    text += ("\n\n``llama_ac``: the example Llama with every block in ``checkpoint_wrapper`` (full activation "
             "checkpointing); its × N=1 is against its own N = 1 row (both with AC).")
    cap = [[c["model"], c["world"], f"{c['longest_seq_len']:,}", _f(c["mib_per_1k_tokens"], 2),
            _f(c["intercept_mib"], 0), _f(c["max_fit_residual_mib"], 1), f"{c['measured_up_to']:,}"] for c in r["cap"]]
    if cap:
        text += (f"\n\nLongest S under a {r['cap'][0]['cap_mib']:.0f} MiB per-process RSS cap — "
                 "**extrapolated** from a least-squares line through the measured peaks "
                 "(not run under a hard limit):\n\n")
        text += _table(["model", "N", "longest S", "MiB per 1k tokens", "intercept MiB", "max fit residual MiB",
                        "measured up to S"], cap)
    other = {}  # rows another run measured (``--merge``): command -> (date, rows)
    for x in r["rows"]:
        if x.get("command", r["command"]) != r["command"]:
            other.setdefault(x["command"], (x.get("date", "?"), []))[1].append(f"{x['model']} S={x['seq_len']} "
                                                                              f"N={x['world']}")
    for cmd, (date, names) in other.items():
        text += f"\n\nMeasured by `{cmd}` ({date}), kept by `--merge`: " + ", ".join(names) + "."
    plot_memory(r)
    return text + f"\n\n![memory vs S]({PLOTS['memory']})"


def plot_memory(r: Rec) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for n in sorted({x["world"] for x in r["rows"]}):
        pts = sorted((x["seq_len"], x["peak_above_mib"]) for x in r["rows"]
                     if x["model"] == "block" and x["world"] == n and "error" not in x)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"N={n}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("sequence length S")
    ax.set_ylabel("per-rank peak above baseline (MiB)")
    ax.set_title("one block fwd+bwd: per-rank peak memory")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(common.RESULTS, PLOTS["memory"]), dpi=110)
    plt.close(fig)


def balance(r: Rec) -> str:
    c = r["block_costs"]
    rows = [[x["world"], x["layout"], _f(x["makespan_s"], 3), _f(x["speedup_vs_contiguous"]),
             _f(x["best_speedup_vs_contiguous"]), _f(x["cost_model_speedup"]), _f(x["pair_speedup_vs_contiguous"]),
             _f(x["theory_fwd_speedup"], 3), _f(max(x["rank_busy_s"]) / min(x["rank_busy_s"]))]
            for x in r["simulated"]]
    text = _table(["N", "layout", "makespan (s)", "× vs contiguous (median)", "× (best of)",
                   "× predicted by block costs", "× by pair count", "theory fwd", "busiest / idlest rank"], rows)
    text += (f"\n\nBlock costs at c={r['args']['local_len']} (fwd+bwd, best of repeats): causal c×c "
             f"{_f(c['causal_s'] * 1e3, 1)} ms, unmasked c×c {_f(c['full_s'] * 1e3, 1)} ms, unmasked c×c/2 "
             f"{_f(c['half_s'] * 1e3, 1)} ms → causal/full {_f(c['causal_over_full'])}, half/full "
             f"{_f(c['half_over_full'])} (a kernel that skips masked work perfectly: 0.50, 0.50).\n\n")
    real = [[x["world"], x["layout"], _f(x["seconds"], 3) if "seconds" in x else x["error"],
             _f(x.get("speedup_vs_contiguous", float("nan")))] for x in r["real"]]
    text += "Real gloo ranks (one thread each; N=4 puts 4 ranks on 2 cores):\n\n"
    text += _table(["N", "layout", "fwd+bwd (s, slowest rank, median)", "× vs contiguous"], real)
    plot_balance(r)
    return text + f"\n\n![makespan per layout]({PLOTS['balance']})"


def plot_balance(r: Rec) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    worlds = sorted({x["world"] for x in r["simulated"]})
    layouts = ["zigzag", "striped", "contiguous"]
    width = 0.8 / len(layouts)
    for i, lay in enumerate(layouts):
        ys = [next(x["makespan_s"] for x in r["simulated"] if x["world"] == n and x["layout"] == lay) for n in worlds]
        ax.bar([j + i * width for j in range(len(worlds))], ys, width, label=lay)
    ax.set_xticks([j + width for j in range(len(worlds))], [f"N={n}" for n in worlds])
    ax.set_ylabel("synchronous-ring makespan, fwd+bwd (s)")
    ax.set_title(f"causal ring, {r['args']['local_len']} tokens per rank (simulated)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(common.RESULTS, PLOTS["balance"]), dpi=110)
    plt.close(fig)


def overlap(r: Rec) -> str:
    rows = [[s["world"], _f(s["sleep_s"], 3), _f(s["hop_s"], 3), _f(s["fwd_s"], 3), _f(s["fwd_ratio"], 3),
             _f(s["bwd_s"], 3), _f(s["bwd_ratio"], 3), _f(s["fwd_serial_ratio"], 2)] for s in r["schedule"]]
    text = _table(["N", "T: kernel s/step", "X: one hop (s)", "fwd wall (s)", "fwd wall/ideal", "bwd wall (s)",
                   "bwd wall/ideal", "no-overlap fwd would be"], rows)
    real = [[x["world"], _f(x["wall_s"], 3), _f(x["kernel_s"], 3), _f(x["hop_s"], 4), _f(x["ideal_s"], 3),
             _f(x["ratio_ideal"]), _f(x["serial_s"], 3), _f(x["ratio_serial"])] for x in r["real"]]
    text += f"\n\nReal CPU kernel, causal, S={r['args']['real_seq_len']}, fwd+bwd:\n\n"
    return text + _table(["N", "wall (s)", "kernel time (s)", "hop (s)", "ideal overlap (s)", "wall/ideal",
                          "serial (s)", "wall/serial"], real)


def e2e(r: Rec) -> str:
    rows = [[x["mode"], "failed: " + x["error"], "", "", "", "", ""] if "error" in x else
            [x["mode"], f"{x['ranks']}×{x['threads']}", _f(x["step_s"]), _batch_check(x), _f(x["peak_above_mib"], 1),
             _f(x["peak_rss_mib"], 1), f"{x['loss_step1']:.6f}"] for x in r["rows"]]
    return _table(["run", "processes×threads", "step (s, median)", "same-batch check (ms/step)",
                   "peak above baseline (MiB)", "peak RSS (MiB)", "loss, step 1"], rows)


def _batch_check(x: Dict[str, Any]) -> str:
    """The time in the same-batch check per step, or "-" where none ran (records before it: "")."""
    if "batch_check_s" not in x:
        return ""
    return f"{x['batch_check_s'] * 1e3:.2f}" if x.get("batch_checks_per_step") else "-"


def kernel(r: Rec) -> str:
    rows = [[x["dtype"], x["len"], _f(x["fwd_gflops"], 1), _f(x["bwd_gflops"], 1), _f(x["matmul_square_gflops"], 1),
             _f(x["matmul_attn_shape_gflops"], 1), f"{x['fwd_efficiency'] * 100:.0f}%",
             f"{x['bwd_efficiency'] * 100:.0f}%"] for x in r["rows"]]
    return _table(["dtype", "L", "kernel fwd GFLOP/s", "kernel bwd GFLOP/s", "matmul 1024³ GFLOP/s",
                   "matmul (H,L,D)@(H,D,L) GFLOP/s", "fwd / best matmul", "bwd / best matmul"], rows)


def vs_torch(r: Rec) -> str:
    rows = [[x["world"], x["seq_len"], "causal" if x["causal"] else "non-causal", x["impl"],
             _f(x["seconds"], 3) if "seconds" in x else "`" + x["error"] + "`",
             _f(x["ratio_vs_cp_compile"]) if "ratio_vs_cp_compile" in x else "",
             f"{x['out_rel_diff']:.1e}" if "out_rel_diff" in x else ""] for x in r["rows"]]
    return _table(["N", "S", "mask", "implementation", "fwd+bwd (s)", "× cp_compile", "out vs cp_compile"], rows)


def compile_(r: Rec) -> str:
    def aot(x: dict, b: str) -> str:  # hit/miss/bypass summed over ranks (records before it: unknown)
        return "/".join(f"{x[f'{b}_aot_cache_{k}']:g}" for k in ("hit", "miss", "bypass")) \
            if f"{b}_aot_cache_hit" in x else "?"

    rows = [[x["cache"], _f(x["inductor_compile_s"], 1), _f(x["ring_cp_compile_s"], 1), _f(x["ratio_wall"]),
             _f(x["inductor_compile_cpu_s"], 1), _f(x["ring_cp_compile_cpu_s"], 1), _f(x["ratio_cpu"]),
             aot(x, "inductor"), aot(x, "ring_cp")] for x in r["rows"]]
    return _table(["cache", "inductor (s)", "ring_cp (s)", "ratio", "inductor CPU s", "ring_cp CPU s", "CPU ratio",
                   "inductor AOTAutograd cache hit/miss/bypass", "ring_cp (sum of 2 ranks)"], rows)


def error(r: Rec) -> str:
    rows = [[x["kernel"], x["dtype"], x["seq_len"], x["world"], *(f"{x[k]:.2e}" for k in ("out", "dq", "dk", "dv"))]
            for x in r["rows"]]
    text = _table(["kernel", "dtype", "S", "N", "out", "dq", "dk", "dv"], rows)
    text += f"\n\nTriton kernel: {r['triton']}."
    plot_error(r)
    return text + f"\n\n![error vs ring size]({PLOTS['error']})"


def plot_error(r: Rec) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    series: Dict[Any, List] = {}
    for x in r["rows"]:
        for k in ("out", "dq"):
            series.setdefault((x["kernel"], x["dtype"], x["seq_len"], k), []).append((x["world"], x[k]))
    for (kern, dt, s, k), pts in sorted(series.items()):
        ax.plot(*zip(*sorted(pts)), marker="o", linestyle="-" if k == "out" else "--", label=f"{kern} {dt} {k}, S={s}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ring size N (N=1: the single-device kernel)")
    ax.set_ylabel("relative error vs fp64")
    ax.set_title("ring attention error vs ring size (causal, zig-zag)")
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(common.RESULTS, PLOTS["error"]), dpi=110)
    plt.close(fig)


def doc_balance(r: Rec) -> str:
    a = r["args"]
    return ("Visible pairs:\n\n" + r["table_pairs"] + f"\n\n{a['block_m']}x{a['block_n']} tiles:\n\n"
            + r["table_tiles"] + "\n\n![balance with packed documents](doc_balance.png)")


def doc_memory(r: Rec) -> str:
    rows = []
    for x in r["rows"]:
        what = "failed: " + x["error"] if "error" in x else _f(x["peak_above_mib"], 1)
        rows.append([x["path"], x["seq_len"], x["world"], x.get("documents", ""), what, _f(x.get("ratio_above", 1), 3),
                     "" if "loss_diff" not in x else f"{x['loss_diff']:.1e}"])
    return _table(["path", "S", "N", "documents", "peak above baseline (MiB, max rank)", "× N=1 varlen",
                   "|loss − N=1|"], rows)


def strategies(r: Rec) -> str:
    kinds = list(r["kinds"])
    rows = []
    for x in r["rows"]:
        if "error" in x:
            rows.append([x["label"], x["world"], "failed: " + x["error"], "", "", "", "", "", ""])
            continue
        err = [f"{x[k]:.1e}" if k in x else "" for k in ("loss_rel_err", "grad_rel_err")]
        grid = f"{x['u']}×{x['r']}" if "u" in x else "1"
        turn = _f(x["step_s_interleaved"], 2) if "step_s_interleaved" in x else x.get("interleaved_error", "")
        rows.append([x["label"], x["world"], grid, *err, _f(x["peak_above_mib"], 1), _f(x.get("ratio_above", 1)),
                     _f(x["peak_rss_mib"], 1), _f(x["step_s"], 2), turn])
    text = _table(["strategy", "N", "u×r", "loss rel err", "worst grad rel err", "peak above baseline (MiB, max rank)",
                   "× N=1", "peak RSS (MiB)", "step (s), own run", "step (s), strategies in turn"], rows)
    sent = []
    for x in r["rows"]:
        for k in kinds if "sent_per_layer" in x else ():
            got, want = x["sent_per_layer"][k], x["model_per_layer"][k]
            sent.append([x["label"], k, f"{got:,.0f}", f"{want:,}", _f(x["counted_over_model"][k], 3) if want else
                         ("—" if not got else "∞"), "yes" if x["ranks_agree"] else "**no**"])
    m = r["model"]
    text += (f"\n\nBytes sent per attention layer per rank over one training step (forward + backward): counted at "
             f"runtime by `cp_compile.traffic.measure()` (divided by the {m['n_layers']} layers) beside the cost "
             f"model `cp_compile.ulysses.cost.strategy_cost` for the attention's shape (batch 1, H {m['n_heads']}, "
             f"H_kv {m['n_kv_heads']}, head_dim {m['dim'] // m['n_heads']}, padded S, fp32, causal):\n\n")
    text += _table(["strategy", "kind", "counted (bytes)", "cost model (bytes)", "counted / model", "every rank same"],
                   sent)
    return text + ("\n\nStep times (median over steps, slowest rank): N ranks share the 2 cores (and the machine's "
                   "other work), so they mix compute, gloo transfers and contention; no target. \"own run\": in the "
                   "configuration's fresh ranks; \"in turn\": the N-rank strategies compiled side by side in one set "
                   "of ranks and stepped one after another each round, so all see the same load. The one-process "
                   "row is one thread.")


SECTIONS = [
    ("memory", "1. Memory scaling", memory), ("balance", "2. Load balance", balance),
    ("overlap", "3. Overlap", overlap), ("e2e", "4. End to end", e2e), ("kernel", "5. Kernel efficiency", kernel),
    ("vs_torch_cp", "6. Versus PyTorch's context_parallel", vs_torch), ("compile", "7. Compile time", compile_),
    ("error", "Exactness: error vs ring size", error),
    ("doc_memory", "8. Memory with packed documents", doc_memory),
    ("doc_balance", "9. Balance with packed documents", doc_balance),
    ("strategies", "10. CP strategies: ring, Ulysses, 2-D", strategies),
]
