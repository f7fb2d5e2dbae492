"""``load_balance="documents"``: the ring_cp backend lays each batch out by its packed documents.

The compiled graph computes the table of every rank's positions from the document ids the masks
compare (``torch.ops.cp_compile.document_table``, :mod:`cp_compile.passes.propagate.doc_table`) and uses
``table[rank]`` wherever a fixed layout's positions were constants. On N = 2 and 4 gloo ranks,
against the same model run eagerly in one process on the full sequence (fp32, relative error
<= 1e-5): the hand-written packed model of examples/packed.py (forms ``index`` and
``head_dim_last``) and Hugging Face Llama with restarting ``position_ids`` give the same loss and
every parameter gradient; every attention of the eager run became a ring op, and every ring op
got ``positions=`` (the graph's table) and ``doc_ids=``;
the rank's shard of the input is ``x[:, table[rank]]`` (its value in the running graph); the
table the graph computed balances the visible (query, key) pairs (busiest / idlest <= 1.05 where
global zig-zag gives > 1.5, counted from the table, no timing); explain's record is the runtime's.
Refusals: an attention without a document mask, S not divisible by N, inputs="local".
"""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch
import torch.fx as fx

import hf_models
from packed import LENGTHS, S, DocAttention, PackedLlama
from packed import doc_ids as _doc_ids
from packed import positions as _positions

import cp_compile
from checks import AttentionCount, explain_record, grad_errors, rel, ring_mismatches
from cp_compile.document_layout import imbalance, layout_table, rank_work, zigzag_layout
from cp_compile.errors import CPRewriteError

TOL = 1e-5
OPTIONS = {"load_balance": "documents"}
SKEWED = [160, 32, 32, 32]  # one long document first: global zig-zag is 3.6x (N = 2) / 7.8x (N = 4) off


class _Keep(cp_compile.RingCP):
    """RingCP keeping each graph's example inputs, to run the rewritten graph again and read its values."""

    def __call__(self, gm, example_inputs, *args, **kwargs):
        self.examples = list(example_inputs)
        return super().__call__(gm, example_inputs, *args, **kwargs)


class _Values(fx.Interpreter):
    """Runs a rewritten graph, keeping the table and the index_select of the first placeholder."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.first = next(n for n in gm.graph.nodes if n.op == "placeholder")
        self.seen: Dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n.op == "call_function" and n.target is torch.ops.cp_compile.document_table.default:
            self.seen["table"] = out
        if n.op == "call_method" and n.target == "index_select" and n.args[0] is self.first:
            self.seen.setdefault("shard", out)
        return out


class _Hidden(DocAttention):
    """DocAttention returning its hidden states (B, S, 16): an output gathered in table order."""

    def forward(self, x: torch.Tensor, doc: torch.Tensor, keep: Any = None) -> torch.Tensor:
        mask = self.mask(x, doc, keep)
        b, s, _ = x.shape
        for qkv in self.qkv:
            q, k, v = (t.view(b, s, 2, 8).transpose(1, 2) for t in qkv(x).chunk(3, dim=-1))
            x = x + torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2) \
                .reshape(b, s, 16)
        return x


def _run(model_fn, inputs: tuple, lengths: List[int]) -> dict:
    """On a rank: ring_cp (documents) vs eager on the whole sequence, and what the graph holds."""
    import torch.distributed as dist

    ref_model, cp_model = model_fn(), model_fn()
    with torch._dynamo.config.patch(specialize_float=True):
        explained = explain_record(ref_model, inputs, world_size=dist.get_world_size(), **OPTIONS)
        with AttentionCount() as count:
            ref = ref_model(*inputs)
        _loss(ref).backward()
        backend = _Keep(inner="aot_eager", **OPTIONS)
        out = torch.compile(cp_model, backend=backend, fullgraph=True)(*inputs)
        _loss(out).backward()
    grads = grad_errors(cp_model, ref_model)
    (gm,) = backend.graphs
    rings = [n for n in gm.graph.nodes if "ring_attention_fwd" in str(n.target)]
    values = _Values(gm)
    with torch.no_grad():
        values.run(*backend.examples)
    table, first = values.seen["table"], backend.examples[0]
    world, rank = dist.get_world_size(), dist.get_rank()
    return {"loss": rel(out.detach(), ref.detach()), "grad": max(grads.values()),
            "records": backend.records == [explained], "record": str(explained), "fallbacks": list(backend.fallbacks),
            "ring_mismatches": ring_mismatches(backend, count.calls),
            "kwargs": [(n.kwargs.get("positions") is not None, n.kwargs.get("doc_ids") is not None) for n in rings],
            "table_is_layout": torch.equal(table, layout_table(_union(lengths), world)),
            "shard_ok": first.dim() >= 2 and torch.equal(values.seen["shard"], first[:, table[rank]]),
            "work": imbalance(rank_work(_union(lengths), list(table))),
            "zigzag": imbalance(rank_work(_union(lengths), zigzag_layout(sum(_union(lengths)), world)))}


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out if out.dim() == 0 else out.pow(2).sum()  # a gathered (B, S, D) output: a loss after the graph


def _union(lengths: Any) -> List[int]:
    """Document lengths of the union of every row's boundaries (one table serves the batch)."""
    rows = lengths if isinstance(lengths[0], list) else [lengths]
    cuts = sorted({c for row in rows for c in torch.tensor(row).cumsum(0).tolist()})
    return [b - a for a, b in zip([0] + cuts[:-1], cuts)]


