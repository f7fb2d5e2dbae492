"""Learned, position-indexed attention biases through the ring: score buffers that require grad.

- The public ``ring_attention`` (and the ring op with padding, ``valid_len``): a learned T5
  relative-position bias ``score + table[bucket(kv - q), h]`` (T5's bucket function, bidirectional
  and causal) and learned ALiBi slopes ``score + slopes[h] * (kv - q)``, fp64, at 2 and 4 ranks, GQA
  once, an odd length padded at the end once: out, dq, dk, dv and d(table) / d(slopes) (each rank's
  share, summed over the ranks) against a one-process explicit-scores reference differentiated by
  autograd. One case runs the Triton kernel (its interpreter here, fp32): its forward fuses the mods,
  its backward goes through the explicit-scores kernel for the buffers' gradient.
- A compiled model (examples/flex_models.py: ``flex_attention`` whose score_mod reads an
  ``nn.Parameter``: learned ALiBi slopes, a T5 bias table) under ``ring_cp`` against the same model
  run eagerly on one process: loss and every gradient within 1e-5 (fp32), at 2 ranks with an odd,
  padded length and at 4 ranks; no gather, no fallback, record = explain.
- The op's contract: the backward's gradient output is there only for the flagged buffers (the fake
  gives the same shapes); a mask buffer that requires grad is refused, and so is a learned tensor a mod
  captures instead of taking it as a score buffer (its gradient would be dropped).
"""

from __future__ import annotations

import math

import pytest
import torch

import cp_compile
from cp_compile.ring.mods import register_mods
from cp_compile.sequence import rank_positions
from checks import alibi_mod, assemble, explain_record, grad_errors, rel, ring_mismatches
from flex_models import t5_bucket

F64 = 1e-10  # fp64 against fp64: only rounding
F32 = 1e-5
D = 8


def t5_bidirectional(score, b, h, q_idx, kv_idx, table):
    return score + table[t5_bucket(kv_idx - q_idx, True), h]


def t5_causal(score, b, h, q_idx, kv_idx, table):
    return score + table[t5_bucket(kv_idx - q_idx, False), h]


MODS = {"t5_bi": t5_bidirectional, "t5_causal": t5_causal, "alibi": alibi_mod}


def _bias(name: str, h: int, s: int, buffer: torch.Tensor) -> torch.Tensor:
    """(H, S, S) the bias each mod adds, computed independently of the ring (dense, whole sequence)."""
    rel_pos = torch.arange(s)[None, :] - torch.arange(s)[:, None]  # kv - q
    if name == "alibi":
        return buffer[:h, None, None] * rel_pos
    bucket = t5_bucket(rel_pos, name == "t5_bi")  # (S, S)
    return buffer[bucket].permute(2, 0, 1)  # (H, S, S)


def _buffer(name: str, h: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    if name == "alibi":
        return torch.rand(h, generator=g, dtype=torch.float64) + 0.1  # (H,) slopes
    return torch.randn(8, h, generator=g, dtype=torch.float64)  # (buckets, H)


def _inputs(h: int, hkv: int, s: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=torch.float64) for shape in
            ((2, h, s, D), (2, hkv, s, D), (2, hkv, s, D), (2, h, s, D))]


def _reference(name: str, causal: bool, q, k, v, dout, buffer, valid: int):
    """fp64 explicit scores over the first ``valid`` positions, differentiated by autograd:
    (out, dq, dk, dv, d buffer), the sequence tensors (B, H, valid, D)."""
    q, k, v, dout = (t[:, :, :valid].detach().requires_grad_() for t in (q, k, v, dout))
    buf = buffer.detach().clone().requires_grad_()
    g = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ ke.transpose(-1, -2) / math.sqrt(D) + _bias(name, q.shape[1], valid, buf)
    if causal:
        s = s.masked_fill(~torch.ones(valid, valid, dtype=torch.bool).tril(), float("-inf"))
    out = torch.softmax(s, -1) @ ve
    out.backward(dout.detach())
    return out.detach(), q.grad, k.grad, v.grad, buf.grad


