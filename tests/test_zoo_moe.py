"""Mixture-of-experts routing under ring_cp (cp_compile.passes.propagate.rules.routing, routing_rows).

The zoo members ``mixtral`` (hand-written, ``torch.where`` per expert + ``index_add_``) and
``hf_mixtral`` (transformers' ``grouped_mm`` experts: sort by expert, grouped matmul, inverse
permutation) are checked end to end by tests/test_zoo.py. Here:

* structure (``cp-compile explain``, no process group): the routing ops act on this rank's
  B·c token rows, no gather anywhere, for the hand model, HF's default ``grouped_mm`` and its
  ``batched_mm`` experts;
* the load-balancing auxiliary loss alone (HF's ``.aux_loss``; the hand model's means over the
  flattened tokens) equals the one-process value on 2 and 4 ranks, with its gradients, every
  attention the ring;
* with ``fullgraph=False`` (and no ``capture_dynamic_output_shape_ops``) Dynamo breaks the
  graph at every ``nonzero``: the pieces are exact too;
* refusals: a reduction over the selected rows, naming the op, the line and the fix.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import cp_compile
from checks import AttentionCount, grad_errors, rel, ring_mismatches
from cp_compile.errors import CPRewriteError
from cp_compile.tools.explain import explain_model
from zoo import BATCH, SEQ_LEN
from zoo import hf_mixtral, mixtral

def _explain(model, args, world=2):
    return explain_model(model, args, world_size=world)  # fullgraph=True: Dynamo keeps nonzero in the graph


def _targets(gm) -> list:
    return [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes]


def _local_shape(gm, name: str) -> tuple:
    node = next(n for n in gm.graph.nodes if getattr(n.target, "__name__", str(n.target)) == name)
    return tuple(node.args[0].meta["val"].shape)


@pytest.mark.slow
def test_hand_mixtral_routes_this_ranks_tokens_without_a_gather():
    """torch.where on the (E, k, B·c) mask, the rows gathered by top_x, index_add_ into (B·c, D)."""
    model, args = mixtral.factory()
    report = _explain(model, args)
    rows = BATCH * SEQ_LEN // 2  # B·c token rows on each of 2 ranks
    assert report.ctx.fallbacks == []
    assert "gather_seq" not in _targets(report.after)
    wheres = [n for n in report.after.graph.nodes if n.target is torch.where and len(n.args) == 1]
    assert len(wheres) == 2 * mixtral.EXPERTS  # every expert of every layer
    assert all(tuple(n.args[0].meta["val"].shape) == (mixtral.TOP_K, rows) for n in wheres)
    adds = [n for n in report.after.graph.nodes if n.target == "index_add_"]
    assert adds and all(tuple(n.args[0].meta["val"].shape) == (rows, mixtral.DIM) for n in adds)


@pytest.mark.slow
@pytest.mark.parametrize("experts", ["grouped_mm", "batched_mm"])
def test_hf_mixtral_experts_stay_on_this_ranks_rows(experts):
    """grouped_mm: sort of the B·c·k expert ids, grouped matmul, inverse permutation; batched_mm:
    the expert weights indexed per row. Neither gathers; the aux loss's histc is all-reduced."""
    model, args = hf_mixtral.factory(experts_implementation=experts)
    report = _explain(model, args)
    pairs = BATCH * SEQ_LEN // 2 * 2  # B·c tokens × top-2 on each of 2 ranks
    assert report.ctx.fallbacks == []
    assert "gather_seq" not in _targets(report.after)
    if experts == "grouped_mm":
        assert _local_shape(report.after, "sort") == (pairs,)
    else:
        assert _local_shape(report.after, "bmm")[0] == pairs
    assert "histc" in _targets(report.after) and "all_reduce_sum" in _targets(report.after)


class _AuxOnly(torch.nn.Module):
    """The hand Mixtral's load-balancing loss alone (router logits of every layer)."""

    def __init__(self, model: mixtral.Mixtral) -> None:
        super().__init__()
        self.m = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        m, x = self.m, self.m.embed_tokens(input_ids)
        pos = torch.arange(input_ids.shape[1]).float()
        emb = torch.cat((torch.outer(pos, m.inv_freq),) * 2, dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        logits = []
        for layer in m.layers:
            x, router_logits = layer(x, cos, sin)
            logits.append(router_logits)
        return mixtral.load_balancing_loss(torch.cat(logits, dim=0))


class _HFAux(torch.nn.Module):
    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, labels=labels).aux_loss


