"""What two or more test files share, defined once (no test module imports another;
tests/test_package.py checks it): the checks of exactness below, then the ring op's inputs,
references and reassembly, documents and FlexAttention-style mods, the Triton kernels' one-step
checks, the example-model comparison, the masked two-layer model and the CLI runner. The DP x CP
recipes are in tests/compose_kit.py, the rank pools in tests/distributed.py.

The checks shared by the tests that compare a ring_cp model with the uncompiled one:

``outputs="full"`` promises what the uncompiled model returns: values, shapes and the
memory layout (strides), since code after a graph break may ``view`` an output. And
``cp-compile explain`` promises what the runtime does: :func:`explain_record` is the
record explain prints, to compare with the backend's ``RingCP.records``.

Exactness is two checks, since a graph compiled unchanged is exact too: every parameter
gradient against the one-process run (:func:`grad_errors`), and every attention of the model,
counted without the code under test (:class:`AttentionCount`), became the ring
(:func:`ring_mismatches`).
"""

from __future__ import annotations

import os
from typing import Any, List, Optional

import torch
from torch.utils._pytree import tree_flatten

# What exact means (examples/_exact.py, in examples/ so that examples/zoo/measure.py and
# examples/hf_sweep.py judge by the same rules; re-exported here for the tests): every gradient
# against its own norm, only those named as zero in exact arithmetic against 1e-4 of the whole
# gradient's norm; and every attention of the eager run became the ring.
from _exact import AttentionCount, cp_compile_warnings, grad_errors, rel, ring_mismatches  # noqa: F401 (re-exported)


def layout_mismatches(out: Any, ref: Any) -> List[str]:
    """Each tensor of ``out`` (any nesting of tuples, lists, dicts, ModelOutputs) whose shape or
    strides differ from ``ref``'s tensor at the same place; [] when all agree."""
    outs, ref_leaves = (_tensors(x) for x in (out, ref))
    if len(outs) != len(ref_leaves):
        return [f"{len(outs)} tensors returned, the uncompiled model returns {len(ref_leaves)}"]
    return [f"output {i}: shape {tuple(a.shape)} strides {a.stride()}, uncompiled {tuple(b.shape)} {b.stride()}"
            for i, (a, b) in enumerate(zip(outs, ref_leaves)) if a.shape != b.shape or a.stride() != b.stride()]


def _tensors(tree: Any) -> List[torch.Tensor]:
    if hasattr(tree, "to_tuple"):  # a Hugging Face ModelOutput
        tree = tree.to_tuple()
    leaves, _ = tree_flatten(tree)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def explain_record(model: torch.nn.Module, args: tuple = (), kwargs: Any = None, world_size: int = 2,
                   rank: Any = None, **options: Any) -> Any:
    """The :class:`cp_compile.backend.record.GraphRecord` that ``cp-compile explain --rank R`` prints for
    ``model`` (one graph, traced without a process group; R: this process's rank when a process
    group is up, else 0). Resets Dynamo: call it before compiling."""
    import torch.distributed as dist

    from cp_compile.tools.explain import explain_model

    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    return explain_model(model, args, world_size=world_size, example_kwargs=kwargs, rank=rank, **options).ctx.record