# (mod, causal, layout, H, H_kv, S padded, valid length or -1, kernel)
CASES = [
    ("t5_bi", False, "zigzag", 4, 4, 32, -1, "aten"),
    ("t5_causal", True, "zigzag", 4, 2, 32, -1, "aten"),  # GQA
    ("alibi", True, "striped", 4, 4, 32, -1, "reference"),
    ("t5_bi", False, "zigzag", 4, 4, 32, 29, "aten"),  # an odd length, padded at the end
    ("alibi", True, "zigzag", 4, 4, 32, 27, "aten"),
]
TRITON_CASE = ("t5_causal", True, "zigzag", 4, 2, 32, 30, "triton")


def _run_case(case, seed: int, dtype: torch.dtype):
    """On a rank: the ring's (out, dq, dk, dv) shards and this rank's share of the buffer's gradient."""
    import torch.distributed as dist

    name, causal, lb, h, hkv, s, valid, kernel = case
    q, k, v, dout = (cp_compile.shard(t, 2, load_balance=lb).to(dtype) for t in _inputs(h, hkv, s, seed))
    if valid >= 0:  # padded rows feed nothing real (the rewrite masks them out of the loss)
        dout = dout * (rank_positions(s, dist.get_world_size(), dist.get_rank(), lb) < valid)[:, None].to(dtype)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    buf = _buffer(name, h).to(dtype).requires_grad_()
    if valid < 0:
        out = cp_compile.ring_attention(q, k, v, causal=causal, load_balance=lb, kernel=kernel,
                                        score_mod=MODS[name], score_buffers=[buf])
    else:  # the op itself: the public API takes no padding
        out, _ = torch.ops.cp_compile.ring_attention_fwd(
            q, k, v, causal, 1 / math.sqrt(D), dist.group.WORLD.group_name, lb, "p2p", kernel, valid_len=valid,
            mods=register_mods(score_mod=MODS[name]), score_buffers=[buf])
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad, buf.grad


def _rank_cases(cases, dtype):
    return [_run_case(case, 500 + i, dtype) for i, case in enumerate(cases)]


def _errors(per_rank, cases, world: int) -> list:
    """'case: what error' for every value beyond tolerance (fp64: F64; the fp32 Triton case: F32)."""
    failures = []
    for i, case in enumerate(cases):
        name, causal, lb, h, hkv, s, valid, kernel = case
        n = s if valid < 0 else valid
        q, k, v, dout = _inputs(h, hkv, s, 500 + i)
        ref = _reference(name, causal, q, k, v, dout, _buffer(name, h), n)
        tol = F32 if kernel == "triton" else F64
        for j, what in enumerate(("out", "dq", "dk", "dv")):
            got = assemble([res[i][j] for res in per_rank], s, lb)[:, :, :n]
            if not rel(got, ref[j]) <= tol:
                failures.append(f"N={world} {case} {what}: {rel(got, ref[j]):.3g}")
        d_buf = sum(res[i][4].double() for res in per_rank)  # the shares summed over the group
        if not rel(d_buf, ref[4]) <= tol:
            failures.append(f"N={world} {case} d{name}: {rel(d_buf, ref[4]):.3g}")
        shares = [res[i][4].double() for res in per_rank]
        if not all(sh.norm() > 0 for sh in shares):  # each rank holds a share, none the whole
            failures.append(f"N={world} {case}: a rank's share of the buffer gradient is zero")
    return failures


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_learned_biases_match_explicit_scores_fp64(ranks, world):
    per_rank = ranks.run(world, _rank_cases, CASES, torch.float64, timeout=300)
    failures = _errors(per_rank, CASES, world)
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_learned_bias_on_the_triton_kernel(ranks):
    """kernel="triton" (the interpreter on CPU, fp32): the forward runs the fused Triton step kernels with
    the mods, the backward the explicit-scores loop, which gives the table's gradient."""
    per_rank = ranks.run(2, _rank_cases, [TRITON_CASE], torch.float32, timeout=300)
    failures = _errors(per_rank, [TRITON_CASE], 2)
    assert not failures, "\n".join(failures)


# --------------------------------------------------------------------------- the op's contract


