"""Benchmark 1: per-rank peak memory of forward + backward vs sequence length and CP size.

    .venv/bin/python benchmarks/bench_memory.py                       # defaults (~12 min on 2 cores)
    .venv/bin/python benchmarks/bench_memory.py --seq-lens 4k,8k,16k,32k   # + S=32k (~9 min)
    .venv/bin/python benchmarks/bench_memory.py --seq-lens 4k,8k,16k,32k,64k --worlds 1,2,4,8 \\
        --llama-seq-lens 4k,16k,32k --cap-mib 4096                  # larger setting

The models, the unmodified example code in ``examples/models.py`` and ``examples/zoo/``:
* ``block``: one transformer block (a 1-layer Llama: embedding, RMSNorm, GQA attention
  with RoPE, SwiGLU, LM head over a 256-byte vocabulary, cross-entropy);
* ``llama``: the example Llama of ``examples/train_demo.py`` (dim 256, 2 layers, 4/2
  heads, SwiGLU 512, vocab 1024);
* ``llama_ac``: the same Llama with activation checkpointing, every block wrapped by
  ``checkpoint_wrapper`` (torchtitan's full AC; the model code unchanged), so that its N = 1
  row is the one-device AC reference and its N > 1 rows show AC + CP (``ratio_vs_no_ac``: each
  row over the ``llama`` row of the same S and N, CP alone);
* ``alibi``: one BLOOM-style ALiBi block (dim 256, 4 heads, GELU MLP 1024, vocab 256) whose
  causal bias ``slope_h · (k − q)`` is built in the graph from aranges and passed to SDPA as
  ``attn_mask``; the rewrite makes it a score rule of the ring op. N = 1 and 4 only. Its N = 1
  reference is the model with that attention computed without an S x S bias (as FlashAttention's
  ``alibi_slopes`` does on a GPU): ``cp_compile.ring_attention`` on one process with the bias as
  a ``score_mod`` (the graph-built (1, H, S, S) bias alone would be 1 GiB at S = 8k);
* ``t5``: one T5 encoder block (dim 256, 4 heads, ReLU MLP 1024 as T5's 4 · dim, vocab 256) whose bias is a learned
  (16, H) table read at the bucket of ``k − q`` (Hugging Face's ``_relative_position_bucket``), plus
  the padding row, added to hand-written unscaled scores; the rewrite makes it a score rule whose table
  trains. N = 1 and 4 only; its N = 1 reference is the same block with that attention run by
  ``cp_compile.ring_attention`` on one process with the bias as a ``score_mod`` reading the table.

For every (model, S, N) the script starts N fresh processes (one torch thread each,
gloo on 127.0.0.1). N = 1 runs ``torch.compile(model, backend=INNER)`` (same compiler,
no CP: the fair reference, the compiler alone changes what is saved for backward);
N > 1 runs ``torch.compile(model, backend=RingCP(inner=INNER))`` with every rank
passing the full batch. Step 1 (compile, warm-up) is not measured; step 2's forward
+ backward is, as the process's resident high-water mark (VmHWM):

* ``peak_rss``: the absolute process peak (includes the ~300-400 MiB Python + torch
  baseline, the weights, inputs and compiled code);
* ``peak_above``: the peak above the resident size just before step 2 (activations,
  gradients, temporaries). **The N-vs-1 ratio uses peak_above** (the max over ranks),
  because the baseline is a per-process constant that CP cannot and does not claim
  to divide.

Longest S under a per-process cap (``--cap-mib``, absolute RSS): *extrapolated*, not
run under a hard limit (RLIMIT_AS is unreliable with torch's virtual reservations):
a least-squares line peak_rss(S) = a + b*S through the measured points of each N is
solved for the cap. Memory here is linear in S (no O(S^2) tensor), which the fit's
residual in the output lets you check.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import os
import time
from typing import Any, Dict, List

import common

INNER = "aot_eager"
MODELS = {
    "block": dict(vocab_size=256, dim=256, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=512),
    "llama": dict(vocab_size=1024, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=512),
    "llama_ac": dict(vocab_size=1024, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=512),
    "alibi": dict(vocab=256, dim=256, n_layers=1, n_heads=4, batch=1),  # examples/zoo/alibi.py, causal, SDPA
    "t5": dict(vocab=256, dim=256, n_layers=1, n_heads=4, batch=1, ffn=1024),  # examples/zoo/t5_encoder.py
}


def _alibi_one_device(attn, q, k, v):
    """The ALiBi attention as one device runs it without an S x S bias (FlashAttention's alibi_slopes):
    cp_compile.ring_attention on one process with the bias as a score_mod, scores in row tiles."""
    import cp_compile

    return cp_compile.ring_attention(q, k, v, causal=True, score_mod=_alibi_score, score_buffers=[attn.slopes])


def _alibi_score(score, b, h, q_idx, kv_idx, slopes):
    return score + slopes[h] * (kv_idx - q_idx)


def _t5_one_device(attn, hidden_states, mask=None, position_bias=None):
    """The T5 attention as one device runs it without an S x S bias: cp_compile.ring_attention on one
    process with the learned bucketed bias as a score_mod reading the (num_buckets, H) table whole."""
    import cp_compile

    b, s = hidden_states.shape[:2]
    q, k, v = (f(hidden_states).view(b, s, attn.n_heads, -1).transpose(1, 2) for f in (attn.q, attn.k, attn.v))
    score = functools.partial(_t5_score, attn.num_buckets, attn.max_distance)
    out = cp_compile.ring_attention(q, k, v, scale=1.0, attn_mask=mask, score_mod=score,
                                    score_buffers=[attn.relative_attention_bias.weight])
    return attn.o(out.transpose(1, 2).reshape(b, s, -1)), position_bias


def _t5_score(num_buckets, max_distance, score, b, h, q_idx, kv_idx, table):
    from zoo.t5_encoder import T5Attention

    bucket = T5Attention._relative_position_bucket(kv_idx - q_idx, True, num_buckets, max_distance)
    return score + table[bucket, h]


def _model(model_name: str, seq_len: int, world: int):
    """(model, (input_ids, labels)) of one benchmark model; ``alibi`` and ``t5`` at N = 1 without the S x S bias."""
    import models
    from zoo import alibi, t5_encoder

    if model_name == "t5":
        model, args = t5_encoder.factory(seq_len, 0, **MODELS["t5"])
        for block in model.block if world == 1 else ():
            block.SelfAttention.forward = functools.partial(_t5_one_device, block.SelfAttention)
        return model, args
    if model_name != "alibi":
        model, args = models.llama_factory(seq_len=seq_len, batch=1, seed=0, max_seq_len=seq_len,
                                           **MODELS[model_name])
        if model_name == "llama_ac":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            model.layers = type(model.layers)(checkpoint_wrapper(block) for block in model.layers)
        return model, args
    model, args = alibi.factory(seq_len, 0, **MODELS["alibi"])
    for block in model.h if world == 1 else ():
        block.self_attention.attend = functools.partial(_alibi_one_device, block.self_attention)
    return model, args


def rank_step(rank: int, world: int, model_name: str, seq_len: int, inner: str) -> Dict[str, Any]:
    """In one rank: compile, warm up, then measure the peak of one forward + backward."""
    import torch

    import cp_compile

    model, args = _model(model_name, seq_len, world)
    backend = inner if world == 1 else cp_compile.RingCP(inner=inner)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    return common.measure_train_step(model, compiled, args, world)  # input_ids, (attention_mask,) labels: (1, S)


def measure_all(args) -> List[Dict[str, Any]]:
    """Every (model, S, N) configuration, each in fresh processes."""
    configs = [("block", s, n) for s in args.seq_lens for n in args.worlds]
    configs += [(name, s, n) for name in ("llama", "llama_ac") for s in args.llama_seq_lens for n in args.worlds]
    configs += [("alibi", s, n) for s in args.alibi_seq_lens for n in args.worlds if n in (1, 4)]
    configs += [("t5", s, n) for s in args.t5_seq_lens for n in args.worlds if n in (1, 4)]
    configs = [c for c in configs if c[0] in args.models]
    rows = []
    for i, (model_name, s, n) in enumerate(configs, 1):
        common.log(f"[{i}/{len(configs)}] {model_name} S={s} N={n}")
        res = common.try_run_ranks(rank_step, n, model_name, s, args.inner)
        row: Dict[str, Any] = {"model": model_name, "seq_len": s, "world": n, "command": common.command()}
        if isinstance(res, dict):
            row["error"] = res["error"]
        else:
            row.update(ranks=res, peak_above_mib=max(r["peak_above_mib"] for r in res),
                       peak_rss_mib=max(r["peak_rss_mib"] for r in res),
                       base_rss_mib=max(r["base_rss_mib"] for r in res),
                       seconds=max(r["seconds"] for r in res), loss=res[0]["loss"])
        rows.append(row)
    return rows


def merge_kept(rows: List[Dict[str, Any]], path: str) -> None:
    """``--merge``: the rows of the record at ``path`` that this run did not measure (same model, S, N)
    are kept beside this run's, each with the command and date that measured it."""
    import json

    if not os.path.exists(path):
        return
    with open(path) as f:
        old = json.load(f)
    done = {(r["model"], r["seq_len"], r["world"]) for r in rows}
    kept = [r for r in old["rows"] if (r["model"], r["seq_len"], r["world"]) not in done]
    for r in kept:  # rows of a record written before rows carried their command: the record's
        r.setdefault("command", old["command"])
        r.setdefault("date", old["machine"].get("date", "?"))
    rows[:0] = kept


def add_ratios(rows: List[Dict[str, Any]]) -> None:
    """ratio_above / ratio_rss: each row's per-rank peak over the N=1 row of the same model and S."""
    ref = {(r["model"], r["seq_len"]): r for r in rows if r["world"] == 1 and "error" not in r}
    for r in rows:
        base = ref.get((r["model"], r["seq_len"]))
        if base is None or "error" in r:
            continue
        r["ratio_above"] = r["peak_above_mib"] / base["peak_above_mib"]
        r["ratio_rss"] = r["peak_rss_mib"] / base["peak_rss_mib"]
    plain = {(r["seq_len"], r["world"]): r for r in rows if r["model"] == "llama" and "error" not in r}
    for r in rows:  # AC (+ CP) against the same CP without AC
        other = plain.get((r["seq_len"], r["world"]))
        if r["model"] == "llama_ac" and other is not None and "error" not in r:
            r["ratio_vs_no_ac"] = r["peak_above_mib"] / other["peak_above_mib"]


def longest_under_cap(rows: List[Dict[str, Any]], cap_mib: float) -> List[Dict[str, Any]]:
    """Per (model, N): the S at which the least-squares line through peak_rss(S) reaches the cap."""
    import numpy as np

    out = []
    for key in sorted({(r["model"], r["world"]) for r in rows}):
        pts = [(r["seq_len"], r["peak_rss_mib"]) for r in rows
               if (r["model"], r["world"]) == key and "error" not in r]
        if len(pts) < 2:
            continue
        s, m = np.array(pts, dtype=float).T
        b, a = np.polyfit(s, m, 1)  # peak_rss ≈ a + b*S
        resid = float(np.max(np.abs(a + b * s - m)))
        s_max = (cap_mib - a) / b if b > 0 else float("inf")
        out.append({"model": key[0], "world": key[1], "intercept_mib": a, "mib_per_1k_tokens": b * 1024,
                    "max_fit_residual_mib": resid, "longest_seq_len": int(s_max), "cap_mib": cap_mib,
                    "measured_up_to": int(s.max())})
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--seq-lens", type=common.int_list, default=common.int_list("4k,8k,16k"),
                   help="block model sequence lengths (default 4k,8k,16k; add 32k for the issue's full range)")
    p.add_argument("--llama-seq-lens", type=common.int_list, default=common.int_list("16k"),
                   help="example-Llama sequence lengths, with and without activation checkpointing (default 16k)")
    p.add_argument("--alibi-seq-lens", type=common.int_list, default=common.int_list("8k"),
                   help="ALiBi block (examples/zoo/alibi.py) sequence lengths, N = 1 and 4 (default 8k)")
    p.add_argument("--t5-seq-lens", type=common.int_list, default=common.int_list("8k"),
                   help="T5 block (examples/zoo/t5_encoder.py, a learned relative bias) sequence lengths, N = 1 and "
                        "4 (default 8k)")
    p.add_argument("--worlds", type=common.int_list, default=[1, 2, 4], help="CP sizes (default 1,2,4)")
    p.add_argument("--inner", default=INNER, choices=("aot_eager", "inductor"), help="inner compiler")
    p.add_argument("--cap-mib", type=float, default=2048.0, help="per-process RSS cap for the longest-S estimate")
    p.add_argument("--models", type=lambda t: t.split(","), default=list(MODELS),
                   help=f"models to run (default all: {','.join(MODELS)})")
    p.add_argument("--merge", action="store_true",
                   help="keep the rows of results/memory.json this run does not measure, each with the command "
                        "and date that measured it; e.g. --models alibi,t5 --merge re-measures those rows only")
    args = p.parse_args(argv)
    started = time.perf_counter()
    rows = measure_all(args)
    for r in rows:
        r["date"] = common.machine()["date"]
    with open(os.path.join(common.RESULTS, ".memory.lock"), "w") as lock:  # merging runs: one at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        if args.merge:
            merge_kept(rows, os.path.join(common.RESULTS, "memory.json"))
        _finish(rows, args, started)


def _finish(rows: List[Dict[str, Any]], args: Any, started: float) -> None:
    """Ratios, the log lines, the longest-S fit and the record."""
    add_ratios(rows)
    for r in rows:
        if "error" in r:
            common.log(f"{r['model']:6s} S={r['seq_len']:6d} N={r['world']}: FAILED {r['error']}")
        else:
            common.log(f"{r['model']:6s} S={r['seq_len']:6d} N={r['world']}: above {r['peak_above_mib']:8.1f} MiB "
                       f"(x{r.get('ratio_above', float('nan')):.2f}), rss {r['peak_rss_mib']:8.1f} MiB")
    cap = longest_under_cap(rows, args.cap_mib)
    for c in cap:
        common.log(f"{c['model']} N={c['world']}: longest S under {args.cap_mib:.0f} MiB ≈ {c['longest_seq_len']}")
    common.write_result("memory", {"rows": rows, "cap": cap, "inner": args.inner}, started, args)


if __name__ == "__main__":
    main()
