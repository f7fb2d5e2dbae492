"""Benchmark 10: the CP strategies of issue 29 side by side: ring, Ulysses, 2-D (Ulysses x ring).

    .venv/bin/python benchmarks/bench_strategies.py                      # defaults (~10 min on 2 busy cores)
    .venv/bin/python benchmarks/bench_strategies.py --seq-len 1024 --steps 2   # quick
    .venv/bin/python benchmarks/bench_strategies.py --seq-len 16k --world 8 --ulysses-degree 2,4  # larger

The model: the example Llama (``examples/models.py`` ``llama_factory``: embedding, RMSNorm, GQA
attention with RoPE, SwiGLU, LM head, cross-entropy) with 8 query heads over 2 K/V heads (GQA 4:1, so
that Ulysses' K/V replication shows), dim 256 (head_dim 32), 2 layers, vocab 1024, batch 1, fp32.

One run, fresh processes per configuration (one torch thread each, gloo on 127.0.0.1): the
one-process reference (``torch.compile(model, backend="aot_eager")``, plus the eager model for the
gradients), then N ranks through ``RingCP(inner="aot_eager", strategy=...)`` for ``ring``, ``ulysses``
(u = N) and ``2d`` (u x r = N for each ``--ulysses-degree``), every rank passing the full batch. Per
configuration, after a compile + warm-up step:

1. **exactness**: the loss and every parameter gradient of the measured step against the eager
   one-process step (relative error in the norm, ``examples/_exact.py`` ``grad_errors`` and ``rel``:
   what ``tests/checks.py`` ``loss_and_grad_errors`` computes), worst over ranks;
2. **peak memory per rank** of that step (``common.measure_train_step``: VmHWM above the resident
   size before the step, max over ranks), as a ratio to the one-process run;
3. **bytes sent per attention layer per rank**, counted at runtime by ``cp_compile.traffic.measure()``
   over one more step (forward + backward) and divided by the number of layers, beside the cost
   model's prediction ``cp_compile.ulysses.cost.strategy_cost`` for the attention's shape (batch,
   heads, K/V heads, head_dim, padded S, 4 bytes, causal); counted / model per kind (it should be 1);
4. **step time**: median over ``--steps`` steps (each started by a barrier; the slowest rank's
   median), no target: N ranks share the 2 cores, so the time mixes compute, gloo and contention.
   Twice: in each configuration's own run, and once more with the N-rank strategies compiled side by
   side in one set of ranks and timed in turn, one step each per round (``--steps`` rounds), so that
   a change in the machine's load between configurations does not read as a strategy's cost.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Dict, List, Optional

import common

INNER = "aot_eager"
MODEL = dict(vocab_size=1024, dim=256, n_layers=2, n_heads=8, n_kv_heads=2, ffn_hidden=512)
KINDS = {"ring K/V": "ring_kv_bytes", "ring dK/dV": "ring_acc_bytes", "all_to_all": "a2a_bytes"}


def _model(seq_len: int):
    import models

    return models.llama_factory(seq_len=seq_len, batch=1, seed=0, max_seq_len=seq_len, **MODEL)


def _timed_steps(compiled: Any, model: Any, args: tuple, steps: int, world: int) -> List[float]:
    import torch

    def step() -> None:
        model.zero_grad(set_to_none=True)
        compiled(*args).backward()

    sync = torch.distributed.barrier if world > 1 else (lambda: None)
    return [common.timed(step, sync) for _ in range(steps)]


def rank_run(rank: int, world: int, seq_len: int, strategy: str, u: Optional[int], steps: int) -> Dict[str, Any]:
    """In one rank: compile + warm up, the measured step (peak memory, gradients), one step under
    ``traffic.measure()``, then ``steps`` timed steps. ``world == 1``: the compiled one-process run,
    and the eager model's loss and gradients (the exactness reference)."""
    import torch

    import cp_compile

    model, args = _model(seq_len)
    if world == 1:
        backend: Any = INNER
    else:
        backend = cp_compile.RingCP(inner=INNER, strategy=strategy, **({} if u is None else {"ulysses_degree": u}))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    m = common.measure_train_step(model, compiled, args, world)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    with cp_compile.traffic.measure() as sent:
        model.zero_grad(set_to_none=True)
        compiled(*args).backward()
    m["sent"] = dict(sent)
    m["step_s"] = _timed_steps(compiled, model, args, steps, world)
    if world == 1:  # the exactness reference: the eager model on the whole sequence
        model.zero_grad(set_to_none=True)
        loss = model(*args)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        m["eager_loss"] = loss.item()
    m["grads"] = grads
    m["chosen"] = _chosen(backend)
    m["fallbacks"] = len(getattr(backend, "fallbacks", []))
    return m