def loss_through_ring_cp(ref_model: torch.nn.Module, cp_model: torch.nn.Module, inputs: tuple, *,
                         attention: bool = True, **options: Any):
    """On a rank: forward + backward of the scalar loss of ``ref_model`` (eager, whole sequence)
    and of ``cp_model`` (an identical copy) through ring_cp (``inner="aot_eager"``,
    ``fullgraph=True``), after checking that explain's record is the one the runtime keeps and
    that every attention of the eager run (:class:`AttentionCount`) became the ring
    (``attention=False``: a model with no attention, whose caller checks what was sharded).
    Returns ``(ref_loss, cp_loss, backend)``."""
    import torch.distributed as dist

    import cp_compile

    explained = explain_record(ref_model, inputs, world_size=dist.get_world_size(), **options)
    with AttentionCount() as count:
        ref = ref_model(*inputs)
    ref.backward()
    backend = cp_compile.RingCP(inner="aot_eager", **options)
    out = torch.compile(cp_model, backend=backend, fullgraph=True)(*inputs)
    out.backward()
    assert backend.records == [explained], (backend.records, explained)  # explain says what the runtime did
    if attention:
        assert not (rings := ring_mismatches(backend, count.calls)), rings
    else:
        assert count.calls == 0, f"{count.calls} attention calls in a model said to have none"
    assert any(r.shard_inputs or r.shard_nodes for r in backend.records), \
        f"the sequence is sharded nowhere (no input, no node): {[r.summary() for r in backend.records]}"
    return ref, out, backend


def compare_recurrent_model(make: Any, x: torch.Tensor, attention: bool, load_balance: str) -> dict:
    """On a rank: twin models from ``make`` (:func:`twin_models`), one step of ``x`` through ring_cp
    against the eager one-process step (:func:`loss_through_ring_cp`): the loss's relative error, each
    gradient's, the fallbacks, each record's recurrence lines and the number of gathers in the graphs."""
    from cp_compile.graph_ops import gather_seq

    ref_model, cp_model = twin_models(make)
    ref, out, backend = loss_through_ring_cp(ref_model, cp_model, (x,), attention=attention,
                                             load_balance=load_balance)
    return {"loss": rel(out.detach(), ref.detach()), "grads": grad_errors(cp_model, ref_model),
            "fallbacks": backend.fallbacks, "recurrences": [r.recurrences for r in backend.records],
            "gathers": sum(n.target is gather_seq for gm in backend.graphs for n in gm.graph.nodes)}


def pieces_mismatches(records: List[Any], explained: Any) -> List[str]:
    """What of ``explained`` (explain's record of a model traced as one graph, e.g. without its
    graph breaks) the runtime's ``records`` of the same model compiled as several graphs (graph
    breaks, DDPOptimizer's buckets) must show too; [] when all agree. Per graph only the runtime
    knows where a piece starts, so compared: the CP group size, the attention source lines in
    order (node names can differ: DDPOptimizer's pieces rename nodes) with every one the ring,
    the fallbacks and unsplit attention by source line, and the activation bytes on one device
    (the pieces split the one graph's intermediate tensors between them)."""
    import re

    def lines(msgs: List[str]) -> List[str]:  # a finding without the node name it carries
        return [re.sub(r" \(node [^)]*\)", "", m) for m in msgs]

    got = {
        "world_size": sorted({r.world_size for r in records}),
        "attention": [line for r in records for _, line in r.attention],
        "rings": sum(r.rings for r in records),
        "graphs whose attention is not all the ring": [i for i, r in enumerate(records) if r.rings != len(r.attention)],
        "fallbacks": lines([f for r in records for f in r.fallbacks]),
        "unsplit": lines([u for r in records for u in r.unsplit]),
        "act_bytes_global": sum(r.act_bytes_global for r in records),
    }
    want = {
        "world_size": [explained.world_size], "attention": [line for _, line in explained.attention],
        "rings": explained.rings, "graphs whose attention is not all the ring": [],
        "fallbacks": lines(explained.fallbacks), "unsplit": lines(explained.unsplit),
        "act_bytes_global": explained.act_bytes_global,
    }
    return [f"{k}: runtime {got[k]!r}, explain {want[k]!r}" for k in want if got[k] != want[k]]


# --------------------------------------------------------------------------- the ring op: inputs and references
# Shared by the tests of ``cp_compile.ring_attention`` (test_ring_*.py, test_triton_*.py, test_fuzz.py).
# Error metric there: :func:`rel` (norm-wise relative error in float64), or :func:`rel_or_abs`.

ROTATES = ("p2p", "allgather")
QUANTITIES = ("out", "dq", "dk", "dv")
FP32_RTOL = 1e-5


