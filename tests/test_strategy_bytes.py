"""The bytes each strategy sends, counted where they are sent (:mod:`cp_compile.traffic`) over one
training step of the example Llama, equal the cost model's (:func:`cp_compile.ulysses.cost.strategy_cost`)
kind by kind: "ring K/V" = ``ring_kv_bytes``, "ring dK/dV" = ``ring_acc_bytes``, "all_to_all" =
``a2a_bytes``, per attention layer, on every rank.

The expected counts come from the cost model called with the model's shape (the model under test
against the measurement); every case is also written out by hand from first principles (the hops and
slots each tensor makes: test_hand_derived_*), so that a formula and a runtime wrong the same way
cannot agree. The step is exact too
(loss and every parameter gradient against the one-process run), so the bytes counted are those of
a run that computes the right thing.
"""

from __future__ import annotations

import pytest
import torch

from checks import loss_and_grad_errors

# H = 8 query heads over H_kv = 2 K/V heads (GQA 4:1), head_dim 8; S = 30 does not divide 2N = 8 at N = 4
# (padded to 32), so the model must be priced at the padded length.
CFG = dict(vocab_size=64, dim=64, n_layers=2, n_heads=8, n_kv_heads=2, ffn_hidden=64, max_seq_len=64)
B, S = 2, 30
KINDS = {"ring K/V": "ring_kv_bytes", "ring dK/dV": "ring_acc_bytes", "all_to_all": "a2a_bytes"}


