"""Render ``benchmarks/results/*.json`` into ``RESULTS.md`` and the PNG plots.

    .venv/bin/python benchmarks/report.py        # re-render from the JSON records already there

Every number in the output is read from a JSON record written by a benchmark run;
nothing is typed in here except the targets (from the issue) and the wording.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import common

Rec = Dict[str, Any]


def load() -> Dict[str, Rec]:
    """All result records by benchmark name."""
    out = {}
    for name in sorted(os.listdir(common.RESULTS)):
        if name.endswith(".json"):
            with open(os.path.join(common.RESULTS, name)) as f:
                out[name[:-5]] = json.load(f)
    return out


def _f(x: float, nd: int = 2) -> str:
    return f"{x:.{nd}f}"


def _table(head: List[str], rows: List[List[Any]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _verdict(ok: Optional[bool]) -> str:
    return "n/a" if ok is None else ("**met**" if ok else "**missed**")


# ---------------------------------------------------------------- headline checks
def check_memory(r: Rec) -> List[Tuple[str, str, str, Optional[bool], str]]:
    rows = [x for x in r["rows"] if x["model"] == "block" and x["world"] == 4 and "ratio_above" in x]
    if not rows:
        return [("1. memory", "N=4 per-rank peak ≤ 0.30× N=1", "no N=4 result", None, "")]
    worst = max(rows, key=lambda x: x["ratio_above"])
    ok = worst["ratio_above"] <= 0.30
    ref = {x["seq_len"]: x for x in r["rows"] if x["model"] == "block" and x["world"] == 1 and "error" not in x}
    excess = [(x["seq_len"], x["peak_above_mib"] - ref[x["seq_len"]]["peak_above_mib"] / 4) for x in rows]
    why = "" if ok else ("per-rank peak above 1/4 of N=1 by " + ", ".join(f"{e:.0f} MiB at S={s}" for s, e in excess)
                         + " (a part that does not shrink with N)")
    meas = ", ".join(f"S={x['seq_len']}: {_f(x['ratio_above'])}×" for x in rows)
    out = [("1. memory (block)", "N=4 per-rank peak ≤ 0.30× N=1", meas, ok, why)]
    names = {"llama": ("example Llama", "N=1"), "llama_ac": ("example Llama, activation checkpointing", "N=1 with AC"),
             "alibi": ("ALiBi block", "N=1 without an S×S bias"),
             "t5": ("T5 block, learned relative bias", "N=1 without an S×S bias")}
    one = {(x["model"], x["seq_len"]): x for x in r["rows"] if x["world"] == 1 and "error" not in x}
    for x in [x for x in r["rows"] if x["model"] in names and x["world"] == 4 and "ratio_above" in x]:
        what, ref_name = names[x["model"]]
        excess = x["peak_above_mib"] - one[(x["model"], x["seq_len"])]["peak_above_mib"] / 4
        why = "" if x["ratio_above"] <= 0.30 else (f"per-rank peak above 1/4 of N=1 by {excess:.0f} MiB, a part that "
                                                   "does not shrink with N (not yet attributed)")
        out.append((f"1. memory ({what})", f"N=4 per-rank peak ≤ 0.30× {ref_name}", f"S={x['seq_len']}: "
                    f"{_f(x['ratio_above'])}×", x["ratio_above"] <= 0.30, why))
    return out


def check_balance(r: Rec) -> List[Tuple[str, str, str, Optional[bool], str]]:
    out, costs = [], r["block_costs"]
    for n, target in ((4, 1.65), (8, 1.75)):
        row = next((x for x in r["simulated"] if x["world"] == n and x["layout"] == "zigzag"), None)
        if row is None:
            continue
        ok = row["speedup_vs_contiguous"] >= target
        why = "" if ok else (
            f"the CPU kernel's causal c×c block costs {_f(costs['causal_over_full'])}× an unmasked one (ideal 0.5) "
            f"and the half block {_f(costs['half_over_full'])}×; with these costs the schedule predicts "
            f"{_f(row['cost_model_speedup'])}× (best-of-repeats makespan: {_f(row['best_speedup_vs_contiguous'])}×)")
        out.append((f"2. balance N={n}", f"zig-zag ≥ {target}× contiguous (theory {_f(row['theory_fwd_speedup'], 3)}×)",
                    f"{_f(row['speedup_vs_contiguous'])}× (simulated makespan)", ok, why))
    return out


def check_overlap(r: Rec) -> List[Tuple[str, str, str, Optional[bool], str]]:
    out = []
    load = r["machine"].get("load_avg_1min")
    for s in r["schedule"]:
        worst = max(s["fwd_ratio"], s["bwd_ratio"])
        excess = [(d, s[f"{d}_s"] * (1 - 1 / s[f"{d}_ratio"])) for d in ("fwd", "bwd") if s[f"{d}_ratio"] > 1.10]
        why = "; ".join(f"{d} wall exceeds the ideal schedule by {e:.3f} s = {e / s['hop_s']:.1f} hop times"
                        for d, e in excess) + (f" (machine load average {load})" if load is not None else "")
        out.append((f"3. overlap N={s['world']} (stand-in kernel)", "wall / ideal ≤ 1.10",
                    f"fwd {_f(s['fwd_ratio'], 3)}, bwd {_f(s['bwd_ratio'], 3)}", worst <= 1.10,
                    "" if worst <= 1.10 else why))
    for x in r["real"]:
        out.append((f"3. overlap N={x['world']} (real CPU kernel)", "reported, no target",
                    f"wall / ideal {_f(x['ratio_ideal'])}, wall / serial {_f(x['ratio_serial'])}", None, ""))
    return out


def check_e2e(r: Rec) -> List[Tuple[str, str, str, Optional[bool], str]]:
    q = r["ratios"]
    by = {x["mode"]: x for x in r["rows"]}
    out = []
    if "step_cp_over_single" in q:
        ok = q["step_cp_over_single"] <= 1.05
        why = "" if ok else (f"CP step {_f(by['cp compiled']['step_s'])} s "
                             f"vs single {_f(by['single compiled']['step_s'])} s")
        out.append(("4. e2e step time", "2 ranks×1 thread / 1 process×2 threads ≤ 1.05",
                    f"{_f(q['step_cp_over_single'])}×", ok, why))
        ok = q["peak_cp_over_single"] <= 0.6
        out.append(("4. e2e peak memory", "per-rank / single ≤ 0.6", f"{_f(q['peak_cp_over_single'])}× "
                    f"(absolute RSS {_f(q['rss_cp_over_single'])}×)", ok, ""))
    if "step_compiled_over_eager_hand" in q:
        ok = q["step_compiled_over_eager_hand"] <= 1.0
        why = "" if ok else (f"compiled step {_f(by['cp compiled']['step_s'])} s vs eager hand-inserted "
                             f"{_f(by['cp eager (hand)']['step_s'])} s")
        out.append(("4. e2e compiled vs eager", "ring_cp (Inductor) / eager hand-inserted ring ≤ 1.0",
                    f"{_f(q['step_compiled_over_eager_hand'])}×", ok, why))
    if "batch_check_over_step" in q:
        ok = q["batch_check_over_step"] <= 0.02
        on_off = f"; step on / off {_f(q['step_check_on_over_off'], 3)}×" if "step_check_on_over_off" in q else ""
        checked = by["cp compiled"]
        out.append(("4. e2e same-batch check", "time in the check / cp step ≤ 2%",
                    f"{q['batch_check_over_step'] * 100:.2f}% ({checked['batch_check_s'] * 1e3:.1f} ms of "
                    f"{_f(checked['step_s'])} s){on_off}", ok, "" if ok else "the fingerprints or the all-gather"))
    for x in r["rows"]:
        if "error" in x:
            out.append((f"4. e2e {x['mode']}", "runs", x["error"], False, ""))
    return out


def check_kernel(r: Rec) -> List[Tuple[str, str, str, Optional[bool], str]]:
    out = []
    for dt in sorted({x["dtype"] for x in r["rows"]}):
        best = max((x for x in r["rows"] if x["dtype"] == dt), key=lambda x: x["len"])
        out.append((f"5. kernel {dt}", "GFLOP/s vs torch.matmul (reported)",
                    f"L={best['len']}: fwd {_f(best['fwd_efficiency'] * 100, 0)}%, bwd "
                    f"{_f(best['bwd_efficiency'] * 100, 0)}% of matmul", None, ""))
    return out


def check_vs_torch(r: Rec) -> List[Tuple[str, str, str, Optional[bool], str]]:
    out = []
    for x in r["rows"]:
        if x["impl"] == "cp_compile":
            continue
        what = x["error"] if "error" in x else f"{_f(x['ratio_vs_cp_compile'])}× cp_compile's time"
        out.append((f"6. vs {x['impl']} ({'causal' if x['causal'] else 'non-causal'})", "same shapes, fwd+bwd",
                    what, None, ""))
    return out


def check_compile(r: Rec) -> List[Tuple[str, str, str, Optional[bool], str]]:
    out = []
    for x in r["rows"]:
        ok = x["ratio_wall"] <= 1.3
        bypass = x.get("ring_cp_aot_cache_bypass", 0)
        why = "" if ok else (f"CPU-seconds ratio {_f(x['ratio_cpu'])}× (wall includes 2 ranks compiling at once on "
                             f"2 shared cores, load average {r['machine'].get('load_avg_1min', '?')} at the end)"
                             + (f"; ring_cp's graphs bypassed the AOTAutograd cache ({bypass:g}× over the ranks)"
                                if bypass else ""))
        out.append((f"7. compile ({x['cache']} cache)", "ring_cp / inductor ≤ 1.3",
                    f"{_f(x['ratio_wall'])}× wall ({_f(x['ring_cp_compile_s'], 1)} s vs "
                    f"{_f(x['inductor_compile_s'], 1)} s)", ok, why))
    return out


def check_doc_memory(r: Rec) -> List[Tuple[str, str, str, Optional[bool], str]]:
    rows = [x for x in r["rows"] if x["path"] == "documents" and x["world"] == 4 and "ratio_above" in x]
    if not rows:
        return [("8. memory, documents", "N=4 per-rank peak ≤ 0.30× N=1", "no N=4 result", None, "")]
    longest = max(rows, key=lambda x: x["seq_len"])  # the target is set at S = 64k (~32 documents)
    meas = ", ".join(f"S={x['seq_len']}: {_f(x['ratio_above'])}×" for x in rows)
    why = "" if longest["seq_len"] >= 65536 else "measured below S = 64k only, where fixed per-rank bytes weigh more"
    return [("8. memory, documents", f"N=4 per-rank peak ≤ 0.30× N=1 (varlen) at S={longest['seq_len']}", meas,
             longest["ratio_above"] <= 0.30, why)]


def check_doc_balance(r: Rec) -> List[Tuple[str, str, str, Optional[bool], str]]:
    worst = max(s["doc_pairs_ratio_max"] for s in r["summary"])
    zz = max(s["zigzag_pairs_ratio_max"] for s in r["summary"])
    meas = f"{_f(worst, 3)} (global zig-zag: up to {_f(zz)})"
    return [("9. balance, documents", "document-aware busiest / idlest ≤ 1.05 (pairs)", meas, worst <= 1.05, "")]


def check_strategies(r: Rec) -> List[Tuple[str, str, str, Optional[bool], str]]:
    out = []
    for x in [x for x in r["rows"] if x["world"] > 1]:
        if "error" in x:
            out.append((f"10. {x['label']}", "runs", x["error"], False, ""))
            continue
        worst = max(x.get("loss_rel_err", float("inf")), x.get("grad_rel_err", float("inf")))
        out.append((f"10. {x['label']} N={x['world']} exact", "loss and every grad ≤ 1e-5 rel. vs one process",
                    f"{worst:.1e}", worst <= 1e-5, ""))
        off = {k: q for k, q in x["counted_over_model"].items() if q != 1.0}
        out.append((f"10. {x['label']} N={x['world']} bytes", "counted = cost model, every kind",
                    ", ".join(f"{k} {_f(q, 3)}" for k, q in x["counted_over_model"].items() if x["model_per_layer"][k]),
                    not off and x["ranks_agree"], "" if not off else f"off by kind: {off}"))
    return out


CHECKS: Dict[str, Callable[[Rec], list]] = {
    "memory": check_memory, "balance": check_balance, "overlap": check_overlap, "e2e": check_e2e,
    "kernel": check_kernel, "vs_torch_cp": check_vs_torch, "compile": check_compile,
    "doc_memory": check_doc_memory, "doc_balance": check_doc_balance, "strategies": check_strategies,
}


def _machine_line(m: Dict[str, Any]) -> str:
    return (f"{m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB, torch {m['torch']}, Python {m['python']}, "
            f"{m['date']}" + (f", load average {m['load_avg_1min']} at the end" if "load_avg_1min" in m else ""))


def render(run: Optional[Rec] = None) -> str:
    """Write RESULTS.md (+ PNGs) from the records; ``run``: run_all's own record (command, wall time)."""
    import report_sections

    recs = load()
    run = run or recs.get("run_all")
    parts = ["# cp_compile benchmark results", "",
             "Written by `benchmarks/run_all.py` from the JSON records in this directory; every number below "
             "comes from the run that wrote it. How each benchmark measures is in `benchmarks/README.md` and "
             "in each script's `--help`. CPU only (gloo over 127.0.0.1); the machine is shared with other work, "
             "so times are noisy: ratios are medians over repeats unless stated.", ""]
    if run:
        parts += [f"- command: `{run['command']}`", f"- total wall time: {run['wall_seconds'] / 60:.1f} min",
                  f"- machine: {_machine_line(run['machine'])}"]
        later = [n for n, r in recs.items() if n != "run_all" and r["machine"]["date"] > run["machine"]["date"]]
        if later:
            parts.append(f"- re-run after that full run (each section gives its own command, date and load): "
                         f"{', '.join(later)}")
        parts.append("")
    head = []
    for name, check in CHECKS.items():
        if name in recs:
            head += [[what, target, meas, _verdict(ok), why] for what, target, meas, ok, why in check(recs[name])]
    if run and not run.get("quick"):
        ok = run["wall_seconds"] <= 20 * 60
        walls = ", ".join(f"{n} {recs[n]['wall_seconds']:.0f} s" for n in run["ran"] if n in recs)
        head.append(["run_all.py at defaults", "≤ 20 min on 2 cores", f"{run['wall_seconds'] / 60:.1f} min",
                     _verdict(ok), "" if ok else f"per benchmark (latest records): {walls}; machine load average "
                     f"{run['machine'].get('load_avg_1min', '?')} at the end of the run"])
    parts += ["## Targets", "",
              _table(["benchmark", "target", "measured", "verdict", "measured reason (misses)"], head), ""]
    for name, title, fn in report_sections.SECTIONS:
        if name not in recs:
            parts += [f"## {title}", "", "not run", ""]
            continue
        r = recs[name]
        parts += [f"## {title}", "", f"`{r['command']}` — {r['wall_seconds']:.0f} s; "
                  f"{_machine_line(r['machine'])}", "", fn(r), ""]
    text = "\n".join(parts)
    with open(os.path.join(common.RESULTS, "RESULTS.md"), "w") as f:
        f.write(text)
    return text


if __name__ == "__main__":
    render()
    print(f"wrote {os.path.relpath(os.path.join(common.RESULTS, 'RESULTS.md'), common.ROOT)}")
