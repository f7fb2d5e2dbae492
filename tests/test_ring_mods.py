"""FlexAttention-style ``mask_mod`` / ``score_mod`` in the ring op, at global positions.

- mask_mods (causal, document reading a doc-id buffer, sliding window, prefix-LM) against
  fp64 SDPA with the equivalent dense mask; score_mods (ALiBi with per-head slopes as a
  buffer, logit soft-cap), alone and with a mask_mod, against a dense fp64 computation
  with the same score function: out, dq, dk, dv within fp32 1e-5 relative, 2 and 4
  ranks, several layouts, GQA.
- Rectangles a mask_mod masks wholly are never computed (kernel calls counted against
  a brute-force count from positions).
- A mask buffer that requires grad is refused with an error naming the fix (score buffers may
  learn: tests/test_ring_learned_bias.py); mods keys are
  the same for the same function and differ for different captured values.
"""

from __future__ import annotations

import pytest
import torch

import cp_compile
from cp_compile.ring.mods import lookup, register_mods
from cp_compile.sequence import rank_positions
from checks import (CAP, PREFIX, WINDOW, alibi_mod, alibi_slopes, assemble, causal_mod, document_mod, mods_doc_ids,
                    prefix_lm_mod, rel, softcap_mod, window_mod)

FP32 = 1e-5
S, D, H = 32, 16, 4


# --------------------------------------------------------------------------- the mods (FlexAttention style)


# --------------------------------------------------------------------------- dense fp64 reference


def _dense_mask(name: str, s: int) -> torch.Tensor:
    """(B|1, 1, S, S) bool of each mask_mod, built independently of the ring's evaluation."""
    q, k = torch.arange(s)[:, None], torch.arange(s)[None, :]
    if name == "document":
        ids = mods_doc_ids(s)
        return (ids[:, :, None] == ids[:, None, :]).unsqueeze(1)
    full = {"causal": q >= k, "window": (q >= k) & (q - k < WINDOW), "prefix_lm": (k < PREFIX) | (q >= k),
            "none": torch.ones(s, s, dtype=torch.bool)}[name]
    return full[None, None]


def _dense_scores(name: str, s64: torch.Tensor) -> torch.Tensor:
    s = s64.shape[-1]
    if name == "alibi":
        rel = (torch.arange(s)[None, :] - torch.arange(s)[:, None]).double()
        return s64 + alibi_slopes().double()[None, :, None, None] * rel
    if name == "softcap":
        return CAP * torch.tanh(s64 / CAP)
    return s64


