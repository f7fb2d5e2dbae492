"""Packed documents in the ring op (``doc_ids``), against fp64 SDPA with the dense document mask.

- ``doc_ids`` with causal and non-causal attention, every layout, 2 and 4 ranks, kernels
  aten and reference, GQA: out, dq, dk, dv within fp32 1e-5 relative of fp64 SDPA on the
  full sequence with ``doc[q] == doc[kv]`` (& ``kv <= q``); batch rows with different
  document counts, a document shorter than one rank's chunk and one longer than the whole
  chunk, ``(1, S)`` ids broadcast over the batch, padding (``valid_len``), and documents
  with an explicit key-padding ``attn_mask``.
- Pairs in different documents are never computed: every kernel call is counted with its
  shape and gets no mask tensor, the pairs they compute add up to exactly the visible
  pairs, and on the contiguous layout the number of calls equals a brute-force count of
  the document sub-rectangles.
- ``doc_ids_from_cu_seqlens`` / ``doc_ids_from_position_ids``, one-process exactness, and
  misuse (float ids, sharded ids, ranks that disagree) refused with errors naming the fix.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cp_compile
from cp_compile.ring.masking import additive_mask
from cp_compile.sequence import rank_positions
from checks import assemble, attention_inputs, dead_rows, dense_mask, doc_ids, masked_sdpa_reference, refusals, rel

FP32 = 1e-5


def _cases(world):
    s = 16 * world  # c = 16: a 3-token document is shorter than a chunk, one of S/2 + 4 longer than c
    lens = [[3, s // 2 + 4, 5, s // 2 - 12], [s - 11, 11]]  # B = 2: 4 documents in row 0, 2 in row 1
    return [
        dict(lb="zigzag", causal=True, kernel="aten", lens=lens, hkv=2),
        dict(lb="striped", causal=True, kernel="aten", lens=lens, hkv=4),
        dict(lb="contiguous", causal=True, kernel="reference", lens=lens, hkv=1),
        dict(lb="zigzag", causal=False, kernel="aten", lens=lens, hkv=2),
        dict(lb="striped", causal=False, kernel="reference", lens=[[5, 7, s - 12]], hkv=2),  # (1, S) broadcast
        dict(lb="zigzag", causal=True, kernel="aten", lens=[[s // 2 - 3, 6, s // 2 - 3]], hkv=2),  # spans the fold
        dict(lb="zigzag", causal=True, kernel="aten", lens=lens, hkv=2, valid=s - 6),  # padding at the end
        dict(lb="striped", causal=True, kernel="aten", lens=lens, hkv=2, valid=s - 6, short=True),  # ids (B, S - 6)
        dict(lb="contiguous", causal=False, kernel="aten", lens=lens, hkv=2, valid=s - 9),
        dict(lb="zigzag", causal=False, kernel="aten", lens=lens, hkv=2, keep=True),  # + key-padding attn_mask
        dict(lb="striped", causal=True, kernel="aten", lens=lens, hkv=2, keep=True),
    ]


def _keep(s):
    keep = torch.ones(2, 1, 1, s, dtype=torch.bool)
    keep[0, ..., 4:6] = False
    keep[1, ..., s - 5:] = False
    return keep


def _case_mask(c, ids, s):
    """(dense mask (B|1, 1, S, S), real query rows (B, S)) of a case."""
    mask = dense_mask(ids, s, c["causal"], c.get("valid", -1), _keep(s) if c.get("keep") else None)
    return mask, (torch.arange(s) < c.get("valid", s))[None].expand(2, s)


def _rank_docs(cases, s):
    res = []
    group = dist.group.WORLD.group_name
    for i, c in enumerate(cases):
        q, k, v, dout = attention_inputs(2, 4, c["hkv"], s, s, 16, seed=200 + i)
        ids = doc_ids(c["lens"], s)
        dout = dout.masked_fill(dead_rows(*_case_mask(c, ids, s)), 0.0)  # padding / dead rows carry no gradient
        ql, kl, vl, dl = (cp_compile.shard(t, 2, load_balance=c["lb"]).float().contiguous() for t in (q, k, v, dout))
        ql, kl, vl = (t.requires_grad_() for t in (ql, kl, vl))
        keep = additive_mask(_keep(s)) if c.get("keep") else None
        out, _ = torch.ops.cp_compile.ring_attention_fwd(
            ql, kl, vl, c["causal"], 0.25, group, c["lb"], "p2p", c["kernel"], valid_len=c.get("valid", -1),
            attn_mask=keep, doc_ids=ids[:, :c["valid"]] if c.get("short") else ids.int() if i % 2 else ids)
        out.backward(dl)
        res.append((out.detach(), ql.grad, kl.grad, vl.grad))
    return res


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_documents_match_sdpa(ranks, world):
    s, cases = 16 * world, _cases(world)
    per_rank = ranks.run(world, _rank_docs, cases, s, timeout=300)
    failures = []
    for i, c in enumerate(cases):
        q, k, v, dout = attention_inputs(2, 4, c["hkv"], s, s, 16, seed=200 + i)
        ref, dead = masked_sdpa_reference(q, k, v, dout, *_case_mask(c, doc_ids(c["lens"], s), s))
        for j, name in enumerate(("out", "dq", "dk", "dv")):
            got = assemble([res[i][j] for res in per_rank], s, c["lb"])
            if j == 0:
                got = got.masked_fill(dead, 0.0)  # padding rows: whatever the ring computes there is unused
            if not (torch.isfinite(got).all() and rel(got, ref[j]) <= FP32):
                failures.append(f"N={world} case {i} {c['lb']} causal={c['causal']} {name}: {rel(got, ref[j]):.3g}")
    assert not failures, "\n".join(failures)


# --------------------------------------------------------------------------- counting


def _count_calls(lb, lens, s):
    """Every forward kernel call of one causal ring call with documents: (batch, Lq, Lk, causal, masked)."""
    from cp_compile.kernels import get_kernel

    kern = get_kernel("aten", torch.device("cpu"), torch.float32)
    calls, orig = [], type(kern).forward

    def counting(self, q, k, v, *, causal, scale, mask=None):
        calls.append((q.shape[0], q.shape[2], k.shape[2], causal, mask is not None))
        return orig(self, q, k, v, causal=causal, scale=scale, mask=mask)

    type(kern).forward = counting
    try:
        full = attention_inputs(2, 2, 2, s, s, 16, seed=1)
        q, k, v, _ = (cp_compile.shard(t, 2, load_balance=lb).float() for t in full)
        cp_compile.ring_attention(q, k, v, causal=True, doc_ids=doc_ids(lens, s), kernel="aten", load_balance=lb)
    finally:
        type(kern).forward = orig
    return calls


def _runs(ids, pos):
    """Maximal runs of equal document along the (increasing) positions ``pos``: [(doc, [positions])]."""
    out = []
    for p in pos.tolist():
        if out and out[-1][0] == int(ids[p]):
            out[-1][1].append(p)
        else:
            out.append((int(ids[p]), [p]))
    return out


def _brute_force(ids, world, rank, lb):
    """(visible pairs, document sub-rectangles with a visible pair) of ``rank``'s queries, by brute force."""
    s = ids.shape[1]
    mine = rank_positions(s, world, rank, lb)
    pairs = rects = 0
    for row in ids:
        pairs += sum(int(((row[:q + 1] == row[q])).sum()) for q in mine.tolist())
        for src in range(world):
            for dq, qs in _runs(row, mine):
                for dk, ks in _runs(row, rank_positions(s, world, src, lb)):
                    rects += dq == dk and min(ks) <= max(qs)
    return pairs, rects


