"""``ring_attention`` with a sliding window or an explicit ``attn_mask``, against SDPA.

- ``window=W`` (causal): every layout, 2 and 4 ranks, kernels aten / reference / triton,
  against fp64 SDPA on the full sequence with the band mask ``0 <= i - j < W``: fp32
  <= 1e-5 relative for out, dq, dk, dv; ring steps wholly outside the window are not
  computed (kernel calls counted, against a brute-force count from positions).
- ``attn_mask`` (bool and additive, incl. Hugging Face's finfo.min style), each rank
  passing its rows (``cp_compile.shard(mask, dim=-2)``): same tolerance.
- Misuse (window without causal, mask with causal, wrong mask shape, Triton with an
  explicit mask) is refused with errors that name the fix.
"""

from __future__ import annotations

from itertools import product

import pytest
import torch
import torch.nn.functional as F

import cp_compile
from cp_compile.sequence import rank_positions
from checks import assemble, attention_inputs, refusals, rel

FP32 = 1e-5


def _sdpa64(q, k, v, dout, mask):
    """fp64 SDPA with a bool (S, S)/(B, H, S, S) mask: (out, dq, dk, dv)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def band(s: int, window: int) -> torch.Tensor:
    i = torch.arange(s)
    d = i[:, None] - i[None, :]
    return (d >= 0) & (d < window)  # (S, S)


def _rank_ring(q, k, v, dout, lb, kernel, kw, mask_full=None):
    ql, kl, vl, dl = (cp_compile.shard(t, 2, load_balance=lb).float() for t in (q, k, v, dout))
    ql, kl, vl = (t.requires_grad_() for t in (ql, kl, vl))
    if mask_full is not None:  # this rank's query rows; a mask the same for every query goes whole
        rows = mask_full if mask_full.shape[-2] == 1 else cp_compile.shard(mask_full, -2, load_balance=lb)
        kw = dict(kw, attn_mask=rows)
    out = cp_compile.ring_attention(ql, kl, vl, load_balance=lb, kernel=kernel, **kw)
    out.backward(dl)
    return out.detach(), ql.grad, kl.grad, vl.grad


def _window_cases(world: int):
    cases = []
    for i, (lb, kernel) in enumerate(product(("zigzag", "striped", "contiguous"), ("aten", "reference", "triton"))):
        if kernel == "reference" and i % 2:
            continue
        cases.append(dict(lb=lb, kernel=kernel, s=16 * world, window=(3, 8, 13)[i % 3], seed=40 + i,
                          hkv=(4, 2, 1)[i % 3]))
    return cases


def _rank_window_cases(cases):
    return [_rank_ring(*attention_inputs(1, 4, c["hkv"], c["s"], c["s"], 16, seed=c["seed"]), c["lb"], c["kernel"],
                       dict(causal=True, window=c["window"])) for c in cases]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_sliding_window_matches_sdpa(ranks, world):
    cases = _window_cases(world)
    per_rank = ranks.run(world, _rank_window_cases, cases, timeout=300)
    failures = []
    for i, c in enumerate(cases):
        q, k, v, dout = attention_inputs(1, 4, c["hkv"], c["s"], c["s"], 16, seed=c["seed"])
        ref = _sdpa64(q, k, v, dout, band(c["s"], c["window"]))
        for j, name in enumerate(("out", "dq", "dk", "dv")):
            got = assemble([res[i][j] for res in per_rank], c["s"], c["lb"])
            if not rel(got, ref[j]) <= FP32:
                failures.append(f"N={world} {c} {name}: {rel(got, ref[j]):.3g}")
    assert not failures, "\n".join(failures)


def _count_steps(kernel: str, s: int, window: int) -> int:
    """Kernel calls (forward) of one windowed ring call on this rank."""
    from cp_compile.kernels import get_kernel

    kern = get_kernel(kernel, torch.device("cpu"), torch.float32)
    name = "forward_step" if kernel == "triton" else "forward"
    calls, orig = [0], getattr(type(kern), name)

    def counting(self, *a, **kw):
        calls[0] += 1
        return orig(self, *a, **kw)

    setattr(type(kern), name, counting)
    try:
        q, k, v, _ = (cp_compile.shard(t, 2).float() for t in attention_inputs(1, 2, 2, s, s, 16, seed=1))
        cp_compile.ring_attention(q, k, v, causal=True, window=window, kernel=kernel)
    finally:
        setattr(type(kern), name, orig)
    return calls[0]


@pytest.mark.parametrize("kernel", ["aten", "triton"])
def test_steps_outside_the_window_are_skipped(ranks, kernel):
    world, s, window = 4, 64, 4  # c = 16, zig-zag chunks of 8: most steps see no key in the window
    got = ranks.run(world, _count_steps, kernel, s, window, timeout=300)
    for r in range(world):
        q_pos = rank_positions(s, world, r, "zigzag")
        want = sum(bool(band(s, window)[q_pos][:, rank_positions(s, world, src, "zigzag")].any())
                   for src in range(world))
        assert got[r] == want < world, (r, got[r], want)


def _mask_cases():
    g = torch.Generator().manual_seed(9)
    s = 32
    rand = torch.rand(2, 1, s, s, generator=g) < 0.6
    rand |= torch.eye(s, dtype=torch.bool)  # every row sees at least its own key
    keypad = torch.ones(2, 1, 1, s, dtype=torch.bool)
    keypad[1, ..., 20:] = False  # batch 1: last 12 keys are padding
    hf = torch.zeros(2, 1, s, s).masked_fill(~rand, torch.finfo(torch.float32).min)  # additive, HF style
    return [("random-bool", rand, "zigzag", "aten"), ("key-padding", keypad.expand(2, 1, s, s), "striped", "reference"),
            ("key-padding-one-row", keypad, "zigzag", "aten"),  # (B, 1, 1, S): broadcast over the rows
            ("additive-finfo-min", hf, "zigzag", "reference"),
            ("additive-bool-per-head", rand.expand(2, 4, s, s), "contiguous", "aten")]


def _rank_mask_cases(cases):
    out = []
    for i, (_, mask, lb, kernel) in enumerate(cases):
        q, k, v, dout = attention_inputs(2, 4, 2, 32, 32, 16, seed=70 + i)
        out.append(_rank_ring(q, k, v, dout, lb, kernel, {}, mask_full=mask))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_explicit_mask_matches_sdpa(ranks, world):
    cases = _mask_cases()
    per_rank = ranks.run(world, _rank_mask_cases, cases, timeout=300)
    failures = []
    for i, (name, mask, lb, kernel) in enumerate(cases):
        q, k, v, dout = attention_inputs(2, 4, 2, 32, 32, 16, seed=70 + i)
        ref = _sdpa64(q, k, v, dout, mask if mask.dtype == torch.bool else mask.double())
        for j, qn in enumerate(("out", "dq", "dk", "dv")):
            got = assemble([res[i][j] for res in per_rank], 32, lb)
            if not rel(got, ref[j]) <= FP32:
                failures.append(f"N={world} {name} ({lb}, {kernel}) {qn}: {rel(got, ref[j]):.3g}")
    assert not failures, "\n".join(failures)


def _rank_errors():
    q = k = v = cp_compile.shard(torch.randn(1, 2, 16, 16), 2)
    return refusals(q, k, v, (
        dict(window=4), dict(causal=True, window=0), dict(causal=True, attn_mask=torch.ones(8, 16, dtype=torch.bool)),
        dict(attn_mask=torch.ones(16, 16, dtype=torch.bool)),
        dict(attn_mask=torch.ones(8, 16, dtype=torch.bool), kernel="triton")))


def test_mask_misuse_names_the_fix(ranks):
    for msgs in ranks.run(2, _rank_errors, timeout=120):
        assert all(m is not None and "Fix" in m for m in msgs), msgs
        assert "causal=True" in msgs[0] and "pick one" in msgs[2] and "shard(mask, dim=-2)" in msgs[3]
        assert "Triton" in msgs[4]


def _causal_padding(s: int):
    """(B, 1, 1, S) key padding: batch 0 left-padded by 5 (its first 5 queries see no key at
    all), batch 1 right-padded by 7; and the dead (B, 1, S) query rows of causal & padding."""
    keep = torch.ones(2, 1, 1, s, dtype=torch.bool)
    keep[0, ..., :5] = False
    keep[1, ..., s - 7:] = False
    dead = ~(torch.tril(torch.ones(s, s, dtype=torch.bool)) & keep).any(-1)  # (B, 1, S)
    return keep, dead


def _rank_causal_padding(lb: str, s: int):
    """The ring op as the ring_cp backend calls it for Hugging Face's causal & padding mask:
    causal=True and attn_mask = the (B, 1, 1, S) key padding."""
    from cp_compile.ring.masking import additive_mask

    keep, dead = _causal_padding(s)
    q, k, v, dout = attention_inputs(2, 4, 2, s, s, 16, seed=90)
    dout = dout.masked_fill(dead[..., None], 0.0)  # dead rows carry no gradient (their output is 0)
    ql, kl, vl, dl = (cp_compile.shard(t, 2, load_balance=lb).float() for t in (q, k, v, dout))
    ql, kl, vl = (t.requires_grad_() for t in (ql, kl, vl))
    group = torch.distributed.group.WORLD.group_name
    out, _ = torch.ops.cp_compile.ring_attention_fwd(ql, kl, vl, True, 0.25, group, lb, "p2p", "aten",
                                                      attn_mask=additive_mask(keep))
    out.backward(dl)
    return out.detach(), ql.grad, kl.grad, vl.grad


@pytest.mark.parametrize("world,lb", [(2, "zigzag"), (4, "zigzag"), (4, "striped"), (2, "contiguous")])
def test_causal_with_key_padding_matches_sdpa(ranks, world, lb):
    """Causal folded into the key-padding mask per rectangle: rows whose every causally visible
    key is padding come out 0 (SDPA: NaN), and the rest equal SDPA with the combined mask."""
    s = 8 * world
    keep, dead = _causal_padding(s)
    q, k, v, dout = attention_inputs(2, 4, 2, s, s, 16, seed=90)
    dout = dout.masked_fill(dead[..., None], 0.0)
    live = torch.tril(torch.ones(s, s, dtype=torch.bool)) & keep
    ref = _sdpa64(q, k, v, dout, live | dead[..., None])  # dead rows: any finite stand-in, dout 0 there
    ref = (ref[0].masked_fill(dead[..., None], 0.0),) + ref[1:]
    per_rank = ranks.run(world, _rank_causal_padding, lb, s, timeout=120)
    for j, name in enumerate(("out", "dq", "dk", "dv")):
        got = assemble([r[j] for r in per_rank], s, lb)
        assert torch.isfinite(got).all() and rel(got, ref[j]) <= FP32, (name, rel(got, ref[j]))
