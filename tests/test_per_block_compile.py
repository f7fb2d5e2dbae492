"""torchtitan-style compilation: each transformer block compiled on its own, the embedding,
final norm, head and loss eager, no ``ring_cp`` option.

Every block graph takes its input whole (``inputs="full"``), keeps this rank's tokens through
ring attention and the MLP, and all-gathers its output (``outputs="full"``): the loss and every
gradient equal one process's (fp32, 1e-5 relative), every attention is the ring, no op falls
back to the gathered sequence, and the one gather per block graph is its output's (counted, as
the documented cost: the sequence does not stay sharded *between* blocks; docs/composing.md).
The example Llama (S=48, batch 2) on 2 gloo ranks (a Hugging Face Llama, whose decoder layers
accelerate's regional compilation compiles one by one, and 4 ranks run below).

``cp_compile.recipes.compile_blocks`` keeps the sequence sharded *between* blocks (first block
inputs="full"/outputs="local", middle local/local, last local/full): on 3-block stacks of the
example Llama (2 and 4 ranks) and the Hugging Face Llama (2 ranks), the same exactness, ring and fallback
checks, and only the last block's graph gathers (one gather_seq, no all-gather anywhere else).
"""

from __future__ import annotations

import pytest

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


@pytest.mark.slow
@pytest.mark.parametrize("kind, world", [("llama", 2)])  # compile_blocks below covers both models and 4 ranks
def test_blocks_compiled_one_by_one_are_exact_ring_only_and_gather_only_their_output(ranks, world: int,
                                                                                   kind: str) -> None:
    for rank, r in enumerate(ranks.run(world, _per_block, kind, timeout=300)):
        assert r["loss"] <= TOL and r["grad"] <= TOL, (rank, r)
        assert r["attentions"] == r["blocks"] >= 2, (rank, r)  # one attention a block
        assert r["graphs"] >= 1 and r["no_attention"] == 0, (rank, r)  # one graph can serve every block
        assert not r["rings"], (rank, r)  # every block graph's attention is the ring
        assert r["fallbacks"] == [], (rank, r)  # nothing computed on the gathered sequence
        assert r["gathers"] == [1] * r["graphs"], (rank, r)  # each block graph gathers its output, once


# ---------- compile_blocks: the sequence sharded between blocks

LAYERS = 3  # first, middle, last


def _chained(kind: str) -> dict:
    """On a rank: compile_blocks on a 3-block stack; errors against one process, and what each graph did."""
    import hf_models
    import models
    from cp_compile.recipes import compile_blocks

    if kind == "llama":
        (ref, (ids, labels)), (cp, _) = [models.llama_factory(seq_len=SEQ, batch=2, n_layers=LAYERS)
                                         for _ in range(2)]
        blocks, loss_of = cp.layers, lambda m: m(ids, labels)
    else:
        ref, cp = (hf_models.hf_model("llama", num_hidden_layers=LAYERS) for _ in range(2))
        ids, labels = hf_models.hf_tokens(SEQ)
        blocks = cp.model.layers
        loss_of = lambda m: m(input_ids=ids, labels=labels, use_cache=False).loss  # noqa: E731
    with AttentionCount() as count:
        ref_loss = loss_of(ref)
    ref_loss.backward()
    backends = compile_blocks(blocks, inner="aot_eager")
    loss = loss_of(cp)
    loss.backward()
    grads = grad_errors(cp, ref)
    unique = list({id(b): b for b in backends}.values())  # first, middle, last
    collectives = {"gather_seq": lambda n: n.target is cp_compile.graph_ops.gather_seq,
                   "all_gather": lambda n: "all_gather" in str(n.target)}
    per_graph = [{name: sum(map(hit, gm.graph.nodes)) for name, hit in collectives.items()}
                 for b in unique for gm in b.graphs]
    return {"loss": rel(loss.detach(), ref_loss.detach()), "grad": max(grads.values()), "grads": len(grads),
            "worst": max(grads, key=grads.get), "attentions": count.calls, "blocks": len(blocks),
            "graphs": [len(b.graphs) for b in unique], "collectives": per_graph,
            "rings": [m for b in unique for m in ring_mismatches(b, 1, compiles=len(b.graphs))],
            "fallbacks": [f for b in unique for f in b.fallbacks + [f for r in b.records for f in r.fallbacks]],
            "no_attention": sum(len(b.no_attention) for b in unique)}


@pytest.mark.slow
@pytest.mark.parametrize("kind, world", [("llama", 2), ("hf_llama", 2), ("llama", 4)])
def test_compile_blocks_keeps_the_sequence_sharded_between_blocks(ranks, world: int, kind: str) -> None:
    for rank, r in enumerate(ranks.run(world, _chained, kind, timeout=300)):
        assert r["loss"] <= TOL and r["grad"] <= TOL, (rank, r)
        assert r["attentions"] == r["blocks"] == LAYERS, (rank, r)
        assert r["graphs"] == [1, 1, 1] and r["no_attention"] == 0, (rank, r)  # one graph per position
        assert not r["rings"] and r["fallbacks"] == [], (rank, r)
        # no gather between blocks: only the last block's graph gathers, its output, once
        assert r["collectives"] == [{"gather_seq": 0, "all_gather": 0}] * 2 + [{"gather_seq": 1, "all_gather": 0}], \
            (rank, r)


def test_compile_blocks_positions_and_refusals() -> None:
    """The options per position, and what is refused before anything compiles (no process group)."""
    import torch.nn as nn

    from cp_compile.recipes import compile_blocks
    from cp_compile.recipes.blocks import block_options

    assert [block_options(i, 3) for i in range(3)] == [{"inputs": "full", "outputs": "local"},
                                                       {"inputs": "local", "outputs": "local"},
                                                       {"inputs": "local", "outputs": "full"}]
    assert block_options(0, 1) == {"inputs": "full", "outputs": "full"}
    with pytest.raises(ValueError, match="no blocks"):
        compile_blocks([])
    with pytest.raises(ValueError, match="chooses \\['inputs'\\]"):
        compile_blocks([nn.Linear(2, 2)] * 1, inputs="local")
    block = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="same block twice"):
        compile_blocks([block, block])
    with pytest.raises(TypeError, match="nn.Module"):
        compile_blocks([block, lambda x: x])
    backends = compile_blocks([nn.Linear(2, 2) for _ in range(4)], inner="aot_eager")
    assert len(backends) == 4 and len({id(b) for b in backends}) == 3  # the middle blocks share one
    assert [(b.options.inputs, b.options.outputs) for b in backends] == \
        [("full", "local"), ("local", "local"), ("local", "local"), ("local", "full")]