def _aux_on_rank(which: str, dynamo: dict, fullgraph: bool, seq_len: int = SEQ_LEN) -> dict:
    """Relative errors of the aux loss (or loss) and its worst gradient against one process, and
    what of "every attention became the ring" fails."""
    if which == "hand":
        model, (ids, _) = mixtral.factory(seq_len)
        ref, inputs = _AuxOnly(model), (ids,)
    elif which == "hand_loss":
        ref, inputs = mixtral.factory(seq_len)
    else:
        model, inputs = hf_mixtral.factory(seq_len)
        ref = _HFAux(model.lm)
    cp = copy.deepcopy(ref)
    torch._dynamo.reset()
    with AttentionCount() as count:
        want = ref(*inputs)
    want.backward()
    backend = cp_compile.RingCP(inner="aot_eager")
    with torch._dynamo.config.patch(**dynamo):
        got = torch.compile(cp, backend=backend, fullgraph=fullgraph)(*inputs)
        got.backward()
    # fullgraph=False: the breaks are inside the layers, so Dynamo compiles a layer's frame on its own,
    # one graph that every layer reuses: it holds one layer's attention
    attentions = count.calls if fullgraph else count.calls // len(ref.layers)
    grads = grad_errors(cp, ref)
    worst = max(grads, key=grads.get)
    return {"loss": rel(got.detach(), want.detach()), "grad": grads[worst], "worst": worst,
            "value": want.item(), "graphs": len(backend.records),
            "fallbacks": [f for r in backend.records for f in r.fallbacks],
            "rings": ring_mismatches(backend, attentions)}


@pytest.mark.slow
@pytest.mark.parametrize("which,world,seq_len", [("hand", 4, SEQ_LEN), ("hf", 2, SEQ_LEN - 2)])
def test_aux_loss_is_the_one_process_aux_loss(ranks, which, world, seq_len):
    """Both means over the flattened tokens are global: sum over ranks / the global count (the
    members run at the other world size in tests/test_zoo.py). 78 tokens on 2 ranks are padded
    to 80: the padding rows are routed too, but never counted."""
    for r in ranks.run(world, _aux_on_rank, which, {}, True, seq_len, timeout=300):
        assert r["loss"] <= 1e-6 and r["grad"] <= 1e-5 and not r["rings"], r
        assert r["fallbacks"] == [] and r["value"] > 0.5  # E·Σ f·P is ~1 for a near-uniform router


@pytest.mark.slow
def test_graph_breaks_at_nonzero_are_exact(ranks):
    """With fullgraph=False every torch.where breaks the graph (nonzero's size is data-dependent): the pieces
    hand whole values across the breaks, and the loss and gradients stay the one-process ones."""
    per_rank = ranks.run(2, _aux_on_rank, "hand_loss", {}, False, timeout=300)
    for r in per_rank:
        assert r["loss"] <= 1e-5 and r["grad"] <= 1e-5 and not r["rings"], r
        assert r["graphs"] > 1, r


class _RowSum(torch.nn.Module):
    """Selects rows by data, then mixes them (``across``): no per-rank form."""

    def __init__(self, across) -> None:
        super().__init__()
        self.emb, self.qkv, self.across = torch.nn.Embedding(101, 16), torch.nn.Linear(16, 48), across

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.emb(ids)).view(3, SEQ_LEN, 3, 2, 8).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(-1, 16)
        (picked,) = torch.where(h[:, 0] > 0)
        return self.across(h[picked]).sum()


@pytest.mark.parametrize("across,op", [(lambda r: r.cumsum(0), "cumsum"),
                                       (lambda r: F.softmax(r, dim=0), "softmax")], ids=["cumsum", "softmax"])
def test_an_op_across_selected_rows_is_refused_naming_the_op_and_the_fix(across, op):
    ids = torch.randint(0, 101, (3, SEQ_LEN))
    with pytest.raises(CPRewriteError) as err:
        _explain(_RowSum(across), (ids,))
    msg = str(err.value)
    assert op in msg and "test_zoo_moe.py" in msg and "Fix:" in msg


