"""Every Hugging Face architecture through ring_cp: one training step at N ranks against one process.

    .venv/bin/python benchmarks/hf_sweep.py                          # all of them, N = 2 (1-3 hours here)
    .venv/bin/python benchmarks/hf_sweep.py --types llama,bert,bloom --docs none
    .venv/bin/python benchmarks/hf_sweep.py --resume                 # go on from the results file

For every model type of the installed transformers with a causal-LM, masked-LM or
sequence-classification class (``examples/hf_configs.py``: the model built from its
shrunken default config, the same random batch on every rank), each rank runs the eager
model on the whole sequence and the copy compiled with ``ring_cp``, and the architecture
is classified (``examples/hf_architectures.py``, exact by ``examples/_exact.py`` with the
fp64 truth): ring, ring + gathers, sharded (+ gathers), no CP (warned), refused, wrong, silent, crash; or
skipped as not built / reference failed / compile fails without ring_cp.

The driver survives crashes, hangs and segfaults of single architectures: it starts
``torch.distributed.run --standalone --nproc-per-node N`` on this file's worker entry
with the list still to do; the worker appends one JSON line when it starts an
architecture and one when it finishes it (flushed each time) to ``OUT.jsonl``. An
architecture with no result ``--timeout`` seconds after it started (a hang) is killed
and recorded as a crash, as is one whose worker dies (segfault, abort); the driver then
starts a fresh worker on the rest. So does a worker after an architecture whose CP run
raised, as its process group may be left mid-collective. At the end it writes ``OUT``
(every record, the command, versions, machine and wall time, by ``common.write_result``) and the table ``--docs``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import common  # noqa: F401 - puts this checkout's package and examples/ first on sys.path

import hf_architectures as arch
from hf_configs import sweep_seq_len

DEFAULT_OUT = os.path.join(common.RESULTS, "hf_sweep.json")
DEFAULT_DOCS = os.path.join(common.ROOT, "docs", "hf_sweep.md")
POLL = 1.0  # seconds between looks at the worker


# ---------------------------------------------------------------- worker (one per rank)
def worker(args: argparse.Namespace) -> None:
    """On every rank: run the listed architectures in order; rank 0 appends the start and the
    classified, rank-merged result of each to the JSONL file. Leaves after an architecture
    whose CP run raised (the driver starts a fresh group for the rest)."""
    import logging
    import warnings

    import torch

    if not torch.cuda.is_available():
        # transformers calls flash-linear-attention's Triton kernels (chunk_gated_delta_rule, ...) whenever
        # `fla` imports, on any device; the test extra installs it (tests/test_recurrence_fla.py), and without a
        # GPU those kernels cannot run ("0 active drivers"). The sweep runs the models' torch paths, as a
        # machine without fla does: `import fla` fails in this worker.
        sys.modules.setdefault("fla", None)
    import torch.distributed as dist
    import transformers

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    rank = dist.get_rank()
    for model_type in args.types.split(","):
        if rank == 0:
            _append(args.jsonl, {"event": "start", "model_type": model_type, "time": time.time()})
        result = _run_one(model_type, sweep_seq_len(model_type, args.seq_len, dist.get_world_size()))
        results: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(results, result)
        merged = arch.merge_ranks(results)
        if rank == 0:
            outcome, message = arch.classify(merged)
            warning = arch.no_cp_warning(merged) if outcome == "no CP, warned" else None  # what decided it
            _append(args.jsonl, {"event": "done", "model_type": model_type, "outcome": outcome, "message": message,
                                 "no_cp_warning": warning, "result": merged, "time": time.time()})
        if merged.get("cp_error"):
            break
    dist.destroy_process_group()


def _run_one(model_type: str, seq_len: int) -> Dict[str, Any]:
    """:func:`arch.run_architecture`, with anything it lets escape reported as the CP run's error."""
    try:
        return arch.run_architecture(model_type, seq_len=seq_len)
    except Exception as e:  # noqa: BLE001 - a sweep reports every case
        _, head, cls = arch.architecture(model_type)
        return {"model_type": model_type, "head": head, "class": cls, "status": "ran",
                "cp_error": {"refused": False, "line": arch.error_line(e), "outer": arch.error_line(e)}}


def _append(path: str, record: Dict[str, Any]) -> None:
    """One JSON line, flushed to disk (the driver reads it while the worker runs, or after it died)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _read(path: str) -> List[Dict[str, Any]]:
    """Every complete JSON line of ``path`` (a line cut short by a killed worker is left out)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip().endswith("}")]