def rel_or_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    """:func:`rel`, or the absolute error ||a - b|| where ||b|| = 0 (a block whose true gradient is
    exactly zero, as the Triton kernels' fully masked blocks give)."""
    a, b = a.double(), b.double()
    den = b.norm()
    return ((a - b).norm() / den).item() if den > 0 else (a - b).norm().item()


def attention_inputs(b: int, h: int, hkv: int, sq: int, sk: int, d: int, dtype: torch.dtype = torch.float64,
                     seed: int = 0) -> tuple:
    """(q, k, v, dout) drawn in float64 from ``seed`` (the same on every process), cast to ``dtype``:
    q and dout (B, H, Sq, D), k and v (B, H_kv, Sk, D)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
                     for shape in ((b, h, sq, d), (b, hkv, sk, d), (b, hkv, sk, d), (b, h, sq, d)))
    return q, k, v, dout


def make_inputs(cfg: dict) -> tuple:
    """Full-sequence (q, k, v, dout) in float64 for a ring config (keys b, h, hkv, s, d, seed)."""
    return attention_inputs(cfg["b"], cfg["h"], cfg["hkv"], cfg["s"], cfg["s"], cfg["d"], seed=cfg["seed"])


def ring_fwd_bwd(q, k, v, dout, cfg: dict, rotate: str, dtype: torch.dtype, *, scale=None, group=None) -> tuple:
    """On a rank: shard the full fp64 tensors, run the ring forward + backward (config keys lb,
    causal, kernel); the local (out, dq, dk, dv), each (B, H|H_kv, S/N, D)."""
    import cp_compile

    lb = cfg["lb"]
    ql, kl, vl, dol = (cp_compile.shard(t, 2, group=group, load_balance=lb).to(dtype) for t in (q, k, v, dout))
    ql, kl, vl = (t.detach().requires_grad_() for t in (ql, kl, vl))
    out = cp_compile.ring_attention(ql, kl, vl, causal=cfg["causal"], scale=scale, group=group, load_balance=lb,
                                    rotate=rotate, kernel=cfg["kernel"])
    out.backward(dol)
    return out.detach(), ql.grad, kl.grad, vl.grad


def assemble(shards: List[torch.Tensor], seq_len: int, lb: str) -> torch.Tensor:
    """Full (B, H, S, D) float64 tensor from every rank's (B, H, S/N, D) shard."""
    from cp_compile.sequence import rank_positions

    n = len(shards)
    b, h, _, d = shards[0].shape
    full = torch.full((b, h, seq_len, d), float("nan"), dtype=torch.float64)
    for r, x in enumerate(shards):
        full[:, :, rank_positions(seq_len, n, r, lb)] = x.double()
    assert not full.isnan().any(), "the shards do not cover every position"
    return full


