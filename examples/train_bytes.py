"""Train a byte-level Llama on the Python standard library's source, context-parallel.

Real text that ships with every Python installation, no downloads: the ``.py``
files under ``sysconfig.get_paths()["stdlib"]`` (sorted, ``site-packages`` left
out) are concatenated as bytes (vocabulary 256) and cut into sequences of
``--seq-len`` + 1 bytes (input = seq[:-1], labels = seq[1:]), visited in an order
shuffled by ``--seed``. Only as many files are read as the run needs.

The model is the unmodified example Llama (``examples/models.py``); the training
step (forward, backward, AdamW) is decorated with
``@cp_compile.context_parallel(shard={"input_ids": 1, "labels": 1})``: every rank
passes the FULL batch, keeps 1/N of the tokens, attention becomes ring attention,
and the loss and gradients are the single-device ones.

Rank 0 first prints this machine's fp32 matmul GFLOP/s per process (measured on
every rank at once, as training runs), so tokens/s measured elsewhere can be
scaled; then a progress bar with each step's loss, global tokens/s and every
rank's peak memory of the step, then a one-line comparison against one process
training the same model at the same sequence length (this script with
``--single``, run by rank 0 after training), and writes a loss-curve PNG
(needs matplotlib).

Peak memory of a step: on CPU the resident high-water mark during the step minus
the resident size before it (``examples/_measure.py``; glibc's mmap threshold is
lowered so freed activations go back to the OS); on CUDA
``torch.cuda.max_memory_allocated()`` minus the memory allocated before the step.
Step 1 includes compilation and the creation of the AdamW state; the comparison
uses the largest peak of steps 2 and later.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import sysconfig
import time
from typing import Callable, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # examples/ (models, _measure)
import models  # noqa: E402
from _measure import MMAP_THRESHOLD, matmul_gflops, mmap_threshold_env, peak_mib  # noqa: E402

EPILOG = """examples:
  torchrun --standalone --nproc-per-node 2 examples/train_bytes.py
  .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 examples/train_bytes.py --steps 20
  python examples/train_bytes.py --single          # one process, the memory reference

CPU ranks use gloo, CUDA ranks (cuda:LOCAL_RANK) nccl; the same command works for both.
"""


# ---------------------------------------------------------------- data


def stdlib_files() -> List[str]:
    """The standard library's .py files, sorted (deterministic), without site-packages."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "dist-packages", "__pycache__"))
        out.extend(os.path.join(d, f) for f in sorted(files) if f.endswith(".py"))
    return out