def _reference(q, k, v, dout, mask_name, score_name, causal):
    """fp64 dense attention with the mask and score function: (out, dq, dk, dv)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = _dense_scores(score_name, q @ ke.transpose(-1, -2) * D ** -0.5)
    mask = _dense_mask(mask_name, S)
    if causal:
        mask = mask & torch.ones(S, S, dtype=torch.bool).tril()
    out = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ ve
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


# --------------------------------------------------------------------------- exactness


MODS = {"causal": causal_mod, "document": document_mod, "window": window_mod, "prefix_lm": prefix_lm_mod,
        "none": None, "alibi": alibi_mod, "softcap": softcap_mod}
CASES = [  # (mask_mod, score_mod, ring causal flag, layout, kernel, H_kv)
    ("causal", "none", False, "zigzag", "aten", 2),
    ("document", "none", False, "striped", "aten", 4),
    ("document", "none", True, "zigzag", "reference", 2),  # the mod ANDed with causal
    ("window", "none", False, "contiguous", "aten", 1),
    ("prefix_lm", "none", False, "zigzag", "aten", 2),
    ("none", "alibi", True, "zigzag", "aten", 2),
    ("none", "softcap", False, "striped", "aten", 1),
    ("document", "alibi", False, "contiguous", "aten", 2),
    ("prefix_lm", "softcap", False, "zigzag", "reference", 4),
]


def _inputs(hkv: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=torch.float64) for shape in
            ((2, H, S, D), (2, hkv, S, D), (2, hkv, S, D), (2, H, S, D))]


def _rank_mods(cases):
    res = []
    for i, (mname, sname, causal, lb, kernel, hkv) in enumerate(cases):
        q, k, v, dout = (cp_compile.shard(t, 2, load_balance=lb).float() for t in _inputs(hkv, 300 + i))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        kw = dict(mask_mod=MODS[mname], score_mod=MODS[sname])
        if mname == "document":
            kw["mask_buffers"] = [mods_doc_ids(S)]
        if sname == "alibi":
            kw["score_buffers"] = [alibi_slopes()]
        out = cp_compile.ring_attention(q, k, v, causal=causal, load_balance=lb, kernel=kernel, **kw)
        out.backward(dout)
        res.append((out.detach(), q.grad, k.grad, v.grad))
    return res


@pytest.mark.parametrize("world", [2, 4])
def test_mods_match_dense_fp64(ranks, world):
    per_rank = ranks.run(world, _rank_mods, CASES, timeout=300)
    failures = []
    for i, (mname, sname, causal, lb, kernel, hkv) in enumerate(CASES):
        ref = _reference(*_inputs(hkv, 300 + i), mname, sname, causal)
        for j, name in enumerate(("out", "dq", "dk", "dv")):
            got = assemble([res[i][j] for res in per_rank], S, lb)
            if not rel(got, ref[j]) <= FP32:
                failures.append(f"N={world} {mname}+{sname} causal={causal} {lb} {kernel} {name}: "
                                f"{rel(got, ref[j]):.3g}")
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.parametrize("hkv,causal,mask_name", [(2, True, "none"), (1, False, "document"), (4, False, "prefix_lm")])
def test_score_kernel_row_tiles_match_dense(monkeypatch, hkv: int, causal: bool, mask_name: str):
    """One process, rectangles cut into row tiles of a few rows (dK/dV accumulated in place over the
    tiles, the query heads of a K/V head summed by one batched matmul): equal to the dense fp64
    reference, for GQA (2 and 4 query heads per K/V head) and plain attention, batch 2."""
    from cp_compile.kernels import scores

    monkeypatch.setattr(scores, "TILE_ELEMENTS", 2 * H * S * 3)  # B·H·rows·Lk: about 3 rows a tile
    q, k, v, dout = _inputs(hkv, 40 + hkv)
    ql, kl, vl = (t.float().requires_grad_() for t in (q, k, v))
    kw = {"mask_mod": MODS[mask_name], "mask_buffers": [mods_doc_ids(S)] if mask_name == "document" else None}
    out = cp_compile.ring_attention(ql, kl, vl, causal=causal, score_mod=alibi_mod, score_buffers=[alibi_slopes()],
                                    **{k_: v_ for k_, v_ in kw.items() if v_ is not None})
    out.backward(dout.float())
    ref = _reference(q, k, v, dout, mask_name, "alibi", causal)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, ql.grad, kl.grad, vl.grad), ref):
        assert rel(got, want) <= FP32, (name, rel(got, want))


def _rank_padded(valid: int):
    """The op as the backend calls it on a padded sequence: ``valid_len`` and buffers of the unpadded length."""
    import torch.distributed as dist

    q, k, v, dout = _inputs(2, 7)
    dout[:, :, valid:] = 0.0  # padding rows carry no gradient
    q, k, v, dout = (cp_compile.shard(t, 2).float() for t in (q, k, v, dout))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    key = register_mods(mask_mod=document_mod, score_mod=alibi_mod)
    out, _ = torch.ops.cp_compile.ring_attention_fwd(
        q, k, v, True, D ** -0.5, dist.group.WORLD.group_name, "zigzag", "p2p", "aten", valid_len=valid, mods=key,
        mask_buffers=[mods_doc_ids(S)[:, :valid]], score_buffers=[alibi_slopes()])
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def test_padded_sequence_with_unpadded_buffers(ranks):
    """Mods reading buffers of the unpadded length never index past them (padding positions read as
    the last real one), and the real rows equal the dense reference with the padding keys masked."""
    valid = S - 6
    per_rank = ranks.run(2, _rank_padded, valid, timeout=120)
    q, k, v, dout = _inputs(2, 7)
    dout[:, :, valid:] = 0.0
    ref = _reference(q, k, v, dout, "document", "alibi", True)  # padding keys: after every real query
    for j, name in enumerate(("out", "dq", "dk", "dv")):
        got = assemble([res[j] for res in per_rank], S, "zigzag")
        got, want = (got[:, :, :valid], ref[j][:, :, :valid]) if j == 0 else (got, ref[j])
        assert rel(got, want) <= FP32, (name, rel(got, want))


# --------------------------------------------------------------------------- skipping


def _count_calls(window: int):
    from cp_compile.kernels import get_kernel

    kern = get_kernel("aten", torch.device("cpu"), torch.float32)
    calls, orig = [0], type(kern).forward

    def counting(self, *a, **kw):
        calls[0] += 1
        return orig(self, *a, **kw)

    def narrow(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    type(kern).forward = counting
    try:
        q, k, v, _ = (cp_compile.shard(t, 2).float() for t in _inputs(2, 1))
        cp_compile.ring_attention(q, k, v, mask_mod=narrow, kernel="aten")  # not causal: only the mod masks
    finally:
        type(kern).forward = orig
    return calls[0]


def test_wholly_masked_rectangles_are_skipped(ranks):
    world, window = 4, 3  # c = 8, zig-zag chunks of 4: most steps hold no pair within 3 positions
    got = ranks.run(world, _count_calls, window, timeout=120)
    q, k = torch.arange(S)[:, None], torch.arange(S)[None, :]
    band = (q >= k) & (q - k < window)
    for r in range(world):
        mine = rank_positions(S, world, r, "zigzag")
        want = sum(bool(band[mine][:, rank_positions(S, world, src, "zigzag")].any()) for src in range(world))
        assert got[r] == want < world, (r, got[r], want)


# --------------------------------------------------------------------------- misuse and keys


def _float_window_mod(b, h, q_idx, kv_idx, width):
    return (q_idx - kv_idx).abs() < width[0]


def test_learned_mask_buffer_is_refused():
    q, k, v, _ = (t.float() for t in _inputs(2, 2))
    width = torch.tensor([4.0], requires_grad=True)
    with pytest.raises(ValueError, match="mask_buffers tensor requires grad.*Fix: pass it .detach"):
        cp_compile.ring_attention(q, k, v, causal=True, mask_mod=_float_window_mod, mask_buffers=[width])
    with pytest.raises(ValueError, match="Fix"):
        cp_compile.ring_attention(q, k, v, causal=True, mask_buffers=[mods_doc_ids(S)])  # no mask_mod reads it


@pytest.mark.slow
def test_traced_ring_attention_is_one_graph_and_exact():
    """torch.compile(fullgraph=True) of ring_attention with doc_ids, a mask_mod and a score_mod (one
    process): the mods key is a trace-time constant, and the result equals eager and the reference."""
    q, k, v, dout = _inputs(2, 11)
    ql, kl, vl = (t.float().requires_grad_() for t in (q, k, v))
    ids = mods_doc_ids(S)

    def attend(q, k, v, ids, slopes):
        return cp_compile.ring_attention(q, k, v, doc_ids=ids, mask_mod=causal_mod, score_mod=alibi_mod,
                                         score_buffers=[slopes])

    out = torch.compile(attend, fullgraph=True, backend="aot_eager")(ql, kl, vl, ids, alibi_slopes())
    out.backward(dout.float())
    ref = _reference(q, k, v, dout, "document", "alibi", True)
    for got, want in zip((out, ql.grad, kl.grad, vl.grad), ref):
        assert rel(got, want) <= FP32


def _window_mod_of(w: int):
    def mod(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < w

    return mod


def test_mods_keys_are_deterministic():
    key = register_mods(mask_mod=causal_mod, score_mod=alibi_mod)
    assert key == register_mods(mask_mod=causal_mod, score_mod=alibi_mod)
    assert lookup(key).mask_mod is causal_mod and lookup(key).score_mod is alibi_mod
    assert register_mods(_window_mod_of(4)) != register_mods(_window_mod_of(5))  # captured values count
    assert register_mods(mask_mod=causal_mod) != register_mods(score_mod=causal_mod)
    assert register_mods() == ""
    with pytest.raises(ValueError, match="register_mods"):
        lookup("mods:unknown")


def _rank_key():
    return register_mods(mask_mod=document_mod, score_mod=softcap_mod)


def test_mods_keys_agree_across_processes(ranks):
    keys = ranks.run(2, _rank_key)
    assert keys[0] == keys[1] == _rank_key()


def _opcheck_with_mods():
    """opcheck (schema, fake, autograd registration, AOT dispatch) with every new argument given."""
    import torch.distributed as dist

    name = dist.group.WORLD.group_name
    q, k, v, _ = (cp_compile.shard(t, 2).float().requires_grad_() for t in _inputs(2, 3))
    key = register_mods(mask_mod=document_mod, score_mod=alibi_mod)
    doc = mods_doc_ids(S)
    args = (q, k, v, False, 0.25, name, "zigzag", "p2p", "aten")
    kwargs = dict(doc_ids=doc.int(), mods=key, mask_buffers=[doc], score_buffers=[alibi_slopes()])
    tests = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    res = torch.library.opcheck(torch.ops.cp_compile.ring_attention_fwd.default, args, kwargs, test_utils=tests)
    return {t: str(r) for t, r in res.items() if r != "SUCCESS"}


@pytest.mark.slow
def test_ring_op_with_mods_passes_opcheck(ranks):
    for rank, failures in enumerate(ranks.run(2, _opcheck_with_mods, timeout=300)):
        assert failures == {}, f"rank {rank}: {failures}"