def sdpa_fwd_bwd(q, k, v, dout, causal: bool, dtype: torch.dtype, scale=None) -> tuple:
    """Single-process SDPA on the full sequence in ``dtype``: (out, dq, dk, dv)."""
    import torch.nn.functional as F

    q, k, v = (t.to(dtype).detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    out.backward(dout.to(dtype))
    return out.detach(), q.grad, k.grad, v.grad


def sdpa_reference(cfg: dict, dtype: torch.dtype) -> tuple:
    """(fp64 reference, single-process SDPA in ``dtype``), both on the inputs rounded to ``dtype``."""
    q, k, v, dout = (t.to(dtype).double() for t in make_inputs(cfg))
    return (sdpa_fwd_bwd(q, k, v, dout, cfg["causal"], torch.float64),
            sdpa_fwd_bwd(q, k, v, dout, cfg["causal"], dtype))


def refusals(q, k, v, calls) -> list:
    """The ValueError message of each ``ring_attention(q, k, v, **kw)`` for kw in ``calls``, in order;
    None where the call ran."""
    import cp_compile

    msgs = []
    for kw in calls:
        try:
            cp_compile.ring_attention(q, k, v, **kw)
            msgs.append(None)
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def large_logit_inputs(kind: str, seed: int, s: int = 64, d: int = 64) -> tuple:
    """Full fp64 (q, k, v, dout, scale), exactly representable in fp32, with logits of magnitude ~1e3.

    q and k lie on a grid (multiples of 1/8, resp. integers) small enough that every partial
    sum of q.k is exactly representable in fp32 and the scale is a power of two: the fp32
    logits are *exact* in any summation order. What is left is the attention's own rounding
    (exp, lse, merge), which is what the large-logit tests are about; otherwise the fp32 rounding
    of the logits themselves (ulp(1e3) ~ 6e-5, accumulated over the head dim) puts a ~1e-4 floor
    under single-process SDPA too.

    ``shifted``: every logit of a query row is +-1000 + O(1) (q[..., 0] = +-1000, k[..., 0] = 1,
    scale 1): an ordinary, well-conditioned softmax, but exp(logit) overflows every float, so
    only a max-subtracted kernel and an lse-space merge give finite numbers.
    ``saturated``: integer q, k ~ N(0, 250) so logits = q.k / 8 have std ~250 and reach ~1e3:
    the softmax is one-hot to machine precision on almost every row.
    """
    g = torch.Generator().manual_seed(seed)
    b, h, hkv = 1, 4, 2
    assert d == 64
    if kind == "shifted":
        sigma = (d - 1) ** -0.25  # the O(1) part of the logits has std ~1
        q = torch.round(torch.randn(b, h, s, d, generator=g, dtype=torch.float64) * sigma * 8) / 8
        k = torch.round(torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64) * sigma * 8) / 8
        sign = torch.randint(0, 2, (b, h, s), generator=g).double() * 2 - 1
        q[..., 0] = 1000.0 * sign
        k[..., 0] = 1.0
        scale = 1.0
    elif kind == "saturated":
        a = 250.0**0.5  # q.k ~ N(0, a^4 d), logits = q.k / sqrt(d) ~ N(0, a^4) = N(0, 250^2)
        q = torch.round(torch.randn(b, h, s, d, generator=g, dtype=torch.float64) * a)
        k = torch.round(torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64) * a)
        scale = None  # 1/8
    else:
        raise ValueError(kind)
    v = torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64)
    dout = torch.randn(b, h, s, d, generator=g, dtype=torch.float64)
    v, dout = (t.float().double() for t in (v, dout))
    return q, k, v, dout, scale


def large_logits_rank_fn(cases: List[dict]) -> list:
    """On a rank: the fp32 ring (p2p) on each case's :func:`large_logit_inputs`; local (out, dq, dk, dv) each."""
    out = []
    for case in cases:
        q, k, v, dout, scale = large_logit_inputs(case["kind"], case["seed"])
        out.append(ring_fwd_bwd(q, k, v, dout, case, "p2p", torch.float32, scale=scale))
    return out


# --------------------------------------------------------------------------- documents and mods


def doc_ids(lengths_per_row, s: int) -> torch.Tensor:
    """(B, S) int64 document ids from per-row document lengths (each row's lengths sum to S)."""
    import cp_compile

    rows = [cp_compile.doc_ids_from_cu_seqlens(torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()]), s)
            for ls in lengths_per_row]
    return torch.cat(rows).long()


def dense_mask(ids, s, causal, valid_len=-1, keep=None) -> torch.Tensor:
    """(B|1, 1, S, S) bool: same document (& causal) (& key < valid_len) (& key kept)."""
    m = (ids[:, :, None] == ids[:, None, :]).unsqueeze(1)
    if causal:
        m = m & torch.ones(s, s, dtype=torch.bool).tril()
    if valid_len >= 0:
        m = m & (torch.arange(s) < valid_len)
    if keep is not None:
        m = m & keep
    return m


def dead_rows(mask, real_rows) -> torch.Tensor:
    """(B|1, 1, S, 1) bool: rows with no visible key, or padding rows (no gradient, compared as 0)."""
    return ~mask.any(-1, keepdim=True) | ~real_rows[:, None, :, None]


