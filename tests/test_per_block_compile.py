"""torchtitan-style compilation: each transformer block compiled on its own, the embedding,
final norm, head and loss eager, no ``ring_cp`` option.

Every block graph takes its input whole (``inputs="full"``), keeps this rank's tokens through
ring attention and the MLP, and all-gathers its output (``outputs="full"``): the loss and every
gradient equal one process's (fp32, 1e-5 relative), every attention is the ring, no op falls
back to the gathered sequence, and the one gather per block graph is its output's (counted, as
the documented cost: the sequence does not stay sharded *between* blocks; docs/composing.md).
The example Llama (S=48, batch 2) and a Hugging Face Llama (its decoder layers compiled one by
one, as accelerate's regional compilation does), on 2 and 4 gloo ranks.
"""

from __future__ import annotations

import pytest
import torch

import cp_compile
from checks import AttentionCount, grad_errors, rel, ring_mismatches

TOL = 1e-5
SEQ = 48


def _models(kind: str):
    """(reference, copy to compile, its blocks, call(model) -> loss): two identical models."""
    if kind == "llama":
        import models

        pair = [models.llama_factory(seq_len=SEQ, batch=2) for _ in range(2)]
        (ref, (ids, labels)), (cp, _) = pair
        return ref, cp, cp.layers, lambda m: m(ids, labels)
    import hf_models

    ref, cp = (hf_models.hf_model("llama") for _ in range(2))
    ids, labels = hf_models.hf_tokens(SEQ)
    return ref, cp, cp.model.layers, lambda m: m(input_ids=ids, labels=labels, use_cache=False).loss


def _per_block(kind: str) -> dict:
    """On a rank: loss and worst gradient errors against one process, and what ring_cp did."""
    ref, cp, blocks, loss_of = _models(kind)
    with AttentionCount() as count:
        ref_loss = loss_of(ref)
    ref_loss.backward()
    backend = cp_compile.RingCP(inner="aot_eager")  # no other option
    for block in blocks:
        block.compile(backend=backend)  # torchtitan: each TransformerBlock on its own
    loss = loss_of(cp)
    loss.backward()
    grads = grad_errors(cp, ref)
    gathers = [sum(n.target is cp_compile.graph_ops.gather_seq for n in gm.graph.nodes) for gm in backend.graphs]
    return {"loss": rel(loss.detach(), ref_loss.detach()), "grad": max(grads.values()), "grads": len(grads),
            "attentions": count.calls, "blocks": len(blocks), "graphs": len(backend.graphs),
            "rings": ring_mismatches(backend, 1, compiles=len(backend.graphs)), "gathers": gathers,
            "fallbacks": backend.fallbacks + [f for r in backend.records for f in r.fallbacks],
            "no_attention": len(backend.no_attention)}


@pytest.mark.parametrize("kind", ["llama", "hf_llama"])
@pytest.mark.parametrize("world", [2, 4])
def test_blocks_compiled_one_by_one_are_exact_ring_only_and_gather_only_their_output(ranks, world: int,
                                                                                   kind: str) -> None:
    for rank, r in enumerate(ranks.run(world, _per_block, kind, timeout=300)):
        assert r["loss"] <= TOL and r["grad"] <= TOL, (rank, r)
        assert r["attentions"] == r["blocks"] >= 2, (rank, r)  # one attention a block
        assert r["graphs"] >= 1 and r["no_attention"] == 0, (rank, r)  # one graph can serve every block
        assert not r["rings"], (rank, r)  # every block graph's attention is the ring
        assert r["fallbacks"] == [], (rank, r)  # nothing computed on the gathered sequence
        assert r["gathers"] == [1] * r["graphs"], (rank, r)  # each block graph gathers its output, once
