"""A layout computed per batch: the ring op and the public helpers with ``positions=table`` (issue 16, item 3).

- The position-driven plan (:func:`cp_compile.ring.plan.table_segments`) equals
  ``step_segments`` on the zigzag / striped / contiguous tables, and on random sorted
  partitions its rectangles cover exactly the causally visible pairs, each once (pure).
- Exactness on 2 and 4 gloo ranks, fp32 <= 1e-5 relative vs fp64 SDPA on the full sequence
  with the equivalent dense mask, out / dq / dk / dv: causal with the document-aware table
  (``layout_table`` of log-normal document lengths) and ``doc_ids``; causal with a random
  sorted partition and no documents; non-causal; padding (``valid_len``); a sliding window;
  a ``mask_mod``; B = 2 rows packed differently with a table from the union of their
  boundaries; kernels aten and reference; Triton (interpreter) at S = 64 on 2 ranks.
- The balance is real: the aten kernel calls of a causal document ring (counted with their
  shapes) compute exactly the visible pairs, per rank, and busiest / idlest <= 1.05 with the
  table against > 2 with global zig-zag on the same packing.
- ``shard`` / ``unshard`` / ``positions`` with a table; misuse (malformed tables, ranks that
  pass different tables) refused with errors naming the fix.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cp_compile
from cp_compile.document_layout import imbalance, layout_table, rank_work, zigzag_layout
from cp_compile.ring.plan import segment_pairs, step_segments, table_segments
from cp_compile.sequence import check_table, rank_positions
from checks import attention_inputs, dead_rows, dense_mask, doc_ids, masked_sdpa_reference, rel

FP32 = 1e-5


def lognormal_lengths(s: int, seed: int) -> list:
    """Document lengths ~ log-normal (median ~12 tokens), summing to ``s``."""
    g, out = torch.Generator().manual_seed(seed), []
    while sum(out) < s:
        out.append(max(1, int(torch.empty(1).log_normal_(2.5, 0.9, generator=g))))
    out[-1] -= sum(out) - s
    return [n for n in out if n > 0]


def random_table(s: int, n: int, seed: int) -> torch.Tensor:
    """(N, S/N) int64: a random partition of range(S), each row sorted."""
    perm = torch.randperm(s, generator=torch.Generator().manual_seed(seed))
    return perm.view(n, s // n).sort(dim=1).values


def _assemble(shards, table):
    """Full (B, H, S, D) float64 from every rank's shard, placed by the table's rows."""
    b, h, _, d = shards[0].shape
    full = torch.full((b, h, table.numel(), d), float("nan"), dtype=torch.float64)
    for r, x in enumerate(shards):
        full[:, :, table[r]] = x.double()
    assert not full.isnan().any()
    return full


# --------------------------------------------------------------------------- the plan (pure)


def test_table_plan_equals_the_fixed_layouts():
    for lb in ("zigzag", "striped", "contiguous"):
        for n, c in ((1, 4), (2, 8), (3, 6), (4, 4), (8, 2)):
            for causal in (True, False):
                for r in range(n):
                    for src in range(n):
                        for valid in (None, c // 2, 0):
                            want = step_segments(lb, causal, n, r, src, c, valid)
                            got = table_segments(causal, r, src, rank_positions(n * c, n, r, lb),
                                                 rank_positions(n * c, n, src, lb), valid)
                            assert got == want, (lb, n, c, causal, r, src, valid, got, want)


@pytest.mark.slow
def test_table_plan_covers_exactly_the_visible_pairs():
    for seed in range(20):
        n, c = (2, 4, 3)[seed % 3], (5, 8, 16)[seed % 3]
        table = random_table(n * c, n, seed)
        for r in range(n):
            for src in range(n):
                cover = torch.zeros(c, c, dtype=torch.int64)
                segs = table_segments(True, r, src, table[r], table[src])
                for seg in segs:
                    block = torch.ones(len(range(c)[seg.q]), len(range(c)[seg.k]), dtype=torch.int64)
                    cover[seg.q, seg.k] += block.tril() if seg.causal else block
                visible = (table[src][None, :] <= table[r][:, None]).long()  # (c, c) by position
                assert torch.equal(cover, visible), (seed, r, src, segs)
                assert sum(segment_pairs(s, c) for s in segs) == int(visible.sum())


def test_check_table_names_the_fix():
    good = random_table(16, 2, 0)
    assert torch.equal(check_table(good, 2, 16), good)
    bad = [(good.int(), "int64"), (good[0], "shape"), (good.view(4, 4), "shape"), (good.flip(1), "sorted"),
           (torch.tensor([[0, 1, 2, 3], [3, 5, 6, 7]]), "partition"), (torch.tensor([[0, 1], [2, 9]]), "partition")]
    for table, what in bad:
        with pytest.raises(ValueError, match="Fix") as e:
            check_table(table, 2)
        assert what in str(e.value), (what, str(e.value))
    with pytest.raises(ValueError, match="tokens but the sequence has 32"):
        check_table(good, 2, 32)
    assert "union of the rows' document boundaries" in str(pytest.raises(ValueError, check_table, good, 3).value)


# --------------------------------------------------------------------------- exactness on ranks


def _mask_mod(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & ((q_idx - kv_idx) % 5 != 2)  # causal with holes: a mod the plan cannot see


def _cases(world):
    s = 32 * world  # S = 64 (N = 2) or 128 (N = 4)
    lens = lognormal_lengths(s, 0)
    rows = [lens, lognormal_lengths(s, 1)]  # B = 2, packed differently
    ids2 = doc_ids(rows, s)
    return [
        dict(name="docs aten", causal=True, kernel="aten", table=layout_table(lens, world), lens=[lens], hkv=2),
        dict(name="docs reference", causal=True, kernel="reference", table=layout_table(lens, world), lens=[lens],
             hkv=1),
        dict(name="random causal", causal=True, kernel="aten", table=random_table(s, world, 1), hkv=4),
        dict(name="random causal ref", causal=True, kernel="reference", table=random_table(s, world, 2), hkv=2),
        dict(name="random docs", causal=True, kernel="aten", table=random_table(s, world, 6), lens=[lens], hkv=2),
        dict(name="non-causal", causal=False, kernel="aten", table=random_table(s, world, 3), hkv=2),
        dict(name="non-causal docs", causal=False, kernel="aten", table=layout_table(lens, world), lens=[lens], hkv=2),
        dict(name="padding docs", causal=True, kernel="aten", table=layout_table(lens, world), lens=[lens], hkv=2,
             valid=s - 6),
        dict(name="padding non-causal", causal=False, kernel="reference", table=random_table(s, world, 4), hkv=2,
             valid=s - 9),
        dict(name="window", causal=True, kernel="aten", table=random_table(s, world, 5), hkv=2, window=7),
        dict(name="mask_mod", causal=False, kernel="aten", table=layout_table(lens, world), lens=[lens], hkv=2,
             mod=True),
        dict(name="B=2 union", causal=True, kernel="aten", table=layout_table(ids2, world), lens=rows, hkv=2),
    ]


def _case_mask(c, s):
    """(dense bool mask (B|1, 1, S, S), real query rows (2, S)) of a case."""
    valid = c.get("valid", -1)
    if "lens" in c:
        mask = dense_mask(doc_ids(c["lens"], s), s, c["causal"], valid)
    else:
        mask = torch.ones(1, 1, s, s, dtype=torch.bool)
        mask = mask.tril() if c["causal"] else mask
        if valid >= 0:
            mask = mask & (torch.arange(s) < valid)
    if "window" in c:
        i = torch.arange(s)
        mask = mask & ((i[:, None] - i[None, :]) < c["window"])
    if c.get("mod"):
        i = torch.arange(s)
        mask = mask & _mask_mod(0, 0, i[:, None], i[None, :])
    return mask, (torch.arange(s) < (valid if valid >= 0 else s))[None].expand(2, s)


def _rank_cases(cases, s):

    res = []
    for i, c in enumerate(cases):
        q, k, v, dout = attention_inputs(2, 4, c["hkv"], s, s, 16, seed=300 + i)
        dout = dout.masked_fill(dead_rows(*_case_mask(c, s)), 0.0)  # padding / dead rows carry no gradient
        table = c["table"]
        ql, kl, vl, dl = (cp_compile.shard(t, 2, positions=table).float().contiguous() for t in (q, k, v, dout))
        ql, kl, vl = (t.requires_grad_() for t in (ql, kl, vl))
        docs = doc_ids(c["lens"], s) if "lens" in c else None
        if "valid" in c:  # padding is an op argument (the backend's), not a public one
            out, _ = torch.ops.cp_compile.ring_attention_fwd(
                ql, kl, vl, c["causal"], 0.25, dist.group.WORLD.group_name, "zigzag", "p2p", c["kernel"],
                valid_len=c["valid"], doc_ids=docs, positions=table)
        else:
            out = cp_compile.ring_attention(ql, kl, vl, causal=c["causal"], scale=0.25, kernel=c["kernel"],
                                            doc_ids=docs, positions=table, window=c.get("window"),
                                            mask_mod=_mask_mod if c.get("mod") else None)
        out.backward(dl)
        res.append((out.detach(), ql.grad, kl.grad, vl.grad))
    return res


def _compare(cases, per_rank, s, world):
    failures = []
    for i, c in enumerate(cases):
        q, k, v, dout = attention_inputs(2, 4, c["hkv"], s, s, 16, seed=300 + i)
        ref, dead = masked_sdpa_reference(q, k, v, dout, *_case_mask(c, s))  # SDPA's scale 1/sqrt(16) = the ring's 0.25
        for j, name in enumerate(("out", "dq", "dk", "dv")):
            got = _assemble([res[i][j] for res in per_rank], c["table"])
            if j == 0:
                got = got.masked_fill(dead, 0.0)  # padding rows: whatever the ring computes there is unused
            if not (torch.isfinite(got).all() and rel(got, ref[j]) <= FP32):
                failures.append(f"N={world} {c['name']} {name}: {rel(got, ref[j]):.3g}")
    return failures


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_table_layout_matches_sdpa(ranks, world):
    s, cases = 32 * world, _cases(world)
    per_rank = ranks.run(world, _rank_cases, cases, s, timeout=300)
    failures = _compare(cases, per_rank, s, world)
    assert not failures, "\n".join(failures)


def _rank_triton(table, lens, s):
    q, k, v, dout = attention_inputs(2, 4, 2, s, s, 16, seed=77)
    ql, kl, vl, dl = (cp_compile.shard(t, 2, positions=table).float().contiguous() for t in (q, k, v, dout))
    ql, kl, vl = (t.requires_grad_() for t in (ql, kl, vl))
    out = cp_compile.ring_attention(ql, kl, vl, causal=True, kernel="triton", doc_ids=doc_ids([lens], s),
                                    positions=table)
    out.backward(dl)
    return out.detach(), ql.grad, kl.grad, vl.grad


@pytest.mark.slow
def test_table_layout_on_triton(ranks):
    s, lens = 64, lognormal_lengths(64, 2)
    table = layout_table(lens, 2)
    per_rank = ranks.run(2, _rank_triton, table, lens, s, timeout=300)
    q, k, v, dout = attention_inputs(2, 4, 2, s, s, 16, seed=77)
    mask = dense_mask(doc_ids([lens], s), s, True)
    ref, _ = masked_sdpa_reference(q, k, v, dout, mask, torch.ones(2, s, dtype=torch.bool))
    for j, name in enumerate(("out", "dq", "dk", "dv")):
        got = _assemble([res[j] for res in per_rank], table)
        assert rel(got, ref[j]) <= FP32, f"{name}: {rel(got, ref[j]):.3g}"


# --------------------------------------------------------------------------- balance is real


def _count_pairs(lens, s, use_table):
    """Pairs computed by the aten kernel calls of one causal document ring call on this rank."""
    from cp_compile.kernels import get_kernel

    kern = get_kernel("aten", torch.device("cpu"), torch.float32)
    pairs, orig = [0, 0], type(kern).forward

    def counting(self, q, k, v, *, causal, scale, mask=None):
        lq, lk = q.shape[2], k.shape[2]
        pairs[0] += q.shape[0] * (lq * (lq + 1) // 2 if causal else lq * lk)
        pairs[1] += mask is not None
        return orig(self, q, k, v, causal=causal, scale=scale, mask=mask)

    table = layout_table(lens, dist.get_world_size()) if use_table else None
    kw = dict(positions=table) if use_table else dict(load_balance="zigzag")
    type(kern).forward = counting
    try:
        q, k, v, _ = (cp_compile.shard(t, 2, **kw).float() for t in attention_inputs(1, 2, 2, s, s, 8, seed=1))
        cp_compile.ring_attention(q, k, v, causal=True, doc_ids=doc_ids([lens], s), kernel="aten", **kw)
    finally:
        type(kern).forward = orig
    return pairs


def test_table_balance_is_real(ranks):
    world, s = 4, 128
    lens = lognormal_lengths(s, 0)
    with_table = ranks.run(world, _count_pairs, lens, s, True, timeout=300)
    zigzag = ranks.run(world, _count_pairs, lens, s, False, timeout=300)
    assert not any(masked for _, masked in with_table + zigzag), "the document path built a mask tensor"
    assert [p for p, _ in with_table] == rank_work(lens, list(layout_table(lens, world)))  # visible pairs, once
    assert [p for p, _ in zigzag] == rank_work(lens, zigzag_layout(s, world))
    assert imbalance([p for p, _ in with_table]) <= 1.05 < 2.0 < imbalance([p for p, _ in zigzag])


# --------------------------------------------------------------------------- helpers and misuse


def _rank_helpers(table):
    s = table.numel()
    x = torch.randn(2, s, 3, generator=torch.Generator().manual_seed(0))
    local = cp_compile.shard(x, 1, positions=table)
    pos = cp_compile.positions(s, positions=table)
    back = cp_compile.unshard(local, 1, positions=table)
    return torch.equal(local, x[:, table[dist.get_rank()]]), torch.equal(pos, table[dist.get_rank()]), \
        torch.equal(back, x)


def _rank_misuse(s):
    q = k = v = torch.randn(1, 2, s // 2, 8)
    msgs = []
    mine = random_table(s, 2, dist.get_rank())  # a different (valid) table on each rank
    for kw in (dict(positions=mine), dict(positions=random_table(s, 2, 0).flip(1)),
               dict(positions=random_table(2 * s, 2, 0))):
        try:
            cp_compile.ring_attention(q, k, v, causal=True, **kw)
            msgs.append(None)
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def test_helpers_and_misuse(ranks):
    table = layout_table(lognormal_lengths(64, 3), 2)
    for res in ranks.run(2, _rank_helpers, table, timeout=120):
        assert res == (True, True, True)
    for msgs in ranks.run(2, _rank_misuse, 32, timeout=120):
        assert all(m is not None and "Fix" in m for m in msgs), msgs
        assert "positions table" in msgs[0] and "sorted" in msgs[1] and "sequence has 32" in msgs[2], msgs


def _opcheck_with_table():
    """opcheck (schema, fake, autograd registration, AOT dispatch) with ``positions`` alone and with documents."""
    name, s = dist.group.WORLD.group_name, 32
    lens = lognormal_lengths(s, 4)
    table = layout_table(lens, 2)
    full = attention_inputs(2, 4, 2, s, s, 8, seed=5)
    q, k, v, _ = (cp_compile.shard(t, 2, positions=table).float().requires_grad_() for t in full)
    tests = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    failures = {}
    for kwargs in (dict(positions=table), dict(doc_ids=doc_ids([lens], s), positions=table, valid_len=s - 3)):
        args = (q, k, v, True, 0.25, name, "zigzag", "p2p", "aten")
        res = torch.library.opcheck(torch.ops.cp_compile.ring_attention_fwd.default, args, kwargs, test_utils=tests)
        failures.update({f"{sorted(kwargs)} {t}": str(r) for t, r in res.items() if r != "SUCCESS"})
    return failures


@pytest.mark.slow
def test_ring_op_with_table_passes_opcheck(ranks):
    for rank, failures in enumerate(ranks.run(2, _opcheck_with_table, timeout=300)):
        assert failures == {}, f"rank {rank}: {failures}"


def _rank_compiled(tables, lens, s):
    """ring_attention(positions=table) under torch.compile (aot_eager): the table is a runtime input, so a
    second table of the same shape reuses the compiled graph; both exact."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    @torch.compile(backend=counter, fullgraph=True)
    def attend(q, k, v, doc_ids, table):
        return cp_compile.ring_attention(q, k, v, causal=True, doc_ids=doc_ids, positions=table, kernel="aten")

    outs = []
    for table in tables:
        full = attention_inputs(1, 2, 2, s, s, 8, seed=9)
        q, k, v, _ = (cp_compile.shard(t, 2, positions=table).float() for t in full)
        outs.append(attend(q, k, v, doc_ids([lens], s), table))
    return outs, counter.frame_count


def test_table_under_torch_compile(ranks):
    s, lens = 64, lognormal_lengths(64, 5)
    tables = [layout_table(lens, 2), random_table(s, 2, 7)]
    per_rank = ranks.run(2, _rank_compiled, tables, lens, s, timeout=300)
    q, k, v, dout = attention_inputs(1, 2, 2, s, s, 8, seed=9)
    mask = dense_mask(doc_ids([lens], s), s, True)
    ref, _ = masked_sdpa_reference(q, k, v, dout, mask, torch.ones(1, s, dtype=torch.bool))
    for i, table in enumerate(tables):
        got = _assemble([res[0][i] for res in per_rank], table)
        assert rel(got, ref[0]) <= FP32, (i, rel(got, ref[0]))
    assert all(res[1] == 1 for res in per_rank), [res[1] for res in per_rank]  # one graph for both tables