def masked_sdpa_reference(q, k, v, dout, mask, real_rows) -> tuple:
    """fp64 SDPA with ``mask``: (out, dq, dk, dv), dead rows' dout zeroed and their out 0; and the dead rows."""
    import torch.nn.functional as F

    dead = dead_rows(mask, real_rows)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | dead, enable_gqa=q.shape[1] != k.shape[1])
    out.backward(dout.masked_fill(dead, 0.0))
    return (out.detach().masked_fill(dead, 0.0), q.grad, k.grad, v.grad), dead


# FlexAttention-style mods (tests/test_ring_mods.py, tests/test_triton_mods.py) and their constants.
WINDOW, PREFIX, CAP = 6, 11, 1.5
MOD_HEADS = 4  # the heads the ALiBi slopes are for


def causal_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def document_mod(b, h, q_idx, kv_idx, doc):
    return doc[b, q_idx] == doc[b, kv_idx]


def window_mod(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)


def prefix_lm_mod(b, h, q_idx, kv_idx):
    return (kv_idx < PREFIX) | (q_idx >= kv_idx)


def alibi_mod(score, b, h, q_idx, kv_idx, slopes):
    return score + slopes[h] * (kv_idx - q_idx)


def softcap_mod(score, b, h, q_idx, kv_idx):
    return CAP * torch.tanh(score / CAP)


def mods_doc_ids(s: int) -> torch.Tensor:
    """(2, S) int64: the document ids ``document_mod`` reads (row 0: 3 documents, row 1: 2)."""
    ids = torch.zeros(2, s, dtype=torch.int64)
    ids[0, 5:], ids[0, 20:] = 1, 2
    ids[1, 13:] = 1
    return ids


def alibi_slopes() -> torch.Tensor:
    """(MOD_HEADS,) the slopes ``alibi_mod`` reads."""
    return torch.tensor([2.0 ** (-(i + 1)) for i in range(MOD_HEADS)])


# --------------------------------------------------------------------------- the Triton kernels, one step


def position_reference(q, k, v, dout, q_pos, k_pos, *, causal, scale, kv_limit=2**31 - 1) -> tuple:
    """fp64 (out, lse, dq, dk, dv) of position-masked attention; keyless rows: out 0, lse -inf."""
    q, k, v, dout = (t.detach().double().requires_grad_() for t in (q, k, v, dout))
    rep = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    visible = (k_pos[None, :] < kv_limit).expand(len(q_pos), -1)
    if causal:
        visible = visible & (k_pos[None, :] <= q_pos[:, None])
    s = (q @ ke.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))  # (B, H, Sq, Sk)
    lse = torch.logsumexp(s, -1)  # -inf for keyless rows
    p = torch.exp(s - torch.where(lse.isinf(), 0.0, lse).unsqueeze(-1))
    out = p @ ve
    out.backward(dout)
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def check_fp32(got, want, what: str) -> None:
    """Each of (out, lse, dq, dk, dv) has no NaN and is within FP32_RTOL of ``want`` (:func:`rel_or_abs`);
    lse is -inf on the same rows and compared on the others."""
    names = ("out", "lse", "dq", "dk", "dv")
    for name, g, w in zip(names, got, want):
        assert not g.isnan().any(), f"{what}: {name} has NaN"
        if name == "lse":
            assert torch.equal(g.isinf(), w.isinf()), f"{what}: keyless rows differ"
            g, w = g[~w.isinf()], w[~w.isinf()]
        assert rel_or_abs(g, w) <= FP32_RTOL, f"{what}: {name} rel err {rel_or_abs(g, w):.3g}"


