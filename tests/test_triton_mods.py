"""FlexAttention ``mask_mod`` / ``score_mod`` inside the Triton ring kernels (issue 16, mods item, Triton part).

What is checked, under ``TRITON_INTERPRET=1`` (conftest) at small shapes (S <= 48, D = 16,
16 x 16 tiles, partial last tiles), against fp64 attention whose mask and scores come from the
ring's own CPU evaluation of the same mods (:class:`cp_compile.ring.mods.Mods`, vmap over the grid):

- one ring step with the mods compiled into the forward and backward kernels: mask_mods
  causal / document (a (B, S) buffer read at ``doc[b, q_idx]``) / sliding window / prefix-LM,
  score_mods ALiBi (``slopes[h]`` buffer) and soft-cap (tanh, derivative generated), alone and
  together, with position masks, local and zig-zag cross-block positions, padding and GQA:
  fp32 <= 1e-5 relative on out, lse, dq, dk, dv;
- tile skipping: the forward and dQ kernels compute exactly the tiles with a pair visible under a
  document mask_mod (their debug counters against a brute-force count);
- a mod exercising the rest of the translated op set (floor division and remainder of negative
  numbers, fmod, where, sigmoid, exp, log, sqrt, rsqrt, abs, clamp, maximum, dtype conversions,
  a 2-D buffer at computed indices, a captured tensor), forward and backward;
- the ring op (``torch.ops.cp_compile.ring_attention_fwd`` with autograd, kernel="triton", as the
  backend calls it for a FlexAttention model) on 2 gloo ranks with a mask_mod and a score_mod on a
  padded sequence, against one process; and a FlexAttention model compiled with ring_cp and
  kernel="triton" (the flex rule's traced mods), loss and gradients against one process;
- a mod outside the op set is refused, before any collective, with a ValueError naming the op
  and the fix;
- the mods variant of every kernel passes the real GPU compiler (sm_90, ptxas).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cp_compile.kernels.triton import Tiles, TritonKernel, zero_grads
from cp_compile.ring.mods import Mods
from cp_compile.sequence import rank_positions
from checks import (alibi_mod, alibi_slopes, assemble, attention_inputs, causal_mod, check_fp32, document_mod,
                    mods_doc_ids, prefix_lm_mod, real_compile, rel_or_abs, softcap_mod, window_mod)

T16 = Tiles(16, 16)
NO_LIMIT = 2**31 - 1
SCALE = 0.25
MASKS = {"causal": causal_mod, "document": document_mod, "window": window_mod, "prefix_lm": prefix_lm_mod,
         "none": None}
SCORES = {"alibi": alibi_mod, "softcap": softcap_mod, "none": None}


def make_mods(mask: str, score: str, s: int) -> Mods:
    """The named mods of tests/test_ring_mods.py with their buffers (document ids (2, s), 4 slopes)."""
    return Mods(MASKS[mask], SCORES[score], (mods_doc_ids(s),) if mask == "document" else (),
                (alibi_slopes(),) if score == "alibi" else ())


def reference(q, k, v, dout, q_pos, k_pos, mods: Mods, *, causal: bool, kv_limit: int = NO_LIMIT):
    """fp64 (out, lse, dq, dk, dv) of one step: positions masked as the kernels do, then the mods
    evaluated by the ring's CPU path (positions at or past kv_limit read as kv_limit - 1)."""
    q, k, v, dout = (t.detach().double().requires_grad_() for t in (q, k, v, dout))
    rep = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    qp, kp = q_pos.long().clamp(max=kv_limit - 1), k_pos.long().clamp(max=kv_limit - 1)
    vis = (k_pos.long()[None, :] < kv_limit).expand(len(q_pos), -1)  # (Lq, Lk)
    if causal:
        vis = vis & (k_pos.long()[None, :] <= q_pos.long()[:, None])
    vis = vis & mods.mask(q.shape[0], q.shape[1], qp, kp)  # (B|1, H|1, Lq, Lk)
    s = q @ ke.transpose(-1, -2) * SCALE
    if mods.score_mod is not None:
        s = mods.scores(s, qp, kp)
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.exp(s - torch.where(lse.isinf(), 0.0, lse).unsqueeze(-1)) @ ve
    out.backward(dout)
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def run_step(kern, q, k, v, dout, q_pos, k_pos, mods, *, causal, kv_limit=NO_LIMIT):
    """One forward step + finalize and one backward step with the mods: (out, lse, dq, dk, dv)."""
    q_pos, k_pos = q_pos.to(torch.int32), k_pos.to(torch.int32)
    state = kern.new_state(q)
    kern.forward_step(q, k, v, state, q_pos, k_pos, causal=causal, scale=SCALE, kv_limit=kv_limit, mods=mods)
    out, lse = kern.finalize(state, q.dtype)
    grads = zero_grads(q, k)
    kern.backward_step(dout, q, k, v, lse, kern.delta(dout, out), grads, q_pos, k_pos, causal=causal, scale=SCALE,
                       kv_limit=kv_limit, mods=mods)
    return (out, lse, *grads)


