"""Packed documents inside the Triton ring kernels (issue 16, item 1, Triton part).

What is checked, under ``TRITON_INTERPRET=1`` (conftest) at small shapes (S <= 64, D = 16,
16 x 16 tiles), every result against fp64 dense attention on the same inputs with the
equivalent mask (key j visible to query i iff the position rules allow it AND the two
rows' document ids are equal):

- one ring step with per-row document ids: B = 2 with different documents per row (a
  document of one token, documents shorter than a tile, one longer than a block), one row
  of ids shared by the batch, causal and not, local and zig-zag cross-block positions,
  padding (``kv_limit``) with a sliding window, GQA: fp32 <= 1e-5 relative on out, lse, dq, dk, dv;
- tile skipping: the tiles the forward and dQ kernels compute (their debug counters)
  equal a brute-force count of the tiles the position and document-range rules keep; no
  tile whose query and key rows share no document is ever computed, and with documents
  fewer tiles run than without;
- the ring on 2 gloo ranks (``ring_forward_fused`` / ``ring_backward_fused`` with a spec
  carrying ``doc_ids``): exact on the whole sequence for every layout, and the steps
  launched are exactly the (rank, block) pairs with a visible pair (steps wholly across
  documents are not launched);
- ``cp_compile.ring_attention(kernel="triton", doc_ids=...)`` with autograd on 2 ranks: exact;
  a mask_mod the Triton kernels cannot translate is refused naming the op and the fix;
- refusals name the fix: a mask_mod the Triton kernels cannot translate, malformed document ids;
- the document variant of every kernel passes the real GPU compiler (sm_90, ptxas).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cp_compile.kernels.triton import Tiles, TritonKernel, zero_grads
from cp_compile.sequence import rank_positions
from checks import assemble, attention_inputs, check_fp32, real_compile, rel_or_abs

T16 = Tiles(16, 16)
NO_LIMIT = 2**31 - 1
S = 64
ROWS = ([5, 20, 1, 30, 8], [40, 24])  # document lengths of batch rows 0 and 1 (each sums to S)


def doc_ids(lengths: list[int]) -> torch.Tensor:
    """(sum(lengths),) int32: document k's positions hold id k."""
    return torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths))


def batch_docs() -> torch.Tensor:
    """(2, S) int32: different documents in each batch row."""
    return torch.stack([doc_ids(r) for r in ROWS])


def visible(q_pos, k_pos, q_doc, k_doc, *, causal: bool, kv_limit: int = NO_LIMIT,
            window: int = NO_LIMIT) -> torch.Tensor:
    """(B|1, Lq, Lk) bool: the kernels' rule (positions and equal document ids), brute force."""
    q_pos, k_pos = q_pos.long(), k_pos.long()
    vis = (k_pos[None, :] < kv_limit) & (q_pos[:, None] - k_pos[None, :] < window)
    if causal:
        vis = vis & (k_pos[None, :] <= q_pos[:, None])
    return vis[None] & (q_doc[:, :, None] == k_doc[:, None, :])


def dense_reference(q, k, v, dout, vis):
    """fp64 (out, lse, dq, dk, dv) of attention under the bool mask ``vis`` (B|1, Lq, Lk);
    rows with no visible key: out 0, lse -inf, no gradient. ``scale`` is fixed at 0.25."""
    q, k, v, dout = (t.detach().double().requires_grad_() for t in (q, k, v, dout))
    rep = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ ke.transpose(-1, -2) * 0.25).masked_fill(~vis[:, None], float("-inf"))  # (B, H, Lq, Lk)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(lse.isinf(), 0.0, lse).unsqueeze(-1))
    out = p @ ve
    out.backward(dout)
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def run_step(kern, q, k, v, dout, q_pos, k_pos, q_doc, k_doc, *, causal, kv_limit=NO_LIMIT, window=NO_LIMIT,
             counters=None):
    """One forward step + finalize and one backward step with documents: (out, lse, dq, dk, dv)."""
    q_pos, k_pos = q_pos.to(torch.int32), k_pos.to(torch.int32)
    fc, qc = counters if counters is not None else (None, None)
    state = kern.new_state(q)
    kern.forward_step(q, k, v, state, q_pos, k_pos, causal=causal, scale=0.25, kv_limit=kv_limit, window=window,
                      counter=fc, q_doc=q_doc, k_doc=k_doc)
    out, lse = kern.finalize(state, q.dtype)
    grads = zero_grads(q, k)
    kern.backward_step(dout, q, k, v, lse, kern.delta(dout, out), grads, q_pos, k_pos, causal=causal, scale=0.25,
                       kv_limit=kv_limit, window=window, counter=qc, q_doc=q_doc, k_doc=k_doc)
    return (out, lse, *grads)


