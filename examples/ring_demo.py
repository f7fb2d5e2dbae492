"""Ring attention on 2 CPU ranks vs single-process SDPA: error and per-rank peak memory.

    python examples/ring_demo.py [--seq-len 8192] [--world-size 2] [--heads 8] [--kv-heads 2]

Three kinds of process, each measured alone:
1. one process runs ``F.scaled_dot_product_attention`` forward + backward on the full
   sequence (the single-device run users compare against);
2. ``--world-size`` processes (gloo on 127.0.0.1) each take their zig-zag shard of
   the same inputs and run ``cp_compile.ring_attention`` forward + backward;
3. the parent reassembles the shards and prints the relative errors of the output
   and of dq/dk/dv against (1), and each process's peak memory.

Peak memory is the process's resident high-water mark (VmHWM) during the
attention forward + backward, minus its resident size just before (the high-water
mark is reset through /proc/self/clear_refs), after a small warm-up run, with
glibc returning large blocks to the OS (MALLOC_MMAP_THRESHOLD_): it counts the
activations, outputs and gradients of the measured run, not the Python/torch
baseline or the inputs.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import time
from typing import Callable, Dict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import cp_compile
from cp_compile.sequence import rank_positions

from _measure import mmap_threshold_env, peak_mib  # examples/_measure.py


def _warm_up(attn: Callable, args) -> None:
    """One small fwd+bwd first, so one-time costs (kernel code paged in, thread pools,
    gloo connections) are not counted as memory of the measured run."""
    small = argparse.Namespace(**{**vars(args), "seq_len": 16 * args.world_size})
    x = make_inputs(small)
    q, k, v = (x[n].requires_grad_() for n in "qkv")
    if dist.is_initialized():
        q, k, v = (cp_compile.shard(t.detach(), 2).requires_grad_() for t in (q, k, v))
    attn(q, k, v).sum().backward()


def make_inputs(args) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape_q = (1, args.heads, args.seq_len, args.head_dim)
    shape_kv = (1, args.kv_heads, args.seq_len, args.head_dim)
    return {
        "q": torch.randn(shape_q, generator=g),
        "k": torch.randn(shape_kv, generator=g),
        "v": torch.randn(shape_kv, generator=g),
        "dout": torch.randn(shape_q, generator=g),
    }


def single_process(args, out_path: str) -> None:
    torch.set_num_threads(1)
    x = make_inputs(args)
    q, k, v = (x[n].clone().requires_grad_() for n in "qkv")
    res = {}

    def run():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.backward(x["dout"])
        res["out"] = out.detach()

    _warm_up(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True), args)
    t0 = time.perf_counter()
    res["peak_mib"] = peak_mib(run)
    res["seconds"] = time.perf_counter() - t0
    res.update(dq=q.grad, dk=k.grad, dv=v.grad)
    torch.save(res, out_path)


def ring_rank(rank: int, args, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world_size)
    x = make_inputs(args)
    q, k, v = (cp_compile.shard(x[n], 2).requires_grad_() for n in "qkv")  # (B, H, S/N, D)
    dout = cp_compile.shard(x["dout"], 2)
    del x  # keep only this rank's tokens, as a real CP job would
    res = {}

    def run():
        out = cp_compile.ring_attention(q, k, v, causal=True)
        out.backward(dout)
        res["out"] = out.detach()

    _warm_up(lambda a, b, c: cp_compile.ring_attention(a, b, c, causal=True), args)
    dist.barrier()
    t0 = time.perf_counter()
    res["peak_mib"] = peak_mib(run)
    res["seconds"] = time.perf_counter() - t0
    res.update(dq=q.grad, dk=k.grad, dv=v.grad)
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _assemble(shards, name: str, seq_len: int, world: int) -> torch.Tensor:
    full = torch.empty_like(torch.cat([s[name] for s in shards], dim=2))
    for r, s in enumerate(shards):
        full[:, :, rank_positions(seq_len, world, r, "zigzag")] = s[name]
    return full


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    args = p.parse_args()
    # Large blocks straight from mmap and back to the OS on free, so the resident
    # high-water mark follows live tensors rather than glibc's heap retention.
    mmap_threshold_env()
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        print(f"single process: causal SDPA fwd+bwd, S={args.seq_len}, H={args.heads}, "
              f"H_kv={args.kv_heads}, D={args.head_dim}, fp32 ...", flush=True)
        proc = ctx.Process(target=single_process, args=(args, os.path.join(tmp, "ref.pt")))
        proc.start()
        proc.join()
        if proc.exitcode != 0:
            raise SystemExit(f"single-process reference failed (exit code {proc.exitcode})")
        print(f"{args.world_size} ranks (gloo): cp_compile.ring_attention, zigzag, p2p ...", flush=True)
        mp.start_processes(ring_rank, args=(args, _free_port(), tmp), nprocs=args.world_size, start_method="spawn")
        ref = torch.load(os.path.join(tmp, "ref.pt"))
        shards = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(args.world_size)]
    print("\nerror vs single-process SDPA (relative, norm-wise):")
    for name in ("out", "dq", "dk", "dv"):
        err = _rel(_assemble(shards, name, args.seq_len, args.world_size), ref[name])
        print(f"  {name:4s} {err:.2e}")
    print("\npeak memory of attention fwd+bwd (activations + outputs + grads):")
    print(f"  single process : {ref['peak_mib']:8.1f} MiB   ({ref['seconds']:.1f} s)")
    for r, s in enumerate(shards):
        ratio = s["peak_mib"] / ref["peak_mib"]
        print(f"  rank {r}         : {s['peak_mib']:8.1f} MiB   ({s['seconds']:.1f} s)   {ratio:.2f}x single")


if __name__ == "__main__":
    main()