def test_backward_returns_gradients_only_for_flagged_buffers():
    """One process: ``score_grads`` flags which score buffers get a gradient; the fake gives the same shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cp_compile.group import resolve_group

    q, k, v, dout = (t.float() for t in _inputs(4, 4, 16, 3))
    slopes, table = _buffer("alibi", 4).float(), _buffer("t5_bi", 4).float()
    key = register_mods(score_mod=_both)
    args = (q, k, v, True, 0.3, resolve_group(None).name, "zigzag", "p2p", "aten")
    out, lse = torch.ops.cp_compile.ring_attention_fwd(*args, mods=key, score_buffers=[slopes, table])
    for flags in ([True, False], [False, True], [True, True], None):
        *_, d_bufs = torch.ops.cp_compile.ring_attention_bwd(dout, q, k, v, out, lse, *args[3:], mods=key,
                                                              score_buffers=[slopes, table], score_grads=flags)
        want = [b.shape for b, f in zip((slopes, table), flags or (False, False)) if f]
        assert [g.shape for g in d_bufs] == want and all(g.abs().sum() > 0 for g in d_bufs), (flags, d_bufs)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fakes = [mode.from_tensor(t) for t in (dout, q, k, v, out, lse, slopes, table)]
            *_, fake = torch.ops.cp_compile.ring_attention_bwd(*fakes[:6], *args[3:], mods=key,
                                                                score_buffers=fakes[6:], score_grads=flags)
        assert [g.shape for g in fake] == want


def _both(score, b, h, q_idx, kv_idx, slopes, table):
    return score + slopes[h] * (kv_idx - q_idx) + table[t5_bucket(kv_idx - q_idx, True), h]


def test_learned_mask_buffer_is_refused():
    q, k, v, _ = (t.float() for t in _inputs(4, 4, 16, 4))
    width = torch.tensor([4.0], requires_grad=True)
    with pytest.raises(ValueError, match="mask_buffers tensor requires grad.*Fix"):
        cp_compile.ring_attention(q, k, v, mask_mod=_in_width, mask_buffers=[width])


def _in_width(b, h, q_idx, kv_idx, width):
    return (q_idx - kv_idx).abs() < width[0]


def test_learned_tensor_captured_by_a_mod_is_refused():
    """A learned tensor read from a closure instead of score_buffers would be a constant to the ring (its
    gradient dropped): refused, naming score_buffers."""
    q, k, v, _ = (t.float() for t in _inputs(4, 4, 16, 5))
    slopes = _buffer("alibi", 4).float().requires_grad_()

    def captured(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    with pytest.raises(ValueError, match="requires grad.*Fix: pass it as score_buffers"):
        cp_compile.ring_attention(q, k, v, causal=True, score_mod=captured)


# --------------------------------------------------------------------------- a compiled FlexAttention model


def _compiled(style: str, seq_len: int) -> dict:
    """On a rank: ring_cp against the eager one-process run of a flex model whose score_mod reads a parameter."""
    import warnings

    import torch.distributed as dist

    import flex_models

    ref_model, inputs = flex_models.FACTORIES[style](seq_len)
    cp_model, _ = flex_models.FACTORIES[style](seq_len)
    explained = explain_record(ref_model, inputs, world_size=dist.get_world_size())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        ref = ref_model(*inputs)
    ref.backward()
    backend = cp_compile.RingCP(inner="aot_eager")
    out = torch.compile(cp_model, backend=backend, fullgraph=True)(*inputs)
    out.backward()
    learned = "slopes" if style == "learned_alibi" else "table"
    gathers = [n for gm in backend.graphs for n in gm.graph.nodes if "gather_seq" in str(n.target)]
    return {"loss": rel(out.detach(), ref.detach()), "grads": grad_errors(cp_model, ref_model),
            "learned": [n for n, _ in cp_model.named_parameters() if n.endswith(learned)],
            "fallbacks": list(backend.fallbacks), "gathers": len(gathers), "record": backend.records == [explained],
            "ring_mismatches": ring_mismatches(backend, len(cp_model.layers))}


@pytest.mark.slow
@pytest.mark.parametrize("style,world,seq_len", [
    ("learned_alibi", 2, 30), ("t5_bias", 2, 30), ("learned_alibi", 4, 32), ("t5_bias", 4, 32),
])
def test_compiled_flex_with_learned_score_mod_trains_exactly(ranks, style, world, seq_len):
    for rank, r in enumerate(ranks.run(world, _compiled, style, seq_len, timeout=300)):
        assert r["learned"] and all(r["grads"][n] <= F32 for n in r["learned"]), (rank, r["grads"])
        assert r["loss"] <= F32 and max(r["grads"].values()) <= F32, (rank, r)
        assert r["fallbacks"] == [] and r["gathers"] == 0 and r["record"], (rank, r)
        assert not r["ring_mismatches"], (rank, r["ring_mismatches"])