def step_cases() -> list[tuple]:
    """(name, q_pos, k_pos, whole-sequence doc ids (B|1, S), kv_limit, window) of the one-step checks."""
    local = torch.arange(S)
    zz = [rank_positions(S, 2, r, "zigzag") for r in (0, 1)]
    one_row = doc_ids([3, 13, 16, 17, 15])[None]  # (1, S): every batch row has the same documents
    return [
        ("local", local, local, batch_docs(), NO_LIMIT, NO_LIMIT),
        ("zigzag rank 0 x block 1", zz[0], zz[1], batch_docs(), NO_LIMIT, NO_LIMIT),
        ("zigzag rank 1 x block 0", zz[1], zz[0], batch_docs(), NO_LIMIT, NO_LIMIT),
        ("one row of ids, padding, window 12", local, local, one_row, 50, 12),
    ]


def tile_counts(q_pos, k_pos, q_doc, k_doc, *, causal: bool, tile: int = 16) -> dict:
    """Brute force over every batch row and (query tile, key tile): ``kept`` by the kernels'
    rules (positions, then document ranges meet), ``by_position`` (position rule only),
    ``visible`` (some pair really visible) and ``no_shared_doc`` (no equal id in the tile)."""
    n = dict(kept=0, by_position=0, visible=0, no_shared_doc=0)
    vis = visible(q_pos, k_pos, q_doc, k_doc, causal=causal)  # (B, Lq, Lk)
    for b in range(q_doc.shape[0]):
        for i in range(0, len(q_pos), tile):
            for j in range(0, len(k_pos), tile):
                qp, kp = q_pos[i:i + tile], k_pos[j:j + tile]
                qd, kd = q_doc[b, i:i + tile], k_doc[b, j:j + tile]
                pos_live = not causal or bool(kp.min() <= qp.max())
                docs_meet = bool(kd.max() >= qd.min()) and bool(kd.min() <= qd.max())
                n["by_position"] += pos_live
                n["kept"] += pos_live and docs_meet
                n["visible"] += bool(vis[b, i:i + tile, j:j + tile].any())
                n["no_shared_doc"] += not bool((qd[:, None] == kd[None, :]).any())
    return n