# ---------------------------------------------------------------- driver
def drive(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Run every architecture still without a result, relaunching the worker past any that hang or
    kill it; the records of ``types`` in order."""
    types = args.types.split(",") if args.types else [t for t, _, _ in arch.architectures()]
    jsonl = _jsonl(args.out)
    if not args.resume and os.path.exists(jsonl):
        os.remove(jsonl)
    os.makedirs(os.path.dirname(os.path.abspath(jsonl)), exist_ok=True)
    while True:
        done = {r["model_type"]: r for r in _read(jsonl) if r["event"] == "done"}
        todo = [t for t in types if t not in done]
        if not todo:
            return [done[t] for t in types]
        _launch(todo, jsonl, args)


def _jsonl(out: str) -> str:
    """The running results file next to ``out``."""
    return out + "l" if out.endswith(".json") else out + ".jsonl"


def _launch(todo: List[str], jsonl: str, args: argparse.Namespace) -> None:
    """One worker group on ``todo``, watched until it exits or an architecture exceeds the timeout
    (then killed, and that architecture recorded as a crash)."""
    log_path = jsonl[:-len(".jsonl")] + ".log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.world}",
           os.path.abspath(__file__), "--worker", "--jsonl", jsonl, "--types", ",".join(todo),
           "--seq-len", str(args.seq_len)]
    seen = launched_at = len(_read(jsonl))
    with open(log_path, "a") as log:
        log_start = log.tell()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        current, seen = _watch(proc, jsonl, todo, seen, args.timeout)
    finally:
        if proc.poll() is None:  # a hang, or the driver itself interrupted
            _stop(proc, jsonl)
    if current is not None:
        _crash(jsonl, current, f"the worker died (exit code {proc.returncode}): {_death(log_path, log_start)}")
    elif seen == launched_at:  # not one architecture started: relaunching would fail the same way
        raise SystemExit(f"the worker failed to start (exit code {proc.returncode}): {_death(log_path, log_start)}"
                         f"; see {log_path}")


def _watch(proc: subprocess.Popen, jsonl: str, todo: List[str], seen: int,
           timeout: float) -> Tuple[Optional[str], int]:
    """Follow the worker until it exits (the architecture it was running, if any, and the records
    seen) or one architecture exceeds ``timeout`` (recorded as a hang; the caller stops the worker)."""
    current, since = None, time.time()  # the architecture running, and when it (or the launch) started
    while proc.poll() is None:
        time.sleep(POLL)
        current, since, seen = _follow(jsonl, seen, current, since)
        if time.time() - since > timeout:
            done = {r["model_type"] for r in _read(jsonl) if r["event"] == "done"}
            what = current or next(t for t in todo if t not in done)  # stuck before it announced itself
            _crash(jsonl, what, f"hang: no result within {timeout:.0f} s (killed)")
            return None, len(_read(jsonl))
    current, _, seen = _follow(jsonl, seen, current, since)
    return current, seen


def _stop(proc: subprocess.Popen, jsonl: str) -> None:
    """End the worker group this driver started: torchrun passes SIGTERM on to its ranks (each in a
    session of its own); a rank still there after a grace period is killed by its pid."""
    ranks = [pid for pid in _children(proc.pid) if jsonl in _cmdline(pid)]
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for pid in ranks:
        if jsonl in _cmdline(pid):  # still that rank (not a reused pid)
            os.kill(pid, signal.SIGKILL)


def _children(pid: int) -> List[int]:
    """The child processes of ``pid`` (Linux /proc)."""
    out: List[int] = []
    for task in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().replace("\0", " ")
    except OSError:
        return ""


def _follow(jsonl: str, seen: int, current: Optional[str], since: float) -> Tuple[Optional[str], float, int]:
    """Read the records after the first ``seen``, print each finished one; the architecture now
    running (None between two), when it started, and the records seen."""
    records = _read(jsonl)
    for r in records[seen:]:
        if r["event"] == "start":
            current, since = r["model_type"], r["time"]
        elif r["event"] == "done":
            current, since = None, r["time"]
            print(f"{r['model_type']:28s} {r['outcome']:16s} {r['message'][:100]}", flush=True)
    return current, since, len(records)


def _crash(jsonl: str, model_type: str, message: str) -> None:
    """Record ``model_type`` as a crash the worker could not report (a hang, a dead worker)."""
    _, head, cls = arch.architecture(model_type)
    _append(jsonl, {"event": "done", "model_type": model_type, "outcome": "crash", "message": message,
                    "result": {"model_type": model_type, "head": head, "class": cls}, "time": time.time()})
    print(f"{model_type:28s} {'crash':16s} {message[:100]}", flush=True)


def _death(log_path: str, start: int) -> str:
    """The line of the worker's log since ``start`` that says how a rank died (torchrun's summary)."""
    with open(log_path, errors="replace") as f:
        f.seek(start)
        lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
    said = [ln for ln in lines if "Signal" in ln or "exitcode" in ln or "Error" in ln]
    return (said or lines or ["no output"])[-1][:300]


# ---------------------------------------------------------------- outputs
def revision() -> str:
    """The checkout's commit, and whether ``cp_compile/`` has uncommitted changes."""
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", common.ROOT, *a], capture_output=True, text=True).stdout.strip()

    dirty = git("status", "--porcelain", "--", "cp_compile")
    return (git("rev-parse", "--short", "HEAD") or "unknown commit") + (" + uncommitted changes" if dirty else "")