def load_sequences(n_seqs: int, seq_len: int, seed: int) -> torch.Tensor:
    """(n_seqs, seq_len + 1) uint8 byte sequences in a shuffled order.

    Reads files until 4 x the needed bytes are there (a pool to shuffle from, so
    the first steps do not all come from the same few modules), cut into windows
    of seq_len + 1 bytes; the pool order is a permutation drawn from ``seed``.
    """
    need = n_seqs * (seq_len + 1)
    files = stdlib_files()
    if not files:
        raise SystemExit(f"no .py files under {sysconfig.get_paths()['stdlib']}")
    chunks, have = [], 0
    for path in files:
        with open(path, "rb") as f:
            chunks.append(f.read())
        have += len(chunks[-1])
        if have >= 4 * need:
            break
    data = b"".join(chunks)
    if len(data) < need:  # a tiny stdlib: repeat it
        data = data * (need // max(len(data), 1) + 1)
    pool = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    n_pool = len(pool) // (seq_len + 1)
    pool = pool[: n_pool * (seq_len + 1)].view(n_pool, seq_len + 1)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(n_pool, generator=g)
    idx = order.repeat(n_seqs // n_pool + 1)[:n_seqs]
    return pool[idx].clone()


# ---------------------------------------------------------------- memory


def _lower_mmap_threshold() -> None:
    """What MALLOC_MMAP_THRESHOLD_ does (examples/_measure.py), for processes torchrun
    started without it: large blocks come from mmap and go back to the OS on free."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, int(MMAP_THRESHOLD))  # M_MMAP_THRESHOLD
    except Exception:
        pass


def measure(fn, device: torch.device):
    """(result of fn(), peak MiB of running it above the memory in use before)."""
    box = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        box["r"] = fn()
        torch.cuda.synchronize(device)
        return box["r"], (torch.cuda.max_memory_allocated(device) - before) / 2**20
    if sys.platform.startswith("linux"):
        peak = peak_mib(lambda: box.setdefault("r", fn()))
        return box["r"], peak
    return fn(), float("nan")


# ---------------------------------------------------------------- training


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--seq-len", type=int, default=16384, help="bytes per sequence (default 16384)")
    a("--steps", type=int, default=10, help="training steps (default 10)")
    a("--batch", type=int, default=1, help="sequences per step (default 1)")
    a("--dim", type=int, default=128, help="model width (default 128)")
    a("--layers", type=int, default=3, help="transformer blocks (default 3)")
    a("--heads", type=int, default=4, help="attention heads (default 4)")
    a("--kv-heads", type=int, default=2, help="key/value heads (default 2)")
    a("--ffn", type=int, default=256, help="SwiGLU hidden size (default 256)")
    a("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    a("--seed", type=int, default=0, help="weights and data order (default 0)")
    a("--inner", choices=("aot_eager", "inductor"), default="aot_eager",
      help="compiler the rewritten graphs go to (default aot_eager; inductor compiles take ~45 s on CPU)")
    a("--plot", default="train_bytes_loss.png", help="loss-curve PNG ('' = none; default train_bytes_loss.png)")
    a("--no-compare", action="store_true", help="skip the single-process memory comparison")
    a("--single", action="store_true",
      help="one process, no CP (torch.compile with --inner only); prints a JSON summary as its last line")
    args = p.parse_args(argv)
    if args.dim % args.heads or args.heads % args.kv_heads or (args.dim // args.heads) % 2:
        p.error("--dim must divide by --heads into an even head size, and --heads by --kv-heads")
    if args.steps < 1 or args.batch < 1:
        p.error("--steps and --batch must be >= 1")
    return args


def bar(i: int, n: int, width: int = 20) -> str:
    done = round(width * i / n)
    return "[" + "#" * done + "." * (width - done) + f"] {i:>{len(str(n))}}/{n}"


def save_plot(path: str, losses: List[float], title: str) -> None:
    if not path:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: no loss-curve PNG ({path}): matplotlib is not installed (pip install matplotlib for the plot)")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(1, len(losses) + 1), losses, marker="o")
    ax.axhline(math.log(256), color="gray", ls="--", lw=0.8, label="ln 256 (uniform bytes)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / byte)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"loss curve: {path}")


class Ranks(NamedTuple):
    """Where this process trains."""

    distributed: bool  # under torchrun (WORLD_SIZE > 1) and not --single
    device: torch.device  # cuda:LOCAL_RANK, else CPU
    rank: int
    world: int


def setup_ranks(args: argparse.Namespace) -> Ranks:
    """The device (on CPU with glibc's mmap threshold lowered, for the memory figures) and, under
    torchrun, the process group (nccl on CUDA, gloo on CPU); checks that the sequence splits."""
    distributed = not args.single and int(os.environ.get("WORLD_SIZE", "1")) > 1
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        _lower_mmap_threshold()
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1
    if distributed and args.seq_len % (2 * world):
        raise SystemExit(f"--seq-len {args.seq_len} must divide by 2 x world size = {2 * world}")
    return Ranks(distributed, device, rank, world)


def train_step(model, optimizer, input_ids, labels):
    """One training step: forward, backward, optimizer step; the loss."""
    loss = model(input_ids, labels=labels)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def compile_step(args: argparse.Namespace, ranks: Ranks) -> Tuple[Callable, str]:
    """:func:`train_step` compiled for this run, and how (for the log): context-parallel over the
    ranks (every rank passes the full batch), or torch.compile in one process."""
    if ranks.distributed:
        import cp_compile

        step_fn = cp_compile.context_parallel(shard={"input_ids": 1, "labels": 1}, inner=args.inner)(train_step)
        how = (f"context-parallel over {ranks.world} ranks ({dist.get_backend()}), "
               f"{args.seq_len // ranks.world} tokens per rank")
    else:
        step_fn = torch.compile(train_step, backend=args.inner)
        how = "one process, no CP"
    return step_fn, how


def log_header(log: Callable, args: argparse.Namespace, n_params: int, device: torch.device, how: str) -> float:
    """Log the model, the run and this machine's fp32 matmul GFLOP/s (measured on every rank at once,
    the contention training sees); that GFLOP/s."""
    log(f"byte-level Llama ({n_params / 1e6:.2f} M params: dim={args.dim}, layers={args.layers}, "
        f"heads={args.heads}/{args.kv_heads} kv, ffn={args.ffn}, vocab=256) on Python {sys.version.split()[0]}'s "
        f"standard library source")
    log(f"batch={args.batch} x S={args.seq_len} bytes, {args.steps} steps, AdamW lr={args.lr}, "
        f"inner={args.inner}, device={device.type}; {how}")
    gflops = matmul_gflops(device=device.type)  # every rank at once: the contention training sees
    log(f"this machine: fp32 matmul {gflops:.0f} GFLOP/s per process ({torch.get_num_threads()} thread(s)); "
        "tokens/s scale with it", flush=True)
    log("step 1 includes compilation", flush=True)
    return gflops


def step_figures(peak: float, seconds: float, ranks: Ranks) -> Tuple[List[float], float]:
    """Every rank's peak MiB of a step and the step's time (the slowest rank's, when distributed)."""
    if not ranks.distributed:
        return [peak], seconds
    stats = torch.tensor([peak, seconds], dtype=torch.float64, device=ranks.device)
    gathered = [torch.empty_like(stats) for _ in range(ranks.world)]
    dist.all_gather(gathered, stats)
    return [g[0].item() for g in gathered], max(g[1].item() for g in gathered)


def train(args: argparse.Namespace, ranks: Ranks, data: torch.Tensor, model: torch.nn.Module,
          opt: torch.optim.Optimizer, step_fn: Callable,
          log: Callable) -> Tuple[List[float], List[List[float]], List[float]]:
    """Run the steps on consecutive batches of ``data``, logging a progress line each:
    (losses, every rank's peak MiB per step, global tokens/s per step)."""
    tokens = args.batch * args.seq_len
    losses, peaks_all, rates = [], [], []
    for i in range(1, args.steps + 1):
        batch = data[(i - 1) * args.batch: i * args.batch].to(device=ranks.device, dtype=torch.long)
        input_ids, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        if ranks.distributed:
            dist.barrier()
        t0 = time.perf_counter()
        loss_t, peak = measure(lambda: step_fn(model, opt, input_ids, labels), ranks.device)
        loss = loss_t.item()
        peaks, seconds = step_figures(peak, time.perf_counter() - t0, ranks)
        losses.append(loss)
        peaks_all.append(peaks)
        rates.append(tokens / seconds)
        mem = " ".join(f"r{r} {p:7.1f}" for r, p in enumerate(peaks))
        log(f"{bar(i, args.steps)}  loss {loss:.4f}  {rates[-1]:8.0f} tok/s  {seconds:6.2f} s  "
            f"peak MiB {mem}", flush=True)
        if not math.isfinite(loss):
            raise SystemExit(f"loss is {loss} at step {i}")
    return losses, peaks_all, rates


def compare_single(args: argparse.Namespace, summary: dict, world: int) -> None:
    """Rank 0 after CP training: run this script with ``--single`` (the same model and sequence length,
    2 steps, in one process), print the peak memory per rank against it and record it in ``summary``."""
    if world == 1:
        print("no memory comparison: this run already is a single process (start it with torchrun for CP)")
        return
    print("running the same model in one process for the memory comparison ...", flush=True)
    cmd = [sys.executable, os.path.abspath(__file__), "--single", "--steps", "2"]
    for k in ("seq_len", "batch", "dim", "layers", "heads", "kv_heads", "ffn", "lr", "seed", "inner"):
        cmd += ["--" + k.replace("_", "-"), str(getattr(args, k))]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                        "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    mmap_threshold_env()
    env.setdefault("MALLOC_MMAP_THRESHOLD_", os.environ["MALLOC_MMAP_THRESHOLD_"])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        print(f"single-process run failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        return
    single = json.loads(lines[-1])
    cp = summary["peak_mib"]
    ratio = cp / single["peak_mib"] if single["peak_mib"] > 0 else float("nan")
    print(f"peak memory per rank {cp:.1f} MiB ({world} CP ranks) vs single process {single['peak_mib']:.1f} MiB "
          f"at S={args.seq_len} ({ratio:.2f}x)")
    summary["single_peak_mib"] = single["peak_mib"]


def main(argv=None) -> Optional[dict]:
    """Train (every rank), log the progress (rank 0), then on rank 0 print the result, plot the loss
    and compare memory against one process; the run's summary (printed as JSON under --single)."""
    started = time.perf_counter()
    args = parse_args(argv)
    ranks = setup_ranks(args)
    world = ranks.world
    main_rank = ranks.rank == 0 and not args.single
    log = print if main_rank else (lambda *a, **k: None)

    data = load_sequences(args.steps * args.batch, args.seq_len, args.seed)
    torch.manual_seed(args.seed)
    cfg = models.LlamaConfig(vocab_size=256, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                             n_kv_heads=args.kv_heads, ffn_hidden=args.ffn, max_seq_len=args.seq_len)
    model = models.Llama(cfg).to(ranks.device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    n_params = sum(p.numel() for p in model.parameters())
    step_fn, how = compile_step(args, ranks)
    gflops = log_header(log, args, n_params, ranks.device, how)
    losses, peaks_all, rates = train(args, ranks, data, model, opt, step_fn, log)

    later = peaks_all[1:] or peaks_all  # step 1 = compilation + AdamW state
    rank_peaks = [max(p[r] for p in later) for r in range(world)]
    summary = {"losses": losses, "peak_mib": max(rank_peaks), "rank_peak_mib": rank_peaks,
               "tokens_per_s": sum(rates[1:]) / len(rates[1:]) if len(rates) > 1 else rates[0],
               "seq_len": args.seq_len, "world_size": world, "matmul_gflops": gflops}
    if ranks.distributed:
        dist.destroy_process_group()
    if args.single:
        print(json.dumps(summary))
        return summary
    if ranks.rank != 0:
        return summary

    print(f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f} (ln 256 = {math.log(256):.4f}); "
          f"{summary['tokens_per_s']:.0f} tok/s (mean after step 1) with fp32 matmul at {gflops:.0f} GFLOP/s "
          f"per process; {time.perf_counter() - started:.0f} s since start")
    save_plot(args.plot, losses, f"byte-level Llama on the Python stdlib, S={args.seq_len}, {world} rank(s)")
    if not args.no_compare:
        compare_single(args, summary, world)
    return summary


if __name__ == "__main__":
    main()
