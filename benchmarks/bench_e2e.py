"""Benchmark 4: end to end, one training step of the example Llama at S = 16k.

    .venv/bin/python benchmarks/bench_e2e.py                         # defaults (~4 min on 2 cores)
    .venv/bin/python benchmarks/bench_e2e.py --seq-len 32768 --layers 4 --steps 5

The example Llama (``examples/models.py``: dim 256, 2 layers, 4/2 heads, SwiGLU 512,
vocab 1024), batch 1, fp32, one AdamW training step (forward, backward, optimizer
step), the same machine used four ways:

* ``cp compiled``: 2 ranks x 1 thread (gloo on 127.0.0.1), unmodified model,
  ``torch.compile(model, backend=RingCP(inner="inductor"))``, every rank passing the full batch;
  the time spent in the same-batch check (``check_batch``, on by default: a fingerprint of
  input_ids and labels and one all-gather per call, ``cp_compile/backend/batch_guard.py``) is
  timed inside each step;
* ``cp compiled, no batch check``: the same with ``check_batch=False``, run right after it;
* ``single compiled``: 1 process x 2 threads, ``torch.compile(model, backend="inductor")``;
* ``cp eager (hand)``: 2 ranks x 1 thread, no compiler, ``cp_compile.ring_attention``
  inserted by hand: the Llama forward re-written over this rank's zig-zag shard
  (RoPE rows indexed by ``cp_compile.positions``), cross-entropy summed locally and
  divided by the global label count, parameter gradients all-reduced in one bucket.

Step 1 compiles (Inductor cache under ``.cache/benchmarks/inductor-e2e``) and is not
timed; then ``--steps`` steps are timed (median, slowest rank); the first of them
is also the memory step (VmHWM above the resident size before it, max over ranks;
see ``benchmarks/common.py``). Targets: step time cp/single <= 1.05, per-rank peak
cp/single <= 0.6, compiled/eager-hand <= 1.0, time in the batch check <= 2% of the cp step
(the step on/off ratio is reported too: at 2% it is within the noise of a few steps). Losses are
printed to show all four compute the same step.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Callable, Dict, List

import common

CHECKED, UNCHECKED = "cp compiled", "cp compiled, no batch check"
CFG = dict(vocab_size=1024, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=512)


def hand_cp_loss(model, input_ids, labels):
    """The Llama forward over this rank's shard with ring_attention by hand; local share of the mean loss."""
    import torch.distributed as dist
    import torch.nn.functional as F

    import cp_compile
    import models

    b, s = input_ids.shape
    pos = cp_compile.positions(s)  # (S/N,) this rank's global positions (zig-zag)
    ids, lab = input_ids[:, pos], labels[:, pos]  # (B, c)
    cos, sin = model.rope_cos[pos], model.rope_sin[pos]  # (c, D)
    x = model.tok_emb(ids)  # (B, c, dim)
    for layer in model.layers:
        a, h = layer.attn, layer.attn_norm(x)
        c, nh, nk, d = ids.shape[1], a.cfg.n_heads, a.cfg.n_kv_heads, a.head_dim
        q = models.apply_rope(a.wq(h).view(b, c, nh, d), cos, sin).transpose(1, 2)  # (B, H, c, D)
        k = models.apply_rope(a.wk(h).view(b, c, nk, d), cos, sin).transpose(1, 2)  # (B, Hkv, c, D)
        v = a.wv(h).view(b, c, nk, d).transpose(1, 2)
        o = cp_compile.ring_attention(q, k, v, causal=True)  # (B, H, c, D)
        x = x + a.wo(o.transpose(1, 2).reshape(b, c, nh * d))
        x = x + layer.mlp(layer.mlp_norm(x))
    logits = model.lm_head(model.norm(x))  # (B, c, V)
    loss_sum = F.cross_entropy(logits.view(-1, logits.shape[-1]), lab.reshape(-1), ignore_index=-100,
                               reduction="sum")
    count = (lab != -100).sum()
    dist.all_reduce(count)
    return loss_sum / count


