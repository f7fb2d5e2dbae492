"""Benchmark 6: cp_compile's ring attention vs PyTorch's ``context_parallel``, same shapes, same run.

    .venv/bin/python benchmarks/bench_vs_torch_cp.py                 # defaults (~1 min on 2 cores)
    .venv/bin/python benchmarks/bench_vs_torch_cp.py --seq-len 32768 --worlds 2,4 --repeats 5

On N gloo ranks (127.0.0.1, one torch thread each), forward + backward of attention
over q, k, v of shape (1, H, S, D) (H = H_kv: PyTorch's ring wants equal head
counts), non-causal and causal, three implementations:

1. ``cp_compile``: ``cp_compile.ring_attention`` on ``cp_compile.shard`` shards (zig-zag);
2. ``torch context_parallel``: the public API as documented —
   ``with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
   F.scaled_dot_product_attention(...)`` with a CPU ``DeviceMesh``. Where it fails
   on CPU the exact exception is recorded instead of a time;
3. ``torch ring -> CPU kernel``: PyTorch's own ring loops (the private
   ``_templated_ring_attention`` and ``_templated_ring_attention_backward`` that
   ``context_parallel`` dispatches to on CUDA, with its head-tail load balancing for
   causal, i.e. the same token layout as zig-zag) called directly with the CPU flash
   kernel ``aten._scaled_dot_product_flash_attention_for_cpu`` as the block op. This
   is the closest PyTorch path that runs on CPU; its output is checked against (1).

Time: the slowest rank, median over ``--repeats``; ratio = torch / cp_compile.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any, Callable, Dict, List

import common

def _cpu_fwd(query, key, value, *, is_causal: bool, scale: float):
    """PyTorch ring's block op on CPU: (out, lse)."""
    import torch

    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, is_causal,
                                                                          scale=scale)
    return out, lse


def _cpu_bwd(*, query, key, value, out, logsumexp, is_causal: bool, grad_out, scale: float):
    """PyTorch ring's block backward on CPU: (dq, dk, dv)."""
    import torch

    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp.contiguous(), 0.0, is_causal, scale=scale)


def _torch_ring(q, k, v, causal: bool, pg):
    """Out (local rows) and a backward closure of PyTorch's ring routed to the CPU kernel."""
    import torch
    from torch.distributed.tensor.experimental._context_parallel import _attention as A

    scale = 1.0 / math.sqrt(q.shape[-1])
    old = A._cp_options.enable_load_balance
    A._cp_options.enable_load_balance = causal  # head-tail (= zig-zag) layout for causal, as context_parallel sets
    try:
        out, lse = A._templated_ring_attention(pg, 2, _cpu_fwd, q, k, v, is_causal=causal, scale=scale)[:2]
        dout = torch.ones_like(out)
        A._templated_ring_attention_backward(pg, 2, _cpu_bwd, dout, "grad_out", q, k, v, out.to(q.dtype), lse,
                                             causal, scale=scale)
    finally:
        A._cp_options.enable_load_balance = old
    return out


def _torch_public(full, causal: bool, world: int) -> None:
    """The documented context_parallel path (raises on CPU where unsupported)."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (world,))
    q, k, v = (t.clone() for t in full)
    with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
        out.backward(torch.ones_like(out))


def _repeat(fn: Callable[[], Any], repeats: int) -> Dict[str, Any]:
    """Warm-up + timed repeats, or the exact error of the first call."""
    import torch.distributed as dist

    try:
        fn()
    except Exception as e:  # record, don't hide: this is what a user on CPU would see
        msg = " ".join(str(e).split())
        return {"error": f"{type(e).__name__}: {msg[:300]}"}
    return {"times": [common.timed(fn, dist.barrier) for _ in range(repeats)]}


def rank_main(rank: int, world: int, args) -> List[Dict[str, Any]]:
    """All implementations x {non-causal, causal} on this rank."""
    import torch
    import torch.distributed as dist

    import cp_compile

    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, args.heads, args.seq_len, args.head_dim, generator=g) for _ in range(3)]
    local = [cp_compile.shard(t, 2) for t in full]  # zig-zag == PyTorch's head-tail layout
    rows = []
    for causal in (False, True):
        def ours() -> torch.Tensor:
            q, k, v = (t.clone().requires_grad_() for t in local)
            out = cp_compile.ring_attention(q, k, v, causal=causal)
            out.backward(torch.ones_like(out))
            return out.detach()

        def theirs() -> torch.Tensor:
            return _torch_ring(*(t.clone() for t in local), causal, dist.group.WORLD)

        diff = ((theirs() - ours()).norm() / ours().norm()).item()
        rows.append({"causal": causal, "impl": "cp_compile", **_repeat(ours, args.repeats)})
        rows.append({"causal": causal, "impl": "torch context_parallel",
                     **_repeat(lambda: _torch_public(full, causal, world), args.repeats)})
        rows.append({"causal": causal, "impl": "torch ring -> CPU kernel", "out_rel_diff": diff,
                     **_repeat(theirs, args.repeats)})
    return rows


def combine(world: int, per_rank: List[List[Dict[str, Any]]], seq_len: int) -> List[Dict[str, Any]]:
    """Slowest rank per repeat, median; ratio to cp_compile."""
    out = []
    for i, row in enumerate(per_rank[0]):
        rec = {"world": world, "seq_len": seq_len, "causal": row["causal"], "impl": row["impl"]}
        if "error" in row:
            rec["error"] = row["error"]
        else:
            rec["seconds"] = common.median([max(ts) for ts in zip(*(r[i]["times"] for r in per_rank))])
        if "out_rel_diff" in row:
            rec["out_rel_diff"] = max(r[i]["out_rel_diff"] for r in per_rank)
        out.append(rec)
    for rec in out:
        ref = next(r for r in out if r["causal"] == rec["causal"] and r["impl"] == "cp_compile")
        if "seconds" in rec and "seconds" in ref:
            rec["ratio_vs_cp_compile"] = rec["seconds"] / ref["seconds"]
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--worlds", type=common.int_list, default=[2])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    started = time.perf_counter()
    rows = []
    for world in args.worlds:
        common.log(f"N={world}, S={args.seq_len}: cp_compile / torch context_parallel / torch ring on the CPU kernel")
        rows += combine(world, common.run_ranks(rank_main, world, args), args.seq_len)
    for r in rows:
        what = f"{r['seconds']:.3f} s (x{r.get('ratio_vs_cp_compile', 1):.2f})" if "seconds" in r else r["error"]
        common.log(f"N={r['world']} causal={r['causal']!s:5} {r['impl']:26s} {what}")
    common.write_result("vs_torch_cp", {"rows": rows}, started, args)


if __name__ == "__main__":
    main()
