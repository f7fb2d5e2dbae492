"""``torch.autocast`` around a ring_cp model: the ring gets the dtypes autocast gives SDPA.

Under autocast, eager SDPA casts q, k, v to the autocast dtype (a Llama hands it float32 q and k
after RoPE, whose cos/sin tables are float32, and a bf16 v: before the ring op had SDPA's autocast
rule, cp_compile/ring/autocast.py, its CPU kernel failed with "expected scalar type Float but found
BFloat16"). Each case runs one process's model under autocast (the reference), the same model
through ring_cp (``inner="aot_eager"``, ``fullgraph=True``) under the same autocast, and a float64
copy without autocast (the truth). Required, on every rank:

* the loss and every parameter gradient of ring_cp are no further from the truth than twice the
  reference is, plus 1e-3 (relative errors, each gradient against its own norm);
* the ring's block kernel gets the dtypes the eager attention computed in (a probe kernel records
  them), in the forward and the backward;
* every attention of the eager run became the ring, with no gather fallback.

Decoder (the example Llama) and encoder (``nn.TransformerEncoder``, opened by passes/expand_mha.py),
bf16 and fp16 on the CPU, 2 and 4 ranks; a model cast to bf16 (no autocast); autocast entered
inside the compiled forward (Dynamo records ``_enter_autocast`` / ``_exit_autocast`` nodes around
the SDPA the ring replaces); attention written by hand on float32 q, k (passes/fuse_attention.py);
and ``cp_compile.ring_attention`` called eagerly. One ``ranks.run`` per world size runs its cases:
starting the two pools and their first compiles are most of the file's time.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import models

import cp_compile
from checks import AttentionCount, rel, ring_mismatches
from cp_compile.kernels import register_kernel
from cp_compile.kernels.aten import AtenKernel

SEQ = 32  # divides by 2N for N = 2 and 4 (zigzag)
SLACK = 1e-3  # ring_cp's error may exceed twice the reference's by this much
PROBE = "test_autocast_probe"


class ProbeKernel(AtenKernel):
    """The aten kernel, recording the dtypes of every block call: ("fwd", q, k, v), ("bwd", dout, q, k, v, out)."""

    name = PROBE

    def __init__(self) -> None:
        self.seen: set = set()

    def forward(self, q, k, v, **kw):
        self.seen.add(("fwd", q.dtype, k.dtype, v.dtype))
        return super().forward(q, k, v, **kw)

    def backward(self, dout, q, k, v, out, lse, **kw):
        self.seen.add(("bwd", dout.dtype, q.dtype, k.dtype, v.dtype, out.dtype))
        return super().backward(dout, q, k, v, out, lse, **kw)


class SdpaDtypes(AttentionCount):
    """:class:`AttentionCount` that also records the dtypes each attention of the eager run computes in:
    ("fwd", q, k, v) of a fused attention op, or the scores' dtype three times for a softmax written by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        calls = self.calls
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.calls > calls:  # an attention call
            fused = "scaled_dot_product" in func.overloadpacket.__name__
            self.seen.add(("fwd", *(a.dtype for a in (args[:3] if fused else args[:1] * 3))))
        return out