class _DeepSeekMoE(torch.nn.Module):
    """DeepSeek-V3-style routing (``idx, top = torch.where(indices == i)``; ``y[idx] += expert(x[idx]) *
    weights[idx, top, None]``) after one causal attention, with the write back written ``write`` ways."""

    def __init__(self, write: str, dim: int = 16, experts: int = 4, k: int = 2) -> None:
        super().__init__()
        self.write, self.k = write, k
        self.emb, self.qkv = torch.nn.Embedding(101, dim), torch.nn.Linear(dim, 3 * dim)
        self.head = torch.nn.Linear(dim, 101)
        self.gate = torch.nn.Linear(dim, experts, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(experts))

    def moe(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(-1, shape[-1])  # (B·S, D)
        weights, indices = torch.topk(self.gate(x).softmax(dim=-1), self.k, dim=-1)  # (B·S, k)
        y = torch.zeros(x.shape[0], x.shape[1]) if self.write == "index_add_whole" else torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            idx, top = torch.where(indices == i)
            rows = expert(x[idx])  # (n_i, D)
            if self.write == "rms_norm":  # a per-row op on the selected rows (routing_rows.py)
                rows = F.rms_norm(rows, (shape[-1],))  # before the router weights, which it would cancel
            rows = rows * weights[idx, top, None]
            if self.write in ("setitem_add", "rms_norm"):
                y[idx] += rows
            elif self.write == "index_put":
                y.index_put_((idx,), rows, accumulate=True)
            elif self.write == "index_add_whole":  # y built whole (not from x): its rows here are written
                y.index_add_(0, idx, rows)
            else:
                y.scatter_add_(0, idx[:, None].expand(-1, shape[-1]), rows)
        return y.view(shape)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        q, k, v = self.qkv(self.emb(ids)).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        return F.cross_entropy(self.head(h + self.moe(h)).flatten(0, 1), labels.flatten())


WRITES = ("setitem_add", "index_put", "scatter_add", "index_add_whole", "rms_norm")


def _writes_on_rank(writes) -> list:
    out = []
    for write in writes:
        torch.manual_seed(0)
        ref, ids = _DeepSeekMoE(write), torch.randint(0, 101, (BATCH, SEQ_LEN))
        cp, labels = copy.deepcopy(ref), torch.roll(ids, -1, 1)
        with AttentionCount() as count:
            want = ref(ids, labels)
        want.backward()
        torch._dynamo.reset()
        backend = cp_compile.RingCP(inner="aot_eager")
        got = torch.compile(cp, backend=backend, fullgraph=True)(ids, labels)
        got.backward()
        out.append({"write": write, "loss": rel(got.detach(), want.detach()),
                    "grad": max(grad_errors(cp, ref).values()),
                    "fallbacks": [f for r in backend.records for f in r.fallbacks],
                    "rings": ring_mismatches(backend, count.calls)})
    return out


@pytest.mark.slow
def test_rows_written_back_by_setitem_index_put_or_scatter_add_stay_on_this_rank(ranks):
    """``y[idx] += rows``, ``index_put_(accumulate=True)`` and ``scatter_add_`` with the indices expanded
    over the features write this rank's rows like ``index_add_``; into a ``y`` built whole (``torch.zeros``
    of the global size), later readers of ``y`` read the rows written here; rows normalised by
    ``F.rms_norm`` first (per row, like layer_norm). Exact against one process, no gather."""
    for per_rank in ranks.run(2, _writes_on_rank, WRITES, timeout=300):
        for r in per_rank:
            assert r["loss"] <= 1e-6 and r["grad"] <= 1e-5 and r["fallbacks"] == [] and not r["rings"], r


def test_rms_norm_of_selected_rows_stays_on_this_rank():
    """``F.rms_norm`` of rows selected by data is per row, as layer_norm is: the selection's rows
    normalised on this rank (it was missing from routing_rows' per-row ops, and refused)."""
    torch.manual_seed(0)
    ids = torch.randint(0, 101, (BATCH, SEQ_LEN))
    report = _explain(_DeepSeekMoE("rms_norm"), (ids, torch.roll(ids, -1, 1)))
    assert report.ctx.fallbacks == [] and "gather_seq" not in _targets(report.after)
    norms = [n for n in report.after.graph.nodes if n.target in (F.rms_norm, torch.rms_norm)]
    assert norms and all(n.meta["val"].shape[-1] == 16 for n in norms)