def _check(results: list, layers: int = 2) -> None:
    for rank, r in enumerate(results):
        assert r["loss"] <= TOL and r["grad"] <= TOL, (rank, r)
        assert r["records"] and not r["fallbacks"] and not r["ring_mismatches"], (rank, r)
        assert r["kwargs"] == [(True, True)] * layers, (rank, r)  # every ring op: positions= and doc_ids=
        assert r["table_is_layout"] and r["shard_ok"], (rank, r)
        assert r["work"] <= 1.05, (rank, r)


def _hand(form: str, lengths: List[List[int]], hidden: bool = False) -> dict:
    """DocAttention(form) on ``lengths``; ``hidden``: the (B, S, 16) output gathered, with key padding
    (an explicit mask term, whose rows each rank takes by its table row)."""
    seq = sum(lengths[0])
    x = torch.randn(len(lengths), seq, 16, generator=torch.Generator().manual_seed(1))
    inputs = (x, _doc_ids(lengths))
    if hidden:
        keep = torch.ones(len(lengths), seq, dtype=torch.bool)
        keep[-1, -7:] = False  # inside the last row's last document: no query loses every key
        inputs += (keep,)
    return _run(lambda: (_Hidden if hidden else DocAttention)(form), inputs, lengths)


@pytest.mark.slow
@pytest.mark.parametrize("world,form,hidden", [(2, "index", False), (4, "head_dim_last", False), (4, "index", True)])
def test_hand_written_packed_model_is_exact(ranks, world: int, form: str, hidden: bool) -> None:
    _check(ranks.run(world, _hand, form, LENGTHS, hidden, timeout=240))


@pytest.mark.slow
def test_the_graph_table_balances_where_zigzag_does_not(ranks) -> None:
    """One long document then short ones: the table the graph computed is balanced by visible pairs."""
    results = ranks.run(4, _hand, "index", [SKEWED], timeout=240)
    _check(results)
    assert all(r["zigzag"] > 1.5 for r in results), results


def _llama() -> dict:
    ids, labels = hf_models.hf_tokens(S)
    return _run(PackedLlama, (ids, labels, _positions(LENGTHS)), LENGTHS)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_hf_llama_packed_is_exact(ranks, world: int) -> None:
    results = ranks.run(world, _llama, timeout=300)
    for r in results:  # the first placeholder is input_ids (B, S): its shard is ids[:, table[rank]] too
        assert r["shard_ok"], r
    _check(results)


# -- refusals and the record, no process group ------------------------------------------------------
def _inspect(model, args, **options):
    from cp_compile.tools.explain import explain_model

    torch._dynamo.reset()
    return explain_model(model, args, world_size=options.pop("world_size", 2), load_balance="documents", **options)


@pytest.mark.slow
def test_an_attention_without_documents_is_refused() -> None:
    import models

    model, (ids, labels) = models.llama_factory()
    with pytest.raises(CPRewriteError, match=r"no document mask.*Fix: load_balance='zigzag'"):
        _inspect(model, (ids, labels))


def test_a_length_not_divisible_by_n_is_refused() -> None:
    x, doc = torch.randn(2, 90, 16), _doc_ids([[5, 58, 27], [41, 49]])
    with pytest.raises(CPRewriteError, match=r"90 does not divide by the 4 ranks.*Fix: pad the batch"):
        _inspect(DocAttention("index"), (x, doc), world_size=4)


def test_local_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match=r"inputs='local'.*Fix: inputs='full'"):
        cp_compile.RingCP(load_balance="documents", inputs="local")


def test_explain_names_the_layout() -> None:
    from cp_compile.tools.explain_format import format_explain

    x = torch.randn(2, S, 16)
    report = _inspect(DocAttention("index"), (x, _doc_ids(LENGTHS)))
    text = format_explain(report)
    assert "load balance documents (table per batch)" in text, text
    assert report.ctx.record.masks == ["causal + documents; per rank: doc_ids (2, 96) int64 1.5 KiB"] * 2
    assert sum(n.target is torch.ops.cp_compile.document_table.default for n in report.after.graph.nodes) == 1


@pytest.mark.slow
def test_dynamic_shapes_are_refused() -> None:
    x = torch.randn(2, S, 16)
    fix = r"sequence length is dynamic.*Fix: torch.compile\(\.\.\., dynamic=False\)"
    with pytest.raises(CPRewriteError, match=fix):
        _inspect(DocAttention("index"), (x, _doc_ids(LENGTHS)), dynamic=True)