ZZ = [rank_positions(48, 2, r, "zigzag") for r in (0, 1)]
LOCAL = torch.arange(36)
STEP_CASES = [  # (mask_mod, score_mod, causal flag, q_pos, k_pos, kv_limit, H_kv)
    ("causal", "none", False, LOCAL, LOCAL, NO_LIMIT, 2),
    ("document", "none", False, ZZ[0], ZZ[1], NO_LIMIT, 1),
    ("window", "softcap", False, ZZ[1], ZZ[0], NO_LIMIT, 2),
    ("prefix_lm", "alibi", False, LOCAL, LOCAL, 34, 1),
    ("none", "alibi", True, ZZ[1], ZZ[1], NO_LIMIT, 2),
    ("document", "softcap", True, LOCAL, LOCAL, NO_LIMIT, 2),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(STEP_CASES)))
def test_step_with_mods_matches_fp64(case):
    mask, score, causal, q_pos, k_pos, limit, hkv = STEP_CASES[case]
    mods = make_mods(mask, score, 48)
    q, k, v, dout = attention_inputs(2, 2, hkv, len(q_pos), len(k_pos), 16, dtype=torch.float32, seed=70 + case)
    want = reference(q, k, v, dout, q_pos, k_pos, mods, causal=causal, kv_limit=limit)
    got = run_step(TritonKernel(T16), q, k, v, dout, q_pos, k_pos, mods, causal=causal, kv_limit=limit)
    check_fp32(got, want, f"{mask}+{score} causal={causal} limit={limit}")


@pytest.mark.slow
def test_tiles_a_mask_mod_masks_wholly_are_skipped():
    """The forward and dQ kernels compute exactly the (query tile, key tile) pairs, per batch row and head,
    with a pair visible under the document mask_mod (brute force), fewer than the position rules keep."""
    mods, pos = make_mods("document", "softcap", 48), torch.arange(48)
    q, k, v, dout = attention_inputs(2, 2, 1, 48, 48, 16, dtype=torch.float32, seed=60)
    counters = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    kern, p32 = TritonKernel(T16), pos.to(torch.int32)
    state = kern.new_state(q)
    kern.forward_step(q, k, v, state, p32, p32, causal=True, scale=SCALE, counter=counters[0], mods=mods)
    out, lse = kern.finalize(state, q.dtype)
    grads = zero_grads(q, k)
    kern.backward_step(dout, q, k, v, lse, kern.delta(dout, out), grads, p32, p32, causal=True, scale=SCALE,
                       counter=counters[1], mods=mods)
    check_fp32((out, lse, *grads), reference(q, k, v, dout, pos, pos, mods, causal=True), "document tiles")
    vis = mods.mask(2, 2, pos, pos) & (pos[None, :] <= pos[:, None])  # (B, H, 48, 48)
    tiles = vis.unflatten(2, (3, 16)).unflatten(4, (3, 16)).any(-1).any(-2)  # (B, H, 3, 3)
    causal_tiles = 2 * 2 * 6  # the tiles on or below the diagonal, per (b, h)
    assert counters[0].item() == counters[1].item() == int(tiles.sum()) < causal_tiles, (counters, tiles.sum())