def _padded(s: int, world: int) -> int:
    """The zig-zag layout's padded length: the next multiple of 2N."""
    return -(-s // (2 * world)) * 2 * world


def _counted_step(strategy: str, u) -> dict:
    """On a rank: one warm-up step of the Llama through ring_cp with ``strategy``, then one step
    counted by cp_compile.traffic; the counts, the errors against the eager one-process step, and what
    the rewrite chose (strategy, u per attention)."""
    import models

    import cp_compile

    torch._dynamo.reset()
    ref_model, inputs = models.llama_factory(seq_len=S, batch=B, seed=0, **CFG)
    cp_model, _ = models.llama_factory(seq_len=S, batch=B, seed=0, **CFG)
    ref = ref_model(*inputs)
    ref.backward()
    opts = {} if u is None else {"ulysses_degree": u}
    backend = cp_compile.RingCP(inner="aot_eager", strategy=strategy, **opts)
    compiled = torch.compile(cp_model, backend=backend, fullgraph=True)
    compiled(*inputs).backward()  # compile + warm-up
    cp_model.zero_grad(set_to_none=True)
    with cp_compile.traffic.measure() as sent:
        out = compiled(*inputs)
        out.backward()
    loss_err, grad_err = loss_and_grad_errors(ref_model, ref, cp_model, out)
    return {"sent": dict(sent), "loss": loss_err, "grad": grad_err, "fallbacks": len(backend.fallbacks)}


def _expected(world: int, strategy: str, u) -> dict:
    from cp_compile.ulysses.cost import AttentionShape, strategy_cost

    head_dim = CFG["dim"] // CFG["n_heads"]
    shape = AttentionShape(B, CFG["n_heads"], CFG["n_kv_heads"], head_dim, _padded(S, world), 4, True)
    cost = strategy_cost(shape, world, strategy, u)
    return {kind: CFG["n_layers"] * getattr(cost, field) for kind, field in KINDS.items() if getattr(cost, field)}


# Written out by hand from the formula (test_hand_derived_2d_bytes' docstring): bytes per training step
# per rank over the 2 layers, N = 4, 2d u = 2 x r = 2, S = 30 padded to 32.
HAND = {(4, "2d", 2): {"all_to_all": 2 * 10240, "ring K/V": 2 * 4096, "ring dK/dV": 2 * 4096},
        (4, "ring", None): {"ring K/V": 2 * 12288, "ring dK/dV": 2 * 8192},  # test_hand_derived_ring_and_ulysses_bytes
        (4, "ulysses", None): {"all_to_all": 2 * 18432}}
CASES = [(4, "ring", None), (4, "ulysses", None), (4, "2d", 2)]  # N = 4: K/V heads (2) fewer than u = 4 too


@pytest.mark.parametrize("world,strategy,u", [
    pytest.param(w, s, u, id=f"N{w}-{s}" + (f"-u{u}" if u else ""),
                 marks=[pytest.mark.slow] if s != "ulysses" else [])  # the fast tier keeps one (5 s or more each)
    for w, s, u in CASES])
def test_counted_bytes_equal_the_cost_model(ranks, world: int, strategy: str, u) -> None:
    want = _expected(world, strategy, u)
    for rank, r in enumerate(ranks.run(world, _counted_step, strategy, u, timeout=300)):
        assert r["sent"] == want, (rank, r["sent"], want)
        assert r["sent"] == HAND.get((world, strategy, u), r["sent"]), (rank, r["sent"])
        assert r["loss"] <= 1e-5 and r["grad"] <= 1e-5, (rank, r)
        assert r["fallbacks"] == 0, (rank, r)


def test_hand_derived_2d_bytes() -> None:
    """2d on N = 4 (u = 2 x r = 2) at S = 30 -> 32, written out from the formula, per attention per rank:
    c = 32/4 = 8 tokens, e = 4 bytes (fp32), D = 8. Query heads per Ulysses rank hq = 8/2 = 4 (no
    padding); rank 0 of a row reads q heads 0-3 = K/V head 0, rank 1 q heads 4-7 = K/V head 1: m = 1.
    all-to-all: 8 of them (q, k, v, out forward; dout, dq, dk, dv backward), each sending to the one
    peer the other half of its slots for its c tokens: q/out/dout/dq hq·B·c·D·e = 4·2·8·8·4 = 2048,
    k/v/dk/dv m·B·c·D·e = 512 -> 4·2048 + 4·512 = 10240.
    ring over r = 2: a K/V block is K and V of m heads over the row's u·c = 16 tokens: 2·2·1·16·8·4 = 2048;
    r - 1 = 1 hop forward, 1 backward -> 4096; the fp32 dK/dV accumulator (same size at e = 4) makes
    r = 2 hops -> 4096."""
    from cp_compile.ulysses.cost import AttentionShape, strategy_cost

    cost = strategy_cost(AttentionShape(B, 8, 2, 8, 32, 4, True), 4, "2d", 2)
    assert (cost.a2a_bytes, cost.ring_kv_bytes, cost.ring_acc_bytes) == (10240, 4096, 4096)
    assert _expected(4, "2d", 2) == HAND[(4, "2d", 2)]


def test_hand_derived_ring_and_ulysses_bytes() -> None:
    """Ring and Ulysses on N = 4 at S = 30 -> 32, per attention per rank, from first principles:
    c = 32/4 = 8 tokens, B = 2, H = 8 over H_kv = 2, D = 8, e = 4 bytes (fp32).
    ring: a K/V block is K and V of the H_kv heads over c tokens, 2·B·H_kv·c·D·e = 2·2·2·8·8·4 = 2048;
    it makes N - 1 = 3 hops forward and 3 again backward -> 12288; the fp32 dK/dV accumulator of a
    block (2048 at e = 4) makes N = 4 hops, back to its owner -> 8192.
    Ulysses (u = N = 4): 2 query heads per rank, whose K/V head is one (heads 2r, 2r+1 read K/V head
    r // 2): m = 1. Eight all-to-alls (q, k, v, out forward; dout, dq, dk, dv backward), each sending
    each of the 3 other ranks its slots for this rank's c tokens: q/out/dout/dq 2·B·c·D·e = 1024 per
    peer -> 3072, k/v/dk/dv m·B·c·D·e = 512 per peer -> 1536; 4·3072 + 4·1536 = 18432."""
    from cp_compile.ulysses.cost import AttentionShape, strategy_cost

    shape = AttentionShape(B, 8, 2, 8, 32, 4, True)
    ring, ulysses = strategy_cost(shape, 4, "ring"), strategy_cost(shape, 4, "ulysses")
    assert (ring.a2a_bytes, ring.ring_kv_bytes, ring.ring_acc_bytes) == (0, 12288, 8192)
    assert (ulysses.a2a_bytes, ulysses.ring_kv_bytes, ulysses.ring_acc_bytes) == (18432, 0, 0)
    assert _expected(4, "ring", None) == HAND[(4, "ring", None)]
    assert _expected(4, "ulysses", None) == HAND[(4, "ulysses", None)]