@pytest.mark.parametrize("lb", ["contiguous", "zigzag", "striped"])
def test_pairs_across_documents_are_never_computed(ranks, lb):
    world, s = 4, 64
    lens = [[3, 40, 5, 16], [53, 11]]
    per_rank = ranks.run(world, _count_calls, lb, lens, s, timeout=300)
    ids = doc_ids(lens, s)
    for r, calls in enumerate(per_rank):
        assert calls and not any(masked for *_, masked in calls), "the document path built a mask tensor"
        computed = sum(b * (lq * (lq + 1) // 2 if causal else lq * lk) for b, lq, lk, causal, _ in calls)
        pairs, rects = _brute_force(ids, world, r, lb)
        assert computed == pairs, (lb, r, computed, pairs)  # every visible pair once, nothing else
        if lb == "contiguous":
            assert len(calls) == rects, (r, len(calls), rects)


# --------------------------------------------------------------------------- helpers and misuse


def test_doc_id_helpers():
    ids = cp_compile.doc_ids_from_cu_seqlens(torch.tensor([0, 3, 7, 8], dtype=torch.int32), 10)
    assert ids.dtype == torch.int32 and ids.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2, 3, 3]]  # tail: padding doc
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [5, 6, 7, 8, 9, 10, 0, 1, 2]])
    ids = cp_compile.doc_ids_from_position_ids(pos)
    assert ids.dtype == torch.int32 and ids.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 0, 0, 0, 0, 0, 1, 1, 1]]
    assert cp_compile.doc_ids_from_position_ids(torch.arange(4)).tolist() == [[0, 0, 0, 0]]
    for bad in (lambda: cp_compile.doc_ids_from_cu_seqlens(torch.tensor([1, 4]), 4),
                lambda: cp_compile.doc_ids_from_cu_seqlens(torch.tensor([0, 5, 3]), 8),
                lambda: cp_compile.doc_ids_from_cu_seqlens(torch.tensor([0.0, 4.0]), 4),
                lambda: cp_compile.doc_ids_from_position_ids(torch.zeros(2, 3))):
        with pytest.raises(ValueError, match="Fix"):
            bad()


