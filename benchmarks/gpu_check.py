"""The Triton kernels on a real GPU, first time: errors and speed beside SDPA, and the ring loop.

    .venv/bin/python benchmarks/gpu_check.py                  # one CUDA GPU, no network, <= 8 min
    TRITON_INTERPRET=1 .venv/bin/python benchmarks/gpu_check.py --tiny   # CPU, tiny shapes (a test runs it)

For each case — dtype (bf16, fp16) x head dim (64, 128) x S (8k, 32k) x form (causal, causal with a
window of S/8, causal over 8 packed documents) — with B = 1, H = 16 query heads on 4 K/V heads:

* the Triton step kernel (one step over the whole sequence: new_state, forward_step, finalize; delta,
  backward_step) against SDPA (flash or cuDNN where PyTorch picks them; a boolean mask for the
  window; one causal call per document): the largest |difference| of out, dq, dk, dv over the
  largest |SDPA value|, and forward / backward TFLOP/s of both (the visible pairs' FLOPs: 4·D per
  pair forward, 2.5 times that backward; CUDA events, median of 3);
* the ring loop: the sequence cut into N = 4 zig-zag shards in one process, each shard's queries
  folding every shard's keys in ring order through forward_step with their global positions (the
  fused merge a real ring runs), against the same SDPA output.

Writes ``benchmarks/results/gpu_check.json`` (``--out``) and prints a table. Exit code 1 when any
error is above its dtype's tolerance (bf16 3e-2, fp16 5e-3), with the case named.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F

import common  # noqa: F401  (puts this checkout first on sys.path)

from cp_compile.sequence import rank_positions

TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3}
NO_LIMIT = 2**31 - 1  # the step API's "no padding" / "no window" (what the ring passes)
FORMS = ("causal", "window", "documents")
FULL = {"dtypes": (torch.bfloat16, torch.float16), "head_dims": (64, 128), "lengths": (8192, 32768),
        "heads": (16, 4), "ring": 4}
TINY = {"dtypes": (torch.bfloat16, torch.float16), "head_dims": (16, 32), "lengths": (64,), "heads": (2, 1),
        "ring": 2}


def inputs(s: int, d: int, heads: Tuple[int, int], dtype: torch.dtype, device: torch.device) -> List[torch.Tensor]:
    """q, dout (1, H, S, D) and k, v (1, H_kv, S, D), seeded, in ``dtype`` on ``device``."""
    g = torch.Generator().manual_seed(0)
    h, hkv = heads
    shapes = [(1, h, s, d), (1, hkv, s, d), (1, hkv, s, d), (1, h, s, d)]
    return [torch.randn(sh, generator=g).to(device, dtype) for sh in shapes]


def documents(s: int, device: torch.device) -> torch.Tensor:
    """(1, S) int32 ids of 8 packed documents of uneven lengths (boundaries fixed by S)."""
    cuts = sorted({int(s * f) for f in (0.05, 0.2, 0.28, 0.45, 0.5, 0.71, 0.9)})
    ids = torch.zeros(s, dtype=torch.int32)
    for c in cuts:
        ids[c:] += 1
    return ids.unsqueeze(0).to(device)


def step_kwargs(form: str, s: int, q_doc: torch.Tensor, k_doc: torch.Tensor) -> Dict[str, Any]:
    kw: Dict[str, Any] = {"causal": True, "kv_limit": NO_LIMIT, "window": s // 8 if form == "window" else NO_LIMIT}
    if form == "documents":
        kw.update(q_doc=q_doc, k_doc=k_doc)
    return kw


def triton_run(kernel: Any, q, k, v, dout, form: str) -> Tuple[List[torch.Tensor], Callable, Callable]:
    """(out, dq, dk, dv) of one step over the whole sequence, and the forward / backward as callables."""
    s, scale = q.shape[2], 1.0 / math.sqrt(q.shape[-1])
    pos = torch.arange(s, dtype=torch.int32, device=q.device)
    docs = documents(s, q.device)
    kw = {**step_kwargs(form, s, docs, docs), "scale": scale}
    box: Dict[str, Any] = {}

    def forward() -> None:
        state = kernel.new_state(q)
        kernel.forward_step(q, k, v, state, pos, pos, **kw)
        box["out"], box["lse"] = kernel.finalize(state, q.dtype)

    def backward() -> None:
        grads = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v)]
        kernel.backward_step(dout, q, k, v, box["lse"], kernel.delta(dout, box["out"]), grads, pos, pos, **kw)
        box["grads"] = grads

    forward()
    backward()
    return [box["out"], *box["grads"]], forward, backward


def sdpa_run(q, k, v, dout, form: str) -> Tuple[List[torch.Tensor], Callable, Callable]:
    """The same through F.scaled_dot_product_attention (GQA by enable_gqa)."""
    s = q.shape[2]
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    box: Dict[str, Any] = {}

    def forward() -> None:
        box["out"] = _sdpa(*leaves, form, s)

    def backward() -> None:
        for t in leaves:
            t.grad = None
        box["out"].backward(dout, retain_graph=True)

    forward()
    backward()
    return [box["out"].detach(), *[t.grad for t in leaves]], forward, backward


def _sdpa(q, k, v, form: str, s: int) -> torch.Tensor:
    gqa = q.shape[1] != k.shape[1]
    if form == "causal":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if form == "window":
        i = torch.arange(s, device=q.device)
        allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < s // 8)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=gqa)
    ids = documents(s, q.device)[0]
    bounds = [0, *[int(b) for b in (ids[1:] != ids[:-1]).nonzero().flatten() + 1], s]
    return torch.cat([F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True,
                                                     enable_gqa=gqa) for a, b in zip(bounds, bounds[1:])], 2)


def ring_loop(kernel: Any, q, k, v, form: str, n: int) -> torch.Tensor:
    """The forward of an N-rank zig-zag ring in one process: (1, H, S, D) in global order."""
    s, scale = q.shape[2], 1.0 / math.sqrt(q.shape[-1])
    docs = documents(s, q.device)
    pos = [rank_positions(s, n, r, "zigzag").to(q.device) for r in range(n)]
    out = torch.empty_like(q)
    for r in range(n):
        qr = q[:, :, pos[r]]
        state = kernel.new_state(qr)
        for step in range(n):  # the K/V block of rank src arrives at step (r - src) mod N
            src = (r - step) % n
            kw = {**step_kwargs(form, s, docs[:, pos[r]], docs[:, pos[src]]), "scale": scale}
            kernel.forward_step(qr, k[:, :, pos[src]], v[:, :, pos[src]], state, pos[r].to(torch.int32),
                                pos[src].to(torch.int32), **kw)
        out[:, :, pos[r]] = kernel.finalize(state, q.dtype)[0]
    return out


def error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (inf for NaN or a shape mismatch)."""
    if got.shape != want.shape or not torch.isfinite(got).all():
        return float("inf")
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()