def check_tiles(counters, q_pos, k_pos, q_doc, k_doc, *, causal: bool, heads: int, what: str) -> None:
    """The kernels' tile counters against :func:`tile_counts` (every batch row and head)."""
    fwd_tiles, dq_tiles = (c.item() for c in counters)
    n = {key: heads * val for key, val in tile_counts(q_pos, k_pos, q_doc, k_doc, causal=causal).items()}
    every = heads * q_doc.shape[0] * (len(q_pos) // 16) * (len(k_pos) // 16)
    what = f"{what}: fwd {fwd_tiles}, dq {dq_tiles}, brute force {n}"
    assert fwd_tiles == dq_tiles == n["kept"], what
    assert n["visible"] <= fwd_tiles <= every - n["no_shared_doc"], what  # nothing across documents
    assert fwd_tiles < n["by_position"], what  # the documents skip tiles the positions alone would run


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
def test_step_with_documents_matches_fp64_and_skips_tiles(causal):
    """Every case of :func:`step_cases` against fp64; the tile counts where there is no padding or window."""
    kern, heads = TritonKernel(T16), 2
    for i, (name, q_pos, k_pos, docs, limit, window) in enumerate(step_cases()):
        q, k, v, dout = attention_inputs(2, heads, 1, len(q_pos), len(k_pos), 16, dtype=torch.float32, seed=40 + i)
        q_doc, k_doc = docs[:, q_pos], docs[:, k_pos]  # (B|1, L) int32, by global position
        vis = visible(q_pos, k_pos, q_doc, k_doc, causal=causal, kv_limit=limit, window=window)
        want = dense_reference(q, k, v, dout, vis)
        counters = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
        got = run_step(kern, q, k, v, dout, q_pos, k_pos, q_doc, k_doc, causal=causal, kv_limit=limit, window=window,
                       counters=counters)
        check_fp32(got, want, f"{name} causal={causal}")
        if limit == window == NO_LIMIT:
            check_tiles(counters, q_pos, k_pos, q_doc, k_doc, causal=causal, heads=heads,
                        what=f"{name} causal={causal}")


@pytest.mark.slow
def test_document_kernels_compile_for_real_gpus():
    """The packed-document variant of every kernel passes the real Triton compiler (ptxas
    included) for sm_90, bf16, GQA, causal (test_triton_kernels checks the plain variant)."""

    records = real_compile("compile_all(90, 'bf16', head_dim=80, group=4, causal=True, docs=True)")
    assert len(records) == 4 and all(r["docs"] and r["cubin_bytes"] > 0 for r in records)
    assert max(r["shared_bytes"] for r in records) <= 164 * 1024  # fits an A100's shared memory


# --------------------------------------------------------------------------- 2 ranks


def ring_cases() -> list[dict]:
    """Every layout, causal and not; one row of ids or one per batch row; padding with ids
    only up to valid_len; a contiguous split on a document boundary (cross steps skipped)."""
    return [
        dict(lb="zigzag", causal=True, docs=batch_docs(), valid_len=-1, rotate="p2p"),
        dict(lb="striped", causal=False, docs=batch_docs(), valid_len=-1, rotate="allgather"),
        dict(lb="contiguous", causal=True, docs=doc_ids([7, 30, 27])[None], valid_len=-1, rotate="p2p"),
        dict(lb="contiguous", causal=False, docs=doc_ids([32, 32])[None], valid_len=-1, rotate="p2p"),
        dict(lb="zigzag", causal=True, docs=batch_docs()[:, :50], valid_len=50, rotate="allgather"),
    ]


def full_inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, h, S, 16, generator=g, dtype=torch.float64) for h in (2, 1, 1, 2))  # q k v dout


class CountingTriton(TritonKernel):
    """The Triton kernel, counting the ring steps launched."""

    def __init__(self) -> None:
        super().__init__(T16)
        self.steps = {"fwd": 0, "bwd": 0}

    def forward_step(self, *args, **kwargs) -> None:
        self.steps["fwd"] += 1
        super().forward_step(*args, **kwargs)

    def backward_step(self, *args, **kwargs) -> None:
        self.steps["bwd"] += 1
        super().backward_step(*args, **kwargs)


def _rank_ring(cases: list[dict]) -> list[tuple]:
    from cp_compile.group import resolve_group
    from cp_compile.ring.fused import ring_backward_fused, ring_forward_fused

    g = resolve_group(None)
    results = []
    for i, case in enumerate(cases):
        mine = rank_positions(S, g.size, g.rank, case["lb"])
        q, k, v, dout = (t[:, :, mine].float() for t in full_inputs(seed=80 + i))
        spec = SimpleNamespace(window=-1, attn_mask=None, doc_ids=case["docs"], mods=None)
        kern = CountingTriton()
        opts = dict(causal=case["causal"], scale=0.25, group=g, load_balance=case["lb"], rotate=case["rotate"],
                    kernel=kern, valid_len=case["valid_len"], spec=spec)
        out, lse = ring_forward_fused(q, k, v, **opts)
        grads = ring_backward_fused(dout, q, k, v, out, lse, **opts)
        results.append((out, lse, *grads, dict(kern.steps)))
    return results