class Encoder(nn.Module):
    """``nn.TransformerEncoder`` (post-norm, batch_first, bidirectional), a per-token regression head, MSE."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.head(self.enc(x)), targets)  # x (B, S, dim), targets (B, S, 4)


class HandWritten(nn.Module):
    """Causal attention written by hand (passes/fuse_attention.py makes it SDPA) on q, k rotated by a float32
    table as RoPE's: under autocast its products cast q and k (float32) and v (the autocast dtype)."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, 4)
        self.register_buffer("table", torch.rand(SEQ, dim // heads) + 0.5)  # (S, D) float32

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        B, S, C = x.shape  # (B, S, dim)
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)  # 3 x (B, H, S, D)
        q, k = q * self.table[:S], k * self.table[:S]
        scores = (q @ k.transpose(-1, -2)) / (C // self.heads) ** 0.5  # (B, H, S, S)
        w = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        return F.mse_loss(self.out((w @ v).transpose(1, 2).reshape(B, S, C)), targets)


class Autocast(nn.Module):
    """``model`` with ``torch.autocast`` entered inside its forward (so inside the compiled code)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.model, self.dtype = model, dtype

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=self.dtype):
            return self.model(*args)


# world size -> cases: (model, autocast dtype or None (the model cast to bf16, no autocast)[, autocast entered
# inside the compiled forward]); "ring_attention": the op called eagerly. Every model, dtype and world size
# would take longer than a test file may: each world size has a decoder and an encoder, and each of those
# runs under bf16 on one world size and under fp16 on the other.
CASES = {
    2: [("llama", "bfloat16"), ("encoder", "float16", True), ("llama", None), ("hand_written", "float16"),
        ("ring_attention", "bfloat16")],
    4: [("llama", "float16"), ("encoder", "bfloat16")],
}


def _model(name: str) -> Tuple[nn.Module, tuple]:
    """(model returning a scalar loss, inputs), the same on every rank."""
    if name == "llama":  # the pattern: q, k float32 after RoPE (float32 tables), v in the autocast dtype
        return models.llama_factory(seq_len=SEQ, n_layers=1)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = HandWritten() if name == "hand_written" else Encoder()
    return model, (torch.randn(2, SEQ, 64, generator=g), torch.randn(2, SEQ, 4, generator=g))  # x, targets


def _truth(model: nn.Module, inputs: tuple) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Loss and gradients of a float64 copy of ``model``, without autocast."""
    m = copy.deepcopy(model).double()
    loss = m(*(x.double() if x.is_floating_point() else x for x in inputs))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}


def _errors(loss, model, true_loss, true_grads) -> Dict[str, float]:
    """Relative error of the loss and of each parameter gradient against the truth."""
    errs = {"loss": rel(loss.detach(), true_loss)}
    for n, p in model.named_parameters():
        errs[n] = rel(p.grad, true_grads[n]) if p.grad is not None else float("inf")
    return errs


def _case(name: str, dtype: Optional[str], inside: bool = False) -> Dict[str, Any]:
    """On a rank: one model under autocast to ``dtype`` (None: the model cast to bf16, no autocast;
    ``inside``: autocast entered in the compiled forward) through one process and through ring_cp."""
    model, inputs = _model(name)
    cast = getattr(torch, dtype) if dtype else None
    if cast is None:
        model = model.to(torch.bfloat16)
    true_loss, true_grads = _truth(model, inputs)
    ref_model, cp_model = model, copy.deepcopy(model)
    ref_run, cp_run = (Autocast(m, cast) if inside else m for m in (ref_model, cp_model))
    around = torch.autocast("cpu", dtype=cast, enabled=cast is not None and not inside)
    probe = ProbeKernel()
    register_kernel(probe, replace=True)
    backend = cp_compile.RingCP(inner="aot_eager", kernel=PROBE)
    with around, SdpaDtypes() as sdpa:
        ref = ref_run(*inputs)
    with around:
        ref.backward()
        out = torch.compile(cp_run, backend=backend, fullgraph=True)(*inputs)
        out.backward()
    return {"case": (name, dtype, inside), "cp": _errors(out, cp_model, true_loss, true_grads),
            "ref": _errors(ref, ref_model, true_loss, true_grads), "sdpa": sdpa.seen, "ring": probe.seen,
            "rings": ring_mismatches(backend, sdpa.calls), "fallbacks": list(backend.fallbacks)}


def _api(dtype: str) -> Dict[str, Any]:
    """On a rank: ``cp_compile.ring_attention`` called eagerly under autocast to ``dtype`` on float32 q, k
    and a v in ``dtype`` (the op's autocast kernel at run time), reported as :func:`_case` does: out, dq,
    dk, dv on this rank's rows against SDPA on the whole sequence (the reference: under the same autocast)."""
    cast, g = getattr(torch, dtype), torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 4, SEQ, 16, generator=g) for _ in range(4))  # (B, H, S, D)
    probe = ProbeKernel()
    register_kernel(probe, replace=True)
    runs, eager = {}, set()
    for run in ("truth", "ref", "cp"):
        leaves = [(x.double() if run == "truth" else x.clone()).requires_grad_() for x in (q, k, v.to(cast))]
        with torch.autocast("cpu", dtype=cast, enabled=run != "truth"), SdpaDtypes() as sdpa:
            if run == "cp":  # each rank's rows of q, k, v in, its rows of the output out
                out = cp_compile.ring_attention(*(cp_compile.shard(x, 2) for x in leaves), causal=True, kernel=PROBE)
            else:
                out = F.scaled_dot_product_attention(*leaves, is_causal=True)
        eager = sdpa.seen if run == "ref" else eager
        out.backward((cp_compile.shard(dout, 2) if run == "cp" else dout).to(out.dtype))
        rows = out.detach() if run == "cp" else cp_compile.shard(out.detach(), 2)
        runs[run] = [rows] + [cp_compile.shard(x.grad, 2) for x in leaves]  # out, dq, dk, dv on this rank's rows
    errors = {run: {n: rel(a, t) for n, a, t in zip(("out", "dq", "dk", "dv"), runs[run], runs["truth"])}
              for run in ("ref", "cp")}
    return {"case": ("ring_attention", dtype, False), **errors, "sdpa": eager, "ring": probe.seen,
            "rings": [], "fallbacks": []}