def rank_interleaved(rank: int, world: int, seq_len: int, plans: List[tuple], rounds: int) -> Dict[str, List[float]]:
    """In one rank: every strategy of ``plans`` ((label, strategy, u)) compiled on its own copy of the model
    and warmed up, then ``rounds`` rounds of one timed step each, in turn, so that every strategy's
    steps see the same load on the shared cores."""
    import torch

    import cp_compile

    runs = []
    for label, strategy, u in plans:
        model, args = _model(seq_len)
        backend = cp_compile.RingCP(inner=INNER, strategy=strategy, **({} if u is None else {"ulysses_degree": u}))
        runs.append((label, model, torch.compile(model, backend=backend, fullgraph=True), args))
        _timed_steps(runs[-1][2], model, args, 1, world)  # compile + warm-up
    times: Dict[str, List[float]] = {label: [] for label, _, _, _ in runs}
    for _ in range(rounds):
        for label, model, compiled, args in runs:
            times[label] += _timed_steps(compiled, model, args, 1, world)
    return times


def _chosen(backend: Any) -> List[str]:
    """What the strategy pass decided for each attention of the rewritten graphs ("ring", "2d u=2 x r=2")."""
    import torch

    from cp_compile.passes.ring_call import ring_call

    fwd = torch.ops.cp_compile.ring_attention_fwd.default
    out = []
    for gm in getattr(backend, "graphs", []):
        for node in gm.graph.find_nodes(op="call_function", target=fwd):
            call = ring_call(node)
            out.append(f"{call.strategy} u={call.ulysses}")
    return out


def _errors(ref: Dict[str, Any], res: List[Dict[str, Any]]) -> Dict[str, float]:
    """Loss and worst parameter-gradient relative error of every rank against the reference."""
    import torch

    from _exact import grad_errors, rel

    ref_model, _ = _model(8)
    cp_model, _ = _model(8)
    for n, p in ref_model.named_parameters():
        p.grad = ref["grads"].get(n)
    loss_err, grad_err = 0.0, 0.0
    for r in res:
        for n, p in cp_model.named_parameters():
            p.grad = r["grads"].get(n)
        loss_err = max(loss_err, rel(torch.tensor(r["loss"], dtype=torch.float64),
                                     torch.tensor(ref["eager_loss"], dtype=torch.float64)))
        grad_err = max(grad_err, max(grad_errors(cp_model, ref_model).values()))
    return {"loss_rel_err": loss_err, "grad_rel_err": grad_err}