def launched_steps(case: dict, rank: int, n: int, docs: torch.Tensor) -> int:
    """Brute force: the blocks against which ``rank``'s queries see at least one key."""
    limit = case["valid_len"] if case["valid_len"] >= 0 else NO_LIMIT
    q_pos = rank_positions(S, n, rank, case["lb"])
    return sum(
        bool(visible(q_pos, k_pos, docs[:, q_pos], docs[:, k_pos], causal=case["causal"], kv_limit=limit).any())
        for k_pos in (rank_positions(S, n, src, case["lb"]) for src in range(n))
    )


@pytest.mark.slow
def test_ring_with_documents_matches_fp64_and_skips_steps(ranks):
    cases = ring_cases()
    per_rank = ranks.run(2, _rank_ring, cases, timeout=300)
    failures = []
    for i, case in enumerate(cases):
        docs = case["docs"]
        if docs.shape[1] < S:  # ids given up to valid_len: padding rows carry the last document's id
            docs = torch.cat([docs, docs[:, -1:].expand(-1, S - docs.shape[1])], dim=1)
        pos = torch.arange(S)
        limit = case["valid_len"] if case["valid_len"] >= 0 else NO_LIMIT
        want = dense_reference(*full_inputs(seed=80 + i),
                               visible(pos, pos, docs, docs, causal=case["causal"], kv_limit=limit))
        what = f"{case['lb']} causal={case['causal']} docs {tuple(docs.shape)} valid_len={case['valid_len']}"
        for j, name in enumerate(("out", "lse", "dq", "dk", "dv")):
            shards = [res[i][j] if name != "lse" else res[i][j].unsqueeze(-1) for res in per_rank]
            got = assemble(shards, S, case["lb"])
            ref = want[j] if name != "lse" else want[j].unsqueeze(-1)
            if not (torch.isfinite(got).all() and rel_or_abs(got, ref) <= 1e-5):
                failures.append(f"{what} {name}: {rel_or_abs(got, ref):.3g}")
        for r, res in enumerate(per_rank):
            expected = launched_steps(case, r, 2, docs)
            if res[i][5] != {"fwd": expected, "bwd": expected}:
                failures.append(f"{what} rank {r}: steps launched {res[i][5]}, expected {expected} each way")
    assert not failures, "\n".join(failures)
    # The contiguous split on a document boundary runs only the diagonal steps (1 of 2 per rank).
    assert all(res[3][5] == {"fwd": 1, "bwd": 1} for res in per_rank)


# --------------------------------------------------------------------------- refusals


def _one_rank_spec(**kw):
    from cp_compile.group import CPGroup
    from cp_compile.ring.fused import ring_forward_fused

    q = torch.randn(1, 2, 32, 16)
    spec = SimpleNamespace(window=-1, attn_mask=None, **{"doc_ids": None, "mods": None, **kw})
    return lambda: ring_forward_fused(q, q[:, :1], q[:, :1], causal=True, scale=0.25,
                                      group=CPGroup(pg=None, rank=0, size=1), load_balance="zigzag", rotate="p2p",
                                      kernel=TritonKernel(T16), spec=spec)