def real_compile(calls: str) -> list:
    """The records of ``calls`` (an expression over ``compile_all``) run by the real Triton compiler
    in a subprocess without TRITON_INTERPRET."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    code = f"import json; from cp_compile.kernels.triton.compile_check import compile_all; print(json.dumps({calls}))"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- models through ring_cp


def loss_and_grad_errors(ref_model: torch.nn.Module, ref: torch.Tensor, cp_model: torch.nn.Module,
                         out: torch.Tensor) -> tuple:
    """(loss rel err, max parameter-gradient rel err) of the CP run against the reference."""
    return rel(out.detach(), ref.detach()), max(grad_errors(cp_model, ref_model).values())


def graph_summary(backend: Any) -> dict:
    """How many of each inserted op the rewritten graph(s) of ``backend`` (a RingCP) call."""
    names = [getattr(n.target, "__name__", str(n.target)) for gm in backend.graphs for n in gm.graph.nodes
             if n.op == "call_function"]
    targets = [str(n.target) for gm in backend.graphs for n in gm.graph.nodes if n.op == "call_function"]
    return {
        "ring_attention_fwd": sum("ring_attention_fwd" in t for t in targets),
        **{k: names.count(k) for k in ("grad_all_reduce", "grad_all_reduce_bucket", "gather_seq", "all_reduce_sum")},
    }


def example_through_ring_cp(factory: str, kw: dict, options: dict) -> tuple:
    """On a rank: the example model ``models.<factory>(**kw)`` through :func:`loss_through_ring_cp`;
    (loss rel err, max grad rel err, #fallbacks, :func:`graph_summary`)."""
    import models

    torch._dynamo.reset()
    ref_model, inputs = getattr(models, factory)(**kw)
    cp_model, _ = getattr(models, factory)(**kw)
    ref, out, backend = loss_through_ring_cp(ref_model, cp_model, inputs, **options)
    return (*loss_and_grad_errors(ref_model, ref, cp_model, out), len(backend.fallbacks), graph_summary(backend))


def twin_models(make: Any) -> tuple:
    """(reference, copy for ring_cp): ``make()`` twice after ``torch.manual_seed(0)``, the copy given the
    reference's state (parameters and buffers) so that the two are identical."""
    torch.manual_seed(0)
    ref_model, cp_model = make(), make()
    cp_model.load_state_dict(ref_model.state_dict())
    return ref_model, cp_model


MASKED_B, MASKED_D = 2, 16  # MaskedAttention's batch and width


class MaskedAttention(torch.nn.Module):
    """Two attention layers over x (B, S, 16) sharing one mask, built as ``kind`` says
    (tests/test_backend_masks.py; inputs: :func:`masked_inputs`)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(MASKED_D, 3 * MASKED_D) for _ in range(2))
        self.head = torch.nn.Linear(MASKED_D, 1)

    def mask(self, S: int, padding: Optional[torch.Tensor], given: Optional[torch.Tensor]) -> torch.Tensor:
        B = MASKED_B
        qi = torch.arange(S)[None, None, :, None]  # (1, 1, S, 1)
        ki = torch.arange(S)[None, None, None, :]  # (1, 1, 1, S)
        return {
            "causal_padding": lambda: (ki <= qi) & padding[torch.arange(B)[:, None, None, None], ki],
            "no_upper_bound": lambda: ki > qi - 4,
            "bidirectional_window": lambda: (ki > qi - 5) & (ki < qi + 3),
            "float": lambda: (ki <= qi).float(),  # added to the scores: 1 on the causal part, 0 elsewhere
            "given": lambda: given,
            "query_key_padding": lambda: padding[torch.arange(B)[:, None, None, None], qi] & padding[
                torch.arange(B)[:, None, None, None], ki],  # reads an input: no rule of positions (rewrite only)
        }[self.kind]()

    def forward(self, x: torch.Tensor, padding: Optional[torch.Tensor] = None,
                given: Optional[torch.Tensor] = None) -> torch.Tensor:
        import torch.nn.functional as F

        B, D, S = MASKED_B, MASKED_D, x.shape[1]
        mask = self.mask(S, padding, given)
        for qkv in self.qkv:
            q, k, v = qkv(x).view(B, S, 3, 2, D // 2).permute(2, 0, 3, 1, 4)  # 3 x (B, 2, S, 8)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + out.transpose(1, 2).reshape(B, S, D)
        return self.head(x).pow(2).mean()


def masked_inputs(kind: str, S: int) -> dict:
    """MaskedAttention's inputs: x (B, S, 16), padding (B, S) bool (row 0 right-padded by 5), and
    for ``given`` / ``given_additive`` the mask passed in, (B, 1, S, S) bool / (B, 2, S, S) additive."""
    B, D = MASKED_B, MASKED_D
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, S, D, generator=g)
    padding = torch.ones(B, S, dtype=torch.bool)
    padding[0, S - 5:] = False  # row 0: right padding; every query still sees its first key
    given = None
    if kind == "given":  # a random bool mask (diagonal kept: no query sees nothing) ...
        given = (torch.rand(B, 1, S, S, generator=g) < 0.5) | torch.eye(S, dtype=torch.bool)
    if kind == "given_additive":  # ... or an additive one per head, with finfo.min as Hugging Face writes it
        keep = (torch.rand(B, 2, S, S, generator=g) < 0.5) | torch.eye(S, dtype=torch.bool)
        given = torch.zeros(B, 2, S, S).masked_fill(~keep, torch.finfo(torch.float32).min)
    return {"x": x, "padding": padding, "given": given}


# --------------------------------------------------------------------------- the graph commands of the CLI

LLAMA_TARGET = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                            "models.py") + ":llama_factory"


def run_cli(argv: List[str], capsys: Any) -> tuple:
    """``cp-compile dump|explain ARGV`` in this process: (exit code, stdout, stderr)."""
    import argparse

    from cp_compile.tools.graph_commands import add_dump_parser, add_explain_parser, cmd_dump, cmd_explain

    parser = argparse.ArgumentParser(prog="cp-compile")
    sub = parser.add_subparsers(dest="command", required=True)
    add_dump_parser(sub)
    add_explain_parser(sub)
    args = parser.parse_args(argv)
    code = {"dump": cmd_dump, "explain": cmd_explain}[args.command](args)
    out, err = capsys.readouterr()
    return code, out, err


# --------------------------------------------------------------------------- the zoo


def zoo_problems(member: Any, r: dict, sharded: bool = True) -> List[str]:
    """What of tests/test_zoo.py's checks one rank's :func:`zoo.measure.measure` result fails (empty: all
    hold); ``sharded=False`` skips the member's minimum sharded fraction (Ulysses' head-sharded copies
    of q, k, v, out count against it)."""
    bad = []
    if not (r["loss"] <= member.tol and r["grad"] <= member.tol):
        bad.append(f"error: loss {r['loss']:.2e}, worst gradient {r['grad']:.2e} ({r['grad_name']})")
    if r["grads_missing"]:
        bad.append(f"gradient on one side only: {r['grads_missing']}")
    bad += r["ring_mismatches"]
    if r["whole_attention"] or r["quadratic"] or r["recompiled"]:
        bad.append(f"second call: attention outside the ring {r['whole_attention']}, sequence-squared "
                   f"tensors {r['quadratic']}, recompiled {r['recompiled']}")
    unexpected = [f for f in r["fallbacks"] if not any(op in f for op in member.mixes_tokens)]
    absent = [op for op in member.mixes_tokens if not any(op in f for f in r["fallbacks"])]
    if unexpected or absent:
        bad.append(f"fallbacks: unexpected {unexpected}, declared but absent {absent}")
    if sharded and r["sharded"] < member.min_sharded:
        bad.append(f"sharded fraction {r['sharded']:.3f} < {member.min_sharded}")
    if len(r["records"]) == 1:
        if r["records"] != [r["explained"]]:
            bad.append(f"explain {r['explained']} != runtime {r['records']}")
    else:
        bad += pieces_mismatches(r["records"], r["explained"])
    return bad