def seconds(fn: Callable[[], None], device: torch.device, reps: int) -> float:
    """Median seconds of ``fn`` (CUDA events on a GPU, wall time elsewhere), after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def visible_pairs(form: str, s: int) -> int:
    if form == "causal":
        return s * (s + 1) // 2
    if form == "window":
        w = s // 8
        return w * (w + 1) // 2 + (s - w) * w
    ids = documents(s, torch.device("cpu"))[0]
    return sum(int(c) * (int(c) + 1) // 2 for c in torch.bincount(ids.long()))


def case(kernel: Any, dtype, d: int, s: int, form: str, shape: Dict[str, Any], device, reps: int) -> Dict[str, Any]:
    """One row of the record."""
    q, k, v, dout = inputs(s, d, shape["heads"], dtype, device)
    got, t_fwd, t_bwd = triton_run(kernel, q, k, v, dout, form)
    want, s_fwd, s_bwd = sdpa_run(q, k, v, dout, form)
    ring = ring_loop(kernel, q, k, v, form, shape["ring"])
    flops = 4 * d * visible_pairs(form, s) * shape["heads"][0]  # forward; the backward: 2.5x
    row = {"dtype": str(dtype).replace("torch.", ""), "head_dim": d, "seq_len": s, "form": form,
           **{f"error_{n}": error(g, w) for n, g, w in zip(("out", "dq", "dk", "dv"), got, want)},
           "error_ring_out": error(ring, want[0])}
    for name, fn, mult in (("triton_fwd", t_fwd, 1.0), ("triton_bwd", t_bwd, 2.5), ("sdpa_fwd", s_fwd, 1.0),
                           ("sdpa_bwd", s_bwd, 2.5)):
        row[f"tflops_{name}"] = flops * mult / seconds(fn, device, reps) / 1e12
    row["worst"] = max(v for n, v in row.items() if n.startswith("error_"))
    row["ok"] = row["worst"] <= TOLERANCE[dtype]
    return row


def table(rows: List[Dict[str, Any]]) -> str:
    head = "| dtype | D | S | form | out | dq | dk | dv | ring out | Triton fwd / bwd TFLOP/s | SDPA fwd / bwd | ok |"
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['head_dim']} | {r['seq_len']} | {r['form']} | {r['error_out']:.1e} | "
                     f"{r['error_dq']:.1e} | {r['error_dk']:.1e} | {r['error_dv']:.1e} | {r['error_ring_out']:.1e} | "
                     f"{r['tflops_triton_fwd']:.1f} / {r['tflops_triton_bwd']:.1f} | "
                     f"{r['tflops_sdpa_fwd']:.1f} / {r['tflops_sdpa_bwd']:.1f} | {'ok' if r['ok'] else 'FAIL'} |")
    return "\n".join(lines)


def main(argv: List[str] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    p.add_argument("--out", default=os.path.join(common.RESULTS, "gpu_check.json"), help="the JSON record")
    args = p.parse_args(argv)
    started = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("gpu_check: no CUDA GPU; on the CPU run it as TRITON_INTERPRET=1 ... --tiny", file=sys.stderr)
        return 2
    from cp_compile.kernels.triton import TritonKernel

    shape, kernel = (TINY if args.tiny else FULL), TritonKernel()
    rows = [case(kernel, dt, d, s, form, shape, device, 1 if device.type == "cpu" else 3)
            for dt in shape["dtypes"] for d in shape["head_dims"] for s in shape["lengths"] for form in FORMS]
    print(table(rows))
    gpu = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (interpreter)"
    common.write_result("gpu_check", {"device": gpu, "rows": rows, "ok": all(r["ok"] for r in rows)}, started,
                        args, path=args.out)
    bad = [r for r in rows if not r["ok"]]
    for r in bad:
        print(f"FAIL {r['dtype']} D={r['head_dim']} S={r['seq_len']} {r['form']}: worst error {r['worst']:.2e}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