def test_mods_and_malformed_doc_ids_are_refused_with_the_fix():
    mods = SimpleNamespace(mask_mod=lambda b, h, q, kv: torch.erf(q - kv) > 0, score_mod=None, mask_buffers=(),
                           score_buffers=())  # erf: outside the op set the Triton kernels translate (test_triton_mods)
    fix = r"mask_mod: aten.erf.default .*Fix: use kernel='aten' \(CPU\) or kernel='reference'"
    with pytest.raises(ValueError, match=fix):
        _one_rank_spec(mods=mods)()
    with pytest.raises(ValueError, match=r"doc_ids has shape \(1, 16\).*Fix"):
        _one_rank_spec(doc_ids=torch.zeros(1, 16, dtype=torch.int32))()
    with pytest.raises(ValueError, match="int32 or int64.*Fix"):
        _one_rank_spec(doc_ids=torch.zeros(1, 32))()
    with pytest.raises(ValueError, match="int32 range.*Fix"):
        _one_rank_spec(doc_ids=torch.full((1, 32), 2**40))()
    out, lse = _one_rank_spec(doc_ids=doc_ids([10, 22]).long())()  # a valid call, one rank, int64 ids
    assert out.shape == (1, 2, 32, 16) and torch.isfinite(lse).all()
    kern, pos = TritonKernel(T16), torch.arange(32, dtype=torch.int32)
    q = torch.randn(1, 2, 32, 16)
    with pytest.raises(ValueError, match="both the queries and the keys.*Fix"):
        kern.forward_step(q, q, q, kern.new_state(q), pos, pos, causal=True, scale=0.25, q_doc=pos[None])
    with pytest.raises(TypeError, match="int32.*Fix"):
        kern.forward_step(q, q, q, kern.new_state(q), pos, pos, causal=True, scale=0.25,
                          q_doc=pos[None].long(), k_doc=pos[None].long())


# --------------------------------------------------------------------------- the public API


def _rank_api(lb: str) -> tuple:
    import cp_compile

    q, k, v, dout = (cp_compile.shard(t, 2, load_balance=lb).float().requires_grad_() for t in full_inputs(seed=99))
    out = cp_compile.ring_attention(q, k, v, causal=True, kernel="triton", load_balance=lb, doc_ids=batch_docs())
    out.backward(dout.detach())
    same_doc = cp_compile.ring_attention(q.detach(), k.detach(), v.detach(), causal=True, kernel="triton",
                                         load_balance=lb, mask_mod=_same_document, mask_buffers=[batch_docs()])
    try:
        cp_compile.ring_attention(q, k, v, causal=True, kernel="triton", load_balance=lb,
                                  # no erf in Triton
                                  mask_mod=lambda b, h, q_idx, kv_idx: torch.erf(q_idx - kv_idx) > 0)
        refusal = "no error"
    except ValueError as e:
        refusal = str(e)
    return out.detach(), q.grad, k.grad, v.grad, refusal, (same_doc - out).abs().max().item()


def _same_document(b, h, q_idx, kv_idx, doc):
    return doc[b, q_idx] == doc[b, kv_idx]


@pytest.mark.slow
def test_ring_attention_api_with_doc_ids_on_triton(ranks):
    """``cp_compile.ring_attention(kernel="triton", doc_ids=...)`` with autograd, 2 ranks: exact vs fp64, and
    the same documents as a mask_mod reading the ids gives the same output;
    a mask_mod the Triton kernels cannot translate is refused on every rank, naming the op and the fix."""
    per_rank = ranks.run(2, _rank_api, "zigzag", timeout=300)
    pos = torch.arange(S)
    want = dense_reference(*full_inputs(seed=99), visible(pos, pos, batch_docs(), batch_docs(), causal=True))
    for j, name in zip((0, 1, 2, 3), ("out", "dq", "dk", "dv")):
        got = assemble([res[j] for res in per_rank], S, "zigzag")
        ref = want[0] if j == 0 else want[j + 1]
        assert rel_or_abs(got, ref) <= 1e-5, f"{name}: {rel_or_abs(got, ref):.3g}"
    for res in per_rank:
        assert res[5] <= 1e-6, res[5]
        assert "aten.erf" in res[4] and "Fix: use kernel='aten' (CPU) or kernel='reference'" in res[4], res[4]