def counts(records: List[Dict[str, Any]]) -> Dict[str, int]:
    """Architectures per outcome (the seven, then the skips), tried, and built."""
    out = {k: sum(r["outcome"] == k for r in records) for k in (*arch.OUTCOMES, *arch.SKIPPED)}
    return {**out, "tried": len(records), "built": len(records) - out["not built"]}


ROOT_CAUSES = (  # what the "compile fails without ring_cp" rows come from, found by hand (issue 36)
    "**Why the Gated DeltaNet hybrids fail to compile** (`qwen3_next`, `qwen3_5`, `qwen3_5_moe`, `olmo_hybrid`, "
    "`qwen4_exp`, each with `*_text`; traced on `qwen3_next`, the others fail at the same `view` from the same "
    "layer code): torch 2.13's fake (meta) `aten.softplus_backward` returns strides that "
    "follow its `self` argument, the CPU kernel strides that follow `grad_output` (`sigmoid_backward` agrees with "
    "its kernel). The models' `g = ... * softplus(a + dt_bias)` is read transposed by the delta rule, so its "
    "gradient arrives transposed; AOTAutograd's backward then `cat`s it with `beta`'s gradient, gets a tensor it "
    "believes contiguous, and its `view` fails at run time (`view size is not compatible ...`), with or "
    "without ring_cp. Reproducer: `g = torch.randn(2, 4, 64).transpose(1, 2); x = torch.randn(2, 64, 4)`; "
    "`torch.ops.aten.softplus_backward(g, x, 1, 20).stride()` is `(256, 1, 64)` eagerly and `(256, 4, 1)` under "
    "`FakeTensorMode`. The sweep runs these models' torch paths: with `fla` importable, transformers calls "
    "flash-linear-attention's Triton kernels on any device, which cannot run without a GPU, so the sweep's "
    "workers hide `fla`.")