def _all_reduce_grads(model) -> None:
    """Sum parameter gradients over the CP group in one flat bucket."""
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def make_step(mode: str, world: int, args) -> Callable[[], float]:
    """A training-step closure for ``mode``: CHECKED | UNCHECKED | "single compiled" | "cp eager (hand)"."""
    import torch
    import torch.distributed as dist

    import cp_compile
    import models

    model, (input_ids, labels) = models.llama_factory(seq_len=args.seq_len, batch=1, seed=0,
                                                      max_seq_len=args.seq_len, **{**CFG, "n_layers": args.layers})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if mode == "cp eager (hand)":
        def loss_fn():
            return hand_cp_loss(model, input_ids, labels)
    else:
        backend = ("inductor" if mode == "single compiled" else
                   cp_compile.RingCP(inner="inductor", check_batch=mode == CHECKED))
        compiled = torch.compile(model, backend=backend, fullgraph=True)

        def loss_fn():
            return compiled(input_ids, labels)

    def step() -> float:
        loss = loss_fn()
        loss.backward()
        if mode == "cp eager (hand)":
            _all_reduce_grads(model)
            loss = loss.detach().clone()
            dist.all_reduce(loss)  # the global mean, as the compiled model returns it
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def time_batch_checks() -> List[float]:
    """Wall seconds of every same-batch check from now on (``batch_guard.check_same_batch`` wrapped:
    fingerprints, the all-gather and the comparison). Stays empty when no check runs."""
    from cp_compile.backend import batch_guard

    spent: List[float] = []
    check = batch_guard.check_same_batch

    def timed_check(*a: Any) -> None:
        t0 = time.perf_counter()
        try:
            check(*a)
        finally:
            spent.append(time.perf_counter() - t0)

    batch_guard.check_same_batch = timed_check
    return spent


def rank_main(rank: int, world: int, mode: str, args) -> Dict[str, Any]:
    """Warm-up step, then timed steps; the first timed one also measures peak memory."""
    import torch.distributed as dist

    sync = dist.barrier if world > 1 else (lambda: None)
    checks = time_batch_checks()
    step = make_step(mode, world, args)
    t0 = time.perf_counter()
    first_loss = step()
    compile_s = time.perf_counter() - t0
    sync()
    mem = common.measure_peak(step)
    del checks[:]  # from here on: the timed steps' checks
    times = [common.timed(step, sync) for _ in range(args.steps)]
    return {"first_step_s": compile_s, "times": times, "loss_step1": first_loss, "batch_checks": list(checks),
            **{k: mem[k] for k in ("peak_above_mib", "peak_rss_mib", "base_rss_mib")}}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="timed steps after warm-up and the memory step")
    args = p.parse_args(argv)
    started = time.perf_counter()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(common.CACHE, "inductor-e2e"))
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    runs = {"single compiled": (1, 2), CHECKED: (2, 1), UNCHECKED: (2, 1),  # mode: (ranks, threads)
            "cp eager (hand)": (2, 1)}
    rows = []
    for mode, (world, threads) in runs.items():
        common.log(f"{mode}: {world} process(es) x {threads} thread(s), S={args.seq_len}")
        res = common.try_run_ranks(rank_main, world, mode, args, threads=threads)
        if isinstance(res, dict):
            rows.append({"mode": mode, "error": res["error"]})
            common.log(f"  FAILED: {res['error']}")
            continue
        step_s = common.median([max(ts) for ts in zip(*(r["times"] for r in res))])
        rows.append({"mode": mode, "ranks": world, "threads": threads, "step_s": step_s,
                     "peak_above_mib": max(r["peak_above_mib"] for r in res),
                     "peak_rss_mib": max(r["peak_rss_mib"] for r in res),
                     "first_step_s": max(r["first_step_s"] for r in res), "loss_step1": res[0]["loss_step1"],
                     # per step: seconds in the batch check (slowest rank) and how many checks ran
                     "batch_check_s": common.median([max(c) for c in zip(*(r["batch_checks"] for r in res))] or [0.0]),
                     "batch_checks_per_step": len(res[0]["batch_checks"]) / args.steps})
        common.log(f"  step {step_s:.2f} s, peak above baseline {rows[-1]['peak_above_mib']:.0f} MiB, "
                   f"loss {rows[-1]['loss_step1']:.6f}")
    by = {r["mode"]: r for r in rows if "error" not in r}
    ratios = {}
    if "cp compiled" in by and "single compiled" in by:
        ratios["step_cp_over_single"] = by["cp compiled"]["step_s"] / by["single compiled"]["step_s"]
        ratios["peak_cp_over_single"] = by["cp compiled"]["peak_above_mib"] / by["single compiled"]["peak_above_mib"]
        ratios["rss_cp_over_single"] = by["cp compiled"]["peak_rss_mib"] / by["single compiled"]["peak_rss_mib"]
    if "cp compiled" in by and "cp eager (hand)" in by:
        ratios["step_compiled_over_eager_hand"] = by["cp compiled"]["step_s"] / by["cp eager (hand)"]["step_s"]
    if CHECKED in by:
        ratios["batch_check_over_step"] = by[CHECKED]["batch_check_s"] / by[CHECKED]["step_s"]
    if CHECKED in by and UNCHECKED in by:
        ratios["step_check_on_over_off"] = by[CHECKED]["step_s"] / by[UNCHECKED]["step_s"]
    common.log(" ".join(f"{k}={v:.4f}" for k, v in ratios.items()))
    common.write_result("e2e", {"rows": rows, "ratios": ratios}, started, args)


if __name__ == "__main__":
    main()