def _cases(cases: List[tuple]) -> List[Dict[str, Any]]:
    return [_api(*c[1:]) if c[0] == "ring_attention" else _case(*c) for c in cases]


def _check(results: List[List[Dict[str, Any]]]) -> None:
    """Every rank's cases: errors no worse than twice the one-process run's (+ SLACK), the ring's dtypes the
    eager attention's (one dtype per case, forward and backward), every attention the ring, no gather."""
    for rank, per_case in enumerate(results):
        for r in per_case:
            worse = {k: (e, r["ref"][k]) for k, e in r["cp"].items() if not e <= 2 * r["ref"][k] + SLACK}
            assert not worse, (rank, r["case"], "ring_cp error, one-process error:", worse)
            fwd = {s for s in r["ring"] if s[0] == "fwd"}
            assert len(r["sdpa"]) == 1 and fwd == r["sdpa"], (rank, r["case"], "ring", fwd, "eager", r["sdpa"])
            dtype = next(iter(r["sdpa"]))[1]
            assert {s[1:] for s in r["ring"] if s[0] == "bwd"} == {(dtype,) * 5}, (rank, r["case"], r["ring"])
            assert not r["rings"] and not r["fallbacks"], (rank, r["case"], r["rings"], r["fallbacks"])


def test_the_op_casts_q_k_v_as_autocast_casts_sdpa() -> None:
    """Fake tensors, no process group: under autocast the op's output has the dtype SDPA's has (bf16,
    fp16), float64 is not cast (as SDPA's is not), and q, k, v that end up in different dtypes are
    refused with the fix, as SDPA refuses them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    op, flags = torch.ops.cp_compile.ring_attention_fwd.default, (True, 0.25, "0", "zigzag", "p2p", "auto")
    with FakeTensorMode():
        q = torch.randn(2, 4, 8, 16)  # (B, H, c, D) float32, as RoPE leaves q and k
        v = q.bfloat16()
        for dtype in (torch.bfloat16, torch.float16):
            with torch.autocast("cpu", dtype=dtype):
                out, lse = op(q, q, v, *flags)
                want = F.scaled_dot_product_attention(q, q, v, is_causal=True)
            assert (out.dtype, lse.dtype) == (want.dtype, torch.float32) == (dtype, torch.float32)
        with pytest.raises(ValueError, match="dtypes differ .* Fix: cast q, k, v to one dtype"):
            op(q, q, v, *flags)
        with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="dtypes differ"):
            op(q.double(), q, v, *flags)


@pytest.mark.slow
def test_autocast_on_two_ranks(ranks) -> None:
    _check(ranks.run(2, _cases, CASES[2], timeout=300))


@pytest.mark.slow
def test_autocast_on_four_ranks(ranks) -> None:
    _check(ranks.run(4, _cases, CASES[4], timeout=300))