def write_docs(path: str, records: List[Dict[str, Any]], args: argparse.Namespace, wall: float, rev: str) -> None:
    """``docs/hf_sweep.md``: what is swept and how, the counts, then one row per architecture."""
    import torch
    import transformers

    n = counts(records)
    lines = [
        "# Every Hugging Face architecture through ring_cp", "",
        "Every model type of the installed `transformers` with a causal-LM, masked-LM or sequence-classification "
        "class (in that preference), built from its own default config shrunk by general rules "
        "(`examples/hf_configs.py`: hidden 64, 2 layers, 4 heads, KV heads 2 where the family has them, "
        "vocab 128, every dropout 0, 4 experts top-2, windows and chunks 16; fp32, train mode, the default attention "
        f"implementation). On each of N = {args.world} gloo ranks, one forward + backward of `out.loss` on the "
        f"same random batch (B = 2, S = {args.seq_len}; S = 2·N·C where the model code fixes a chunk size C "
        "itself, `hf_configs.sweep_seq_len`, so that every zig-zag run holds a whole chunk) runs eagerly on "
        "the whole sequence and compiled with "
        "`ring_cp` (`inner=\"aot_eager\"`, `fullgraph=False`); the errors are the worst over the ranks.", "",
        "**Exact** is `examples/_exact.py`'s rule, the tests' own: the loss and every parameter gradient within "
        "1e-5 of the one-process fp32 run, relative to its own norm, except (a) a gradient that is zero in exact "
        "arithmetic (decided from the same step in fp64: its norm at most 1e-10 of the whole fp64 gradient's), "
        "taken relative to 1e-4 of the whole gradient's norm, and (b) a gradient whose error against the fp32 run "
        "exceeds 1e-5 is judged against the fp64 truth instead: its error is reported as "
        "1e-5 · ‖cp − fp64‖ / (2 ‖fp32 − fp64‖), within 1e-5 exactly when ring_cp is no further from fp64 "
        "than twice the fp32 one-process run (a cancelling or ill-conditioned gradient, where the fp32 "
        "reference's own rounding error exceeds 1e-5).", "",
        "**ring**: exact, every attention the ring, no gather. **ring + gathers**: exact, every gather warned. "
        "**sharded** (**+ gathers**): a model with no attention, exact, its recurrences split by sequence "
        "(state passing, scans from run totals: docs/design.md §16), no gather (every gather warned). "
        "**no CP, warned**: fewer ring ops than the attention calls the eager run made (`_exact.AttentionCount`: "
        "fused attention kernels, softmax over square scores; or no attention at all), with a WARNING about "
        "attention or the whole sequence: the message is that WARNING (whole in the JSON record's "
        "`no_cp_warning`). **refused**: a `CPRewriteError` or an error naming its fix. **wrong**: not exact; the "
        "message gives the fp32 reference's own error against fp64 for that parameter. **silent**: no CP, or a "
        "gather, without a WARNING. **crash**: any other exception (the message says the same step compiles "
        "without ring_cp), a hang or a dead worker. Skipped, counted apart: **compile fails without ring_cp**: "
        "the CP run crashed and the same step compiled with plain `torch.compile(model, backend=\"aot_eager\")` "
        "in one process fails too (PyTorch's or transformers' limit, not ring_cp's; the message is that error, "
        "then the CP run's if it differs); **not built**: the tiny config or the model cannot be made; "
        "**reference failed**: the one-process eager step itself fails.", "",
        f"Command: `{common.command()}`; cp_compile at {rev}, transformers {transformers.__version__}, "
        f"torch {torch.__version__}, {datetime.date.today().isoformat()}, wall time {wall / 60:.0f} min"
        + (" (this invocation; resumed from earlier results)" if args.resume else "") + ".", "",
        "| outcome | architectures |", "|---|---|",
        *[f"| {k} | {n[k]} |" for k in arch.OUTCOMES], *[f"| *skipped: {k}* | {n[k]} |" for k in arch.SKIPPED],
        f"| **tried** | {n['tried']} (built {n['built']}) |", "", ROOT_CAUSES, "",
        "| model type | class | outcome | ring ops / attentions | loss error | worst gradient error (parameter) "
        "| gathers | first warning or error |", "|---|---|---|---|---|---|---|---|",
        *[_row(r) for r in records],
    ]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def _row(record: Dict[str, Any]) -> str:
    """One table row: type, class, outcome, ring ops / attentions, errors, gathers, message."""
    r = record.get("result") or {}
    ran = r.get("status") == "ran" and "loss_error" in r
    name, grad = arch.worst_grad(r) if ran else ("", 0.0)
    cells = [f"`{record['model_type']}`", r.get("class", ""), f"**{record['outcome']}**",
             f"{r['ring_ops']} / {r['attentions']}" if "ring_ops" in r else "—",
             f"{r['loss_error']:.0e}" if ran else "—", f"{grad:.0e} (`{name}`)" if ran and name else "—",
             str(len(r["gathers"])) if "gathers" in r else "—", _cell(record["message"])]
    return "| " + " | ".join(cells) + " |"


def _cell(text: str, limit: int = 240) -> str:
    """``text`` on one line, trimmed, with its transformers paths relative, safe in a table cell."""
    text = re.sub(r"\S*/site-packages/", "", " ".join(text.split()))  # transformers/models/... paths
    text = text if len(text) <= limit else text[:limit - 1] + "…"
    return text.replace("|", "\\|")


def main() -> None:
    """The driver, or (``--worker``, as the driver starts it) one rank's worker."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--types", default="", help="comma-separated model types (default: every architecture)")
    p.add_argument("--world", type=int, default=2, help="ranks N (default 2)")
    p.add_argument("--seq-len", type=int, default=64, help="sequence length S (default 64)")
    p.add_argument("--timeout", type=float, default=300, help="seconds one architecture may take (default 300)")
    p.add_argument("--out", default=os.path.relpath(DEFAULT_OUT, common.ROOT),
                   help="results JSON; OUT.jsonl holds the running results and OUT's .log the workers' output")
    p.add_argument("--docs", default=os.path.relpath(DEFAULT_DOCS, common.ROOT), help="the table ('none': skip)")
    p.add_argument("--resume", action="store_true", help="keep the results already in OUT.jsonl, run the rest")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--jsonl", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    started, rev = time.perf_counter(), revision()  # (the workers import the checkout as it is when each starts)
    records = drive(args)
    wall = time.perf_counter() - started
    if revision() != rev:
        rev += f" (the checkout moved to {revision()} during the run)"
    import transformers

    common.write_result("hf_sweep", {"transformers": transformers.__version__, "revision": rev,
                                     "counts": counts(records), "records": records}, started, args, path=args.out)
    if args.docs != "none":
        write_docs(args.docs, records, args, wall, rev)
    print(" ".join(f"{k}: {v}" for k, v in counts(records).items()) + f"; {wall / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