BIAS = torch.linspace(-1.0, 1.0, 16).reshape(4, 4)  # captured by sink_score: a constant of its own slot
OFFSET = torch.tensor(0.125)  # a one-element capture: a literal


def sink_mask(b, h, q_idx, kv_idx):
    rel = kv_idx - q_idx
    return ~(torch.remainder(rel, 7) == 3) & torch.logical_or(q_idx >= kv_idx, (kv_idx // 8) == (q_idx // 8))


def sink_score(score, b, h, q_idx, kv_idx, gain):
    rel = kv_idx - q_idx  # negative as well as positive
    bucket = torch.div(rel, 3, rounding_mode="floor") % 4
    gate = torch.sigmoid(score) * torch.exp(-torch.abs(score) / 4)
    t = torch.where(bucket == 0, score * 0.5, score + gate) + BIAS[h, bucket] * gain[h]
    t = torch.clamp(t, -6.0, 6.0) + torch.sqrt(torch.abs(score) + 1) - torch.rsqrt(score * score + 1)
    t = torch.maximum(t, torch.log(torch.abs(score) + 0.5)) + (rel // 5).to(torch.float32) * 0.01
    return t - torch.fmod(rel, 3).float() * 0.02 + OFFSET


@pytest.mark.slow
def test_translated_op_set_matches_pytorch():
    """Every other translated op, against the same mods evaluated by PyTorch (vmap), forward and backward."""
    mods = Mods(sink_mask, sink_score, (), (torch.tensor([1.0, -0.5, 2.0, 0.25]),))
    q_pos, k_pos = ZZ[0], ZZ[1]
    q, k, v, dout = attention_inputs(2, 2, 1, len(q_pos), len(k_pos), 16, dtype=torch.float32, seed=90)
    q = q * 4  # scores of a few units: both sides of the clamp, the gate and the log
    want = reference(q, k, v, dout, q_pos, k_pos, mods, causal=False)
    got = run_step(TritonKernel(T16), q, k, v, dout, q_pos, k_pos, mods, causal=False)
    check_fp32(got, want, "sink")


# --------------------------------------------------------------------------- refusals


def erf_score(score, b, h, q_idx, kv_idx):
    return torch.erf(score)


def test_untranslatable_mods_are_refused_before_the_ring_with_the_fix():
    from cp_compile.group import CPGroup
    from cp_compile.ring.fused import ring_forward_fused

    q = torch.randn(1, 2, 32, 16)

    def ring(mods):
        spec = SimpleNamespace(window=-1, attn_mask=None, doc_ids=None, mods=mods)
        return ring_forward_fused(q, q, q, causal=True, scale=SCALE, group=CPGroup(pg=None, rank=0, size=1),
                                  load_balance="zigzag", rotate="p2p", kernel=TritonKernel(T16), spec=spec)

    with pytest.raises(ValueError, match=r"score_mod: aten\.erf\.default is not among.*Fix: use kernel='aten'"):
        ring(Mods(None, erf_score))
    data_dependent = Mods(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx if bool((q_idx > 3).any()) else q_idx < 0)
    with pytest.raises(ValueError, match=r"could not trace the mask_mod.*no Python `if`.*Fix: use kernel='aten'"):
        ring(data_dependent)
    five = tuple(torch.zeros(4) for _ in range(5))
    reads_five = Mods(lambda b, h, q_idx, kv_idx, *bufs: sum(t[h] for t in bufs) >= 0, None, five)
    with pytest.raises(ValueError, match=r"more than 4 tensors.*Fix: stack them"):
        ring(reads_five)
    out, _ = ring(Mods(causal_mod, softcap_mod))  # translatable: runs
    assert torch.isfinite(out).all()


# --------------------------------------------------------------------------- 2 ranks, the op


def _op_inputs(valid: int):
    g = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(2, h, 48, 16, generator=g, dtype=torch.float64) for h in (2, 1, 1, 2))
    dout[:, :, valid:] = 0.0  # padding rows carry no gradient
    return q, k, v, dout


def _rank_op(valid: int):
    import torch.distributed as dist

    import cp_compile
    from cp_compile.ring.mods import register_mods

    q, k, v, dout = (cp_compile.shard(t, 2).float() for t in _op_inputs(valid))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    key = register_mods(mask_mod=document_mod, score_mod=alibi_mod)
    out, _ = torch.ops.cp_compile.ring_attention_fwd(
        q, k, v, True, SCALE, dist.group.WORLD.group_name, "zigzag", "p2p", "triton", valid_len=valid, mods=key,
        mask_buffers=[mods_doc_ids(48)[:, :valid]], score_buffers=[alibi_slopes()])
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.slow
def test_ring_op_with_mods_on_triton_matches_one_process(ranks):
    """kernel="triton" on 2 ranks (document mask_mod + ALiBi score_mod, causal, padded sequence, buffers of
    the unpadded length) against fp64 attention over the whole sequence in one process."""
    valid = 42
    per_rank = ranks.run(2, _rank_op, valid, timeout=300)
    pos = torch.arange(48)
    mods = Mods(document_mod, alibi_mod, (mods_doc_ids(48)[:, :valid],), (alibi_slopes(),))
    want = reference(*_op_inputs(valid), pos, pos, mods, causal=True, kv_limit=valid)
    for j, name in enumerate(("out", "dq", "dk", "dv")):
        got = assemble([res[j] for res in per_rank], 48, "zigzag")
        ref = want[0 if j == 0 else j + 1]
        got, ref = (got[:, :, :valid], ref[:, :, :valid]) if j == 0 else (got, ref)
        assert rel_or_abs(got, ref) <= 1e-5, f"{name}: {rel_or_abs(got, ref):.3g}"


def _flex_model(style: str) -> tuple:
    """On a rank: a FlexAttention model (examples/flex_models.py) under ring_cp with kernel="triton",
    against the same model run for one process (flex's dense implementation): (loss, max grad) rel. errors,
    the Triton kernels generated, and what of "every flex_attention (one a layer) became the ring" fails."""
    import warnings

    import cp_compile
    import flex_models
    from checks import grad_errors, ring_mismatches
    from cp_compile.kernels.triton import mods as triton_mods

    ref_model, attention_inputs = flex_models.FACTORIES[style]()
    cp_model, _ = flex_models.FACTORIES[style]()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        ref = ref_model(*attention_inputs)
    ref.backward()
    backend = cp_compile.RingCP(inner="aot_eager", kernel="triton")
    out = torch.compile(cp_model, backend=backend, fullgraph=True)(*attention_inputs)
    out.backward()
    grad = max(grad_errors(cp_model, ref_model).values())
    rings = ring_mismatches(backend, len(cp_model.layers))  # one flex_attention a layer
    return rel_or_abs(out.detach(), ref.detach()), grad, len(triton_mods._CACHE), rings


@pytest.mark.slow
def test_flex_model_on_triton_matches_one_process(ranks):
    """torch.compile(backend="ring_cp", kernel="triton") of a FlexAttention model (causal mask_mod, ALiBi
    score_mod reading per-head slopes): the flex rule's traced mods (GraphModules) run inside the Triton
    kernels; loss and every gradient within 1e-5 of one process."""
    for rank, (loss, grad, generated, rings) in enumerate(ranks.run(2, _flex_model, "alibi", timeout=300)):
        assert loss <= 1e-5 and grad <= 1e-5 and generated >= 1 and not rings, (rank, loss, grad, generated, rings)


@pytest.mark.slow
def test_mod_kernels_compile_for_real_gpus():
    """The mods variant of every kernel (document & window mask_mod, ALiBi under a soft-cap) passes the
    real Triton compiler (ptxas included) for sm_90, bf16, GQA, causal."""

    records = real_compile("compile_all(90, 'bf16', head_dim=64, group=4, causal=True, mods=True)")
    assert len(records) == 4 and all(r["mods"] and r["cubin_bytes"] > 0 for r in records)
    assert max(r["shared_bytes"] for r in records) <= 164 * 1024
