"""Context-parallel training of an unmodified Llama-style model with the ring_cp backend.

    python examples/train_demo.py [--world-size 2] [--seq-len 4096] [--steps 5]
                                  [--dim 256] [--layers 2] [--inner aot_eager|inductor]

Compares, step by step, AdamW training of the example Llama (``examples/models.py``,
plain PyTorch, no cp_compile code in it) on one process against the same training
context-parallel over ``--world-size`` processes:

1. single process, eager: the model on the full sequence, as users run it (the
   loss reference);
2. single process, ``torch.compile(model, backend=INNER)``: the same compiler the
   CP run uses, without CP (the memory reference: the compiler alone changes what
   is saved for backward, so this isolates what CP saves);
3. ``--world-size`` processes (gloo on 127.0.0.1): every rank builds the same model
   and data from the same seed and runs
   ``torch.compile(model, backend=cp_compile.RingCP(inner=...), fullgraph=True)``,
   passing the FULL batch; the backend keeps only this rank's 1/N of the tokens,
   turns attention into ring attention, makes the loss a global reduction and
   all-reduces the parameter gradients;
4. the parent prints each step's loss from runs 1 and 3 and their relative difference,
   then each process's peak memory of one training step and the step times.

Each kind of process runs alone (the single processes one after the other, then
the CP ranks together), one torch thread per process. Results come back through files in a
temporary directory.

Peak memory (``examples/_measure.py``): the resident high-water mark during one
whole training step (forward, backward, ``optimizer.step()``, ``zero_grad()``) minus
the resident size just before it, with ``MALLOC_MMAP_THRESHOLD_`` set. Step 1 is
the warm-up (compilation, AdamW state creation, gloo connections); the peak is
measured on step 2. It counts activations, gradients and temporaries, not the
weights, AdamW state or inputs, which exist before the step (those are replicated
on every rank; sharding them is the job of FSDP/ZeRO, not of context parallelism).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # examples/ (models, _measure)
import models  # noqa: E402
from _measure import mmap_threshold_env, peak_mib  # noqa: E402

MEASURED_STEP = 2  # 1-based; step 1 is the warm-up (compile, optimizer state)


def build(args):
    """Model, optimizer and (input_ids, labels): identical in every process (same seed)."""
    model, (input_ids, labels) = models.llama_factory(
        seq_len=args.seq_len,
        batch=args.batch,
        seed=args.seed,
        vocab_size=args.vocab,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        ffn_hidden=args.ffn,
        max_seq_len=args.seq_len,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    return model, opt, input_ids, labels


def train(step_fn, steps: int, sync=lambda: None) -> Dict[str, object]:
    """Runs ``steps`` training steps; measures the peak memory of step MEASURED_STEP."""
    losses: List[float] = []
    seconds: List[float] = []
    peak = float("nan")
    for i in range(1, steps + 1):
        sync()  # CP ranks start every step together, so step times are comparable
        t0 = time.perf_counter()
        if i == MEASURED_STEP:
            box = {}
            peak = peak_mib(lambda: box.setdefault("loss", step_fn()))
            loss = box["loss"]
        else:
            loss = step_fn()
        seconds.append(time.perf_counter() - t0)
        losses.append(loss)
    return {"losses": losses, "seconds": seconds, "peak_mib": peak}


def make_step(model, opt, input_ids, labels):
    def step() -> float:
        loss = model(input_ids, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def _state_mib(model, opt) -> Dict[str, float]:
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    adam = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
               if isinstance(t, torch.Tensor))
    return {"n_params": sum(p.numel() for p in model.parameters()), "weights_mib": weights / 2**20,
            "adam_mib": adam / 2**20}


def single_process(args, compiler: str, out_path: str) -> None:
    """compiler: "eager" (the model as is) or an inner compiler name (plain torch.compile)."""
    torch.set_num_threads(1)
    model, opt, input_ids, labels = build(args)
    run = model if compiler == "eager" else torch.compile(model, backend=compiler, fullgraph=True)
    res = train(make_step(run, opt, input_ids, labels), args.steps)
    res.update(_state_mib(model, opt))
    with open(out_path, "w") as f:
        json.dump(res, f)


def cp_rank(rank: int, args, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.world_size)
    import cp_compile

    model, opt, input_ids, labels = build(args)
    backend = cp_compile.RingCP(inner=args.inner)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    res = train(make_step(compiled, opt, input_ids, labels), args.steps, sync=dist.barrier)
    res["fallbacks"] = list(backend.fallbacks)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "n/a"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world-size", type=int, default=2, help="CP ranks")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--steps", type=int, default=5, help="training steps (>= 2: step 2 is measured)")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=512, help="SwiGLU hidden size")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--inner", choices=("aot_eager", "inductor"), default="aot_eager",
                   help="compiler the rewritten graphs go to")
    args = p.parse_args(argv)
    if args.steps < MEASURED_STEP:
        p.error(f"--steps must be >= {MEASURED_STEP} (step 1 is the warm-up, step 2 is measured)")
    if args.dim % args.heads or args.heads % args.kv_heads:
        p.error("--dim must divide by --heads, and --heads by --kv-heads")
    return args


def print_plan(args: argparse.Namespace) -> None:
    """What is trained and the three runs compared."""
    N = args.world_size
    print(f"AdamW training of the example Llama (dim={args.dim}, layers={args.layers}, "
          f"heads={args.heads}/{args.kv_heads} kv, ffn={args.ffn}, vocab={args.vocab}), "
          f"batch={args.batch}, S={args.seq_len}, fp32, {args.steps} steps, lr={args.lr}")
    print("  single process, eager    : the unmodified model on the full sequence (loss reference)")
    print(f"  single process, compiled : torch.compile(backend={args.inner!r}), no CP (memory reference)")
    print(f"  CP, {N} ranks              : torch.compile(backend=RingCP(inner={args.inner!r})), "
          f"gloo on 127.0.0.1, S/{N}={args.seq_len // N} tokens per rank")
    print("  same seed, weights and data in every process; one torch thread per process\n", flush=True)


def run_all(args: argparse.Namespace) -> Tuple[dict, dict, List[dict], float]:
    """Run the single process (eager, then compiled) and the CP ranks, each spawned on its own:
    (eager summary, compiled summary, each rank's summary, wall seconds of all runs)."""
    N = args.world_size
    ctx = mp.get_context("spawn")
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for compiler in ("eager", args.inner):
            print(f"running the single process ({compiler}) ...", flush=True)
            proc = ctx.Process(target=single_process, args=(args, compiler, os.path.join(tmp, f"{compiler}.json")))
            proc.start()
            proc.join()
            if proc.exitcode != 0:
                raise SystemExit(f"single-process run ({compiler}) failed (exit code {proc.exitcode})")
        print(f"running {N} CP ranks ...", flush=True)
        mp.start_processes(cp_rank, args=(args, _free_port(), tmp), nprocs=N, start_method="spawn")
        with open(os.path.join(tmp, "eager.json")) as f:
            ref = json.load(f)
        with open(os.path.join(tmp, f"{args.inner}.json")) as f:
            ref_c = json.load(f)
        ranks = []
        for r in range(N):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    wall = time.perf_counter() - t_start
    return ref, ref_c, ranks, wall


def print_losses(args: argparse.Namespace, ref: dict, ranks: List[dict]) -> List[float]:
    """The loss table (single process eager vs CP rank 0), the spread across ranks and the fallbacks;
    the relative difference of each step."""
    print("\nloss per step: single process (eager) vs CP (rank 0)")
    print(f"  {'step':>4}  {'single process':>14}  {'CP rank 0':>14}  {'rel. diff':>9}")
    diffs = []
    for i, (a, b) in enumerate(zip(ref["losses"], ranks[0]["losses"]), 1):
        diffs.append(_rel(b, a))
        print(f"  {i:>4}  {a:>14.6f}  {b:>14.6f}  {diffs[-1]:>9.1e}")
    spread = max(_rel(s["losses"][i], ranks[0]["losses"][i]) for s in ranks for i in range(args.steps))
    print(f"  (the CP loss is the global one, on every rank: max spread across ranks {spread:.1e})")
    fallbacks = ranks[0]["fallbacks"]
    if fallbacks:
        print(f"  note: {len(fallbacks)} op(s) ran on the gathered sequence: " + "; ".join(fallbacks))
    return diffs


def print_memory(args: argparse.Namespace, ref: dict, ref_c: dict, ranks: List[dict]) -> None:
    """Peak memory of the measured step in each run, each rank against the single processes."""
    print(f"\npeak memory of one training step (step {MEASURED_STEP}: forward + backward + AdamW step; "
          "activations, grads, temporaries)")
    print(f"  single process, eager    : {ref['peak_mib']:8.1f} MiB")
    print(f"  single process, {args.inner:<9.9}: {ref_c['peak_mib']:8.1f} MiB")
    for r, s in enumerate(ranks):
        print(f"  CP rank {r}                : {s['peak_mib']:8.1f} MiB   "
              f"{_ratio(s['peak_mib'], ref_c['peak_mib'])} single {args.inner}, "
              f"{_ratio(s['peak_mib'], ref['peak_mib'])} single eager")
    print(f"  outside the step, in every process: {ref['n_params'] / 1e6:.2f} M parameters = "
          f"{ref['weights_mib']:.1f} MiB weights + {ref['adam_mib']:.1f} MiB AdamW state")


def _later(s: dict) -> float:
    """Mean seconds of the steps after the warm-up."""
    rest = s["seconds"][1:]
    return sum(rest) / len(rest)


def print_times(args: argparse.Namespace, ref: dict, ref_c: dict, ranks: List[dict], wall: float) -> None:
    """Step times of each run: the warm-up step and the mean of the others."""
    print(f"\nstep time (s): step 1 (warm-up, incl. compilation where compiled), mean of steps 2-{args.steps}")
    print(f"  single process, eager    : {ref['seconds'][0]:6.2f}   {_later(ref):6.2f}")
    print(f"  single process, {args.inner:<9.9}: {ref_c['seconds'][0]:6.2f}   {_later(ref_c):6.2f}")
    for r, s in enumerate(ranks):
        print(f"  CP rank {r}                : {s['seconds'][0]:6.2f}   {_later(s):6.2f}")
    print(f"  (wall time of all runs, incl. process start-up: {wall:.0f} s)")


def main(argv=None) -> float:
    """Run the comparison and print it; the largest relative loss difference (CP vs single process)."""
    args = parse_args(argv)
    mmap_threshold_env()  # inherited by the spawned processes (see examples/_measure.py)
    print_plan(args)
    ref, ref_c, ranks, wall = run_all(args)
    diffs = print_losses(args, ref, ranks)
    print_memory(args, ref, ref_c, ranks)
    print_times(args, ref, ref_c, ranks, wall)
    worst = max(diffs)
    print(f"\nmax relative loss difference: {worst:.2e}")
    return worst


if __name__ == "__main__":
    main()