def test_one_process_is_exact():
    """No process group: the ring op still runs (not plain SDPA) and applies the documents."""
    s = 24
    q, k, v, dout = attention_inputs(2, 4, 2, s, s, 16, seed=5)
    ids = doc_ids([[5, 12, 7], [20, 4]], s)
    ql, kl, vl = (t.float().requires_grad_() for t in (q, k, v))
    out = cp_compile.ring_attention(ql, kl, vl, causal=True, doc_ids=ids)
    out.backward(dout.float())
    ref, _ = masked_sdpa_reference(q, k, v, dout, dense_mask(ids, s, True), torch.ones(2, s, dtype=torch.bool))
    for got, want in zip((out, ql.grad, kl.grad, vl.grad), ref):
        assert rel(got, want) <= FP32


def _rank_misuse():
    s = 16
    q = k = v = cp_compile.shard(torch.randn(2, 2, s, 8), 2)
    ids = doc_ids([[5, 11]], s)
    # the last call: rank 0 broadcasts one row of ids, rank 1 passes one per batch row: every rank must refuse
    bad = ids if dist.get_rank() == 0 else ids.expand(2, s)
    return refusals(q, k, v, [dict(causal=True, doc_ids=d) for d in (
        ids.float(), cp_compile.shard(ids, 1), doc_ids([[5, 11]] * 3, s),
        torch.zeros(1, s, dtype=torch.int64, device="meta"), bad)])


def test_doc_ids_misuse_names_the_fix(ranks):
    for msgs in ranks.run(2, _rank_misuse, timeout=120):
        assert all(m is not None and "Fix" in m for m in msgs), msgs
        assert "int32 or int64" in msgs[0] and "unsharded" in msgs[1] and "unsharded" in msgs[2]
        assert "device" in msgs[3] and "doc_ids shape" in msgs[4]