def _bytes(res: List[Dict[str, Any]], seq_len: int, world: int, strategy: str, u: Optional[int]) -> Dict[str, Any]:
    """Counted bytes per layer per rank (every rank's: they must agree) beside the cost model's."""
    from cp_compile.ulysses.cost import AttentionShape, strategy_cost

    padded = -(-seq_len // (2 * world)) * 2 * world  # the zig-zag layout pads to a multiple of 2N
    shape = AttentionShape(1, MODEL["n_heads"], MODEL["n_kv_heads"], MODEL["dim"] // MODEL["n_heads"], padded, 4,
                           True)
    cost = strategy_cost(shape, world, strategy, u)
    layers = MODEL["n_layers"]
    per_rank = [{k: r["sent"].get(k, 0) / layers for k in KINDS} for r in res]
    model = {k: getattr(cost, f) for k, f in KINDS.items()}
    ratio = {k: (per_rank[0][k] / model[k] if model[k] else (1.0 if per_rank[0][k] == 0 else float("inf")))
             for k in KINDS}
    return {"sent_per_layer": per_rank[0], "ranks_agree": all(p == per_rank[0] for p in per_rank),
            "unknown_kinds": sorted({k for r in res for k in r["sent"]} - set(KINDS)),
            "model_per_layer": model, "counted_over_model": ratio, "u": cost.u, "r": cost.r,
            "padded_seq_len": padded, "model_total": cost.total_bytes}


def configs(args) -> List[tuple]:
    """(label, world, strategy, u): the one-process reference first, then each strategy at N."""
    out = [("one process", 1, "ring", None), ("ring", args.world, "ring", None),
           ("ulysses", args.world, "ulysses", None)]
    out += [(f"2d u={d} x r={args.world // d}", args.world, "2d", d) for d in args.ulysses_degree
            if 1 < d < args.world and args.world % d == 0]
    return out


def measure_all(args) -> List[Dict[str, Any]]:
    rows: List[Dict[str, Any]] = []
    ref = None
    todo = configs(args)
    for i, (label, world, strategy, u) in enumerate(todo, 1):
        common.log(f"[{i}/{len(todo)}] {label} N={world} S={args.seq_len}")
        res = common.try_run_ranks(rank_run, world, args.seq_len, strategy, u, args.steps)
        row: Dict[str, Any] = {"label": label, "world": world, "strategy": strategy if world > 1 else "none",
                               "seq_len": args.seq_len}
        if isinstance(res, dict):
            rows.append({**row, "error": res["error"]})
            continue
        row.update(peak_above_mib=max(r["peak_above_mib"] for r in res),
                   peak_rss_mib=max(r["peak_rss_mib"] for r in res),
                   step_s=max(common.median(r["step_s"]) for r in res), loss=res[0]["loss"],
                   fallbacks=max(r["fallbacks"] for r in res), chosen=res[0]["chosen"])
        if world == 1:
            ref = res[0]
            row["eager_loss"] = ref["eager_loss"]
        else:
            row.update(_bytes(res, args.seq_len, world, strategy, u))
            if ref is not None:
                row.update(_errors(ref, res))
        rows.append(row)
    _interleaved(rows, todo, args)
    return rows


def _interleaved(rows: List[Dict[str, Any]], todo: List[tuple], args: Any) -> None:
    """``step_s_interleaved``: the N-rank strategies timed in turn in one set of ranks (the slowest rank's median)."""
    plans = [(label, strategy, u) for label, world, strategy, u in todo if world > 1]
    if args.steps < 1 or not plans:
        return
    common.log(f"[interleaved] {', '.join(p[0] for p in plans)} N={args.world}, {args.steps} rounds")
    res = common.try_run_ranks(rank_interleaved, args.world, args.seq_len, plans, args.steps)
    for row in rows:
        if row["world"] == 1:
            continue
        if isinstance(res, dict):
            row["interleaved_error"] = res["error"]
        else:
            row["step_s_interleaved"] = max(common.median(r[row["label"]]) for r in res)


def _finish(rows: List[Dict[str, Any]]) -> None:
    one = next((r for r in rows if r["world"] == 1 and "error" not in r), None)
    for r in rows:
        if "error" in r:
            common.log(f"{r['label']:16s}: FAILED {r['error']}")
            continue
        if one is not None:
            r["ratio_above"] = r["peak_above_mib"] / one["peak_above_mib"]
            r["step_over_one"] = r["step_s"] / one["step_s"]
        extra = ""
        if r["world"] > 1:
            extra = (f" loss {r.get('loss_rel_err', float('nan')):.1e} grad {r.get('grad_rel_err', float('nan')):.1e} "
                     + " ".join(f"{k} {r['sent_per_layer'][k]:.0f}/{r['model_per_layer'][k]}" for k in KINDS))
        common.log(f"{r['label']:16s}: peak {r['peak_above_mib']:8.1f} MiB (x{r.get('ratio_above', 1):.2f}) "
                   f"step {r['step_s']:.2f} s" + (f" (in turn {r['step_s_interleaved']:.2f} s)"
                                                   if "step_s_interleaved" in r else "") + extra)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--seq-len", type=lambda t: common.int_list(t)[0], default=4096,
                   help="sequence length S (default 4096; padded to a multiple of 2N)")
    p.add_argument("--world", type=int, default=4, help="CP size N (default 4)")
    p.add_argument("--ulysses-degree", type=common.int_list, default=[2],
                   help="2d Ulysses degrees u (1 < u < N, dividing N; default 2: u=2 x r=2)")
    p.add_argument("--steps", type=int, default=5,
                   help="timed steps after the measured ones, and rounds of the strategies in turn (default 5)")
    args = p.parse_args(argv)
    started = time.perf_counter()
    rows = measure_all(args)
    _finish(rows)
    common.write_result("strategies", {"rows": rows, "model": MODEL, "inner": INNER, "kinds": KINDS}, started, args)


if __name__ == "__main__":
    main()
