"""Reductions over the sequence that return positions or follow the order of the values
(rules/order.py: argmax/argmin, max/min/kthvalue/median with a dim, topk, sort/argsort) and reads at
positions chosen by data (rules/getitem.py: ``x[arange(B), idx]``, ``x[:, idx]``, ``gather``,
``index_select``, ``take_along_dim``) are exact on the ranks' shards, with no gather of the sequence.

Each head below runs on the output of a small attention model; on real gloo ranks (N = 2 and 4, lengths
that divide and that are padded) the loss, the integer results (positions, exactly), every parameter
gradient and the input's gradient match the one-process run on the whole sequence, the record is
explain's, and the rewritten graphs hold no ``gather_seq`` and record no fallback. Ties are tested on
integer values with many equal entries: the first occurrence wins, as in torch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from checks import explain_record, grad_errors, graph_summary, rel, twin_models

V, D, B, EOS = 23, 8, 3, 5


def _weighted(t: torch.Tensor) -> torch.Tensor:
    """A sum with distinct weights, so a value moved to another place changes the loss."""
    return (t * torch.linspace(0.5, 1.5, t.numel(), dtype=t.dtype).view_as(t)).sum()


def _argext(h, sc, ids):
    i, j = sc.argmax(-1), torch.argmin(sc, dim=1, keepdim=True)
    return _weighted(h[torch.arange(h.shape[0]), i]) + _weighted(h[torch.arange(h.shape[0]), j[:, 0]]), (i, j)


def _eos(h, sc, ids):  # CLIP's pooling: the first end-of-text token (several in row 0, none in row 1)
    e = (ids.to(torch.int) == EOS).int().argmax(dim=-1)
    return _weighted(h[torch.arange(h.shape[0]), e]), (e,)


def _ties(h, sc, ids):  # many equal integers: the first occurrence of the max / min
    m = ids % 3
    vals, idx = m.max(1)
    low = torch.min(m, 1, keepdim=True)
    return _weighted(h[torch.arange(h.shape[0]), idx]), (vals, idx, low.values, low.indices)


def _extrema(h, sc, ids):
    v, j = h.max(1)
    w = torch.min(h, 1, keepdim=True)
    return _weighted(v) + _weighted(w.values), (j, w.indices)


def _topk(h, sc, ids):
    t = torch.topk(sc, 3, dim=1)
    u = sc.topk(6, 1, largest=False)  # k > c at N = 4, S = 15 (c = 4)
    return _weighted(t.values) + _weighted(u.values), (t.indices, u.indices)


def _kth(h, sc, ids):
    k = sc.kthvalue(4, 1)
    m = torch.median(sc, 1, keepdim=True)
    f = h.median(1)
    return _weighted(k.values) + _weighted(m.values) + _weighted(f.values), (k.indices, m.indices, f.indices)


def _sort(h, sc, ids):
    sv, si = sc.sort(1, descending=True)
    a = torch.argsort(sc, 1)
    return _weighted(sv), (si, a)


def _reads(h, sc, ids):
    s = h.shape[1]
    idx = torch.tensor([0, 5, -1, 5, s - 2])  # a repeat and a negative position
    pos = idx.clamp(min=0)
    b = h[:, idx]
    c = torch.index_select(h, 1, pos)
    g = h.gather(1, pos[None, :, None].expand(h.shape[0], -1, h.shape[2]))
    t = torch.take_along_dim(h, pos[None, :, None], 1)
    last = sc[torch.arange(h.shape[0]), torch.tensor([-1, 3, s - 1])]
    end = h[torch.arange(h.shape[0]), -1]  # HF's pooling without a pad token: an int with a tensor
    return _weighted(b) + _weighted(c) + _weighted(g) + _weighted(t) + _weighted(last) + _weighted(end), ()


def _masked(h, sc, ids):  # boolean selection of positions: a per-token mask, a whole one over the sequence only
    s = h.shape[1]
    at_eos = h[ids == EOS]  # (n, D), n found by data
    every_third = h[:, torch.arange(s) % 3 == 0]  # (B, ceil(S/3), D)
    w = torch.linspace(0.5, 1.5, D)  # (sizes found by data: no weight per entry)
    return (at_eos * w).square().sum() + (every_third * w).square().sum(), ()


def _per_token(h, sc, ids):  # not over the sequence: per token, Sharded
    a = h.argmax(-1)
    v, _ = h.max(2)
    t = h.topk(2, -1).values
    return v.square().sum() + t.square().sum(), (a.sum(1),)  # (_weighted's view_as is not per token)


HEADS = {f.__name__[1:]: f for f in (_argext, _eos, _ties, _extrema, _topk, _kth, _sort, _reads, _masked,
                                                 _per_token)}


class Reads(nn.Module):
    """Token embedding plus a float input, one causal attention, a per-token score, then a head."""

    def __init__(self, head: str) -> None:
        super().__init__()
        self.emb, self.qkv, self.w = nn.Embedding(V, D), nn.Linear(D, 3 * D), nn.Linear(D, 1)
        self.head = head

    def forward(self, ids: torch.Tensor, x: torch.Tensor):
        b, s = ids.shape
        h = self.emb(ids) + x
        q, k, v = self.qkv(h).view(b, s, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        h = h + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, D)
        loss, ints = HEADS[self.head](h, self.w(h).squeeze(-1), ids)
        return loss, ints


def _inputs(s: int) -> tuple:
    g = torch.Generator().manual_seed(s)
    ids = torch.randint(0, V - 1, (B, s), generator=g)
    ids[ids >= EOS] += 1  # no EOS but where placed: row 0 three times, row 1 never, row 2 last
    ids[0, [2, 7, s - 1]] = EOS
    ids[2, s - 1] = EOS
    return ids, torch.randn(B, s, D, generator=g)


def _compare(head: str, s: int) -> dict:
    import torch.distributed as dist

    import cp_compile

    ref_model, cp_model = twin_models(lambda: Reads(head))
    ids, x = _inputs(s)
    explained = explain_record(ref_model, (ids, x), world_size=dist.get_world_size())
    xr, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref, ref_ints = ref_model(ids, xr)
    ref.backward()
    backend = cp_compile.RingCP(inner="aot_eager")
    out, ints = torch.compile(cp_model, backend=backend, fullgraph=True)(ids, xc)
    out.backward()
    return {"loss": rel(out.detach(), ref.detach()), "grads": max(grad_errors(cp_model, ref_model).values()),
            "x_grad": rel(xc.grad, xr.grad),
            "ints": [bool(torch.equal(a, b)) and a.dtype == b.dtype for a, b in zip(ints, ref_ints)],
            "n_ints": (len(ints), len(ref_ints)), "same_record": backend.records == [explained],
            "fallbacks": list(backend.fallbacks), "gathers": graph_summary(backend)["gather_seq"]}


def _compare_all(lengths: tuple) -> dict:
    with torch._dynamo.config.patch(cache_size_limit=64):  # one Reads per head and length: recompiles (restored)
        return {(head, s): _compare(head, s) for s in lengths for head in HEADS}


@pytest.mark.slow
@pytest.mark.parametrize("world, lengths", [(2, (16,)), (2, (21,)), (4, (15,))])
def test_order_reductions_and_reads_are_exact_without_a_gather(ranks, world: int, lengths: tuple) -> None:
    for rank, results in enumerate(ranks.run(world, _compare_all, lengths, timeout=300)):
        for case, r in results.items():
            assert r["loss"] <= 1e-5 and r["grads"] <= 1e-5 and r["x_grad"] <= 1e-5, (rank, case, r)
            assert all(r["ints"]) and r["n_ints"][0] == r["n_ints"][1], (rank, case, r)
            assert r["same_record"] and r["fallbacks"] == [] and r["gathers"] == 0, (rank, case, r)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("head", sorted(HEADS))
def test_explain_shows_no_gather(head: str, world: int) -> None:
    from cp_compile.tools.explain import explain_model

    ids, x = _inputs(15)
    torch.manual_seed(0)
    r = explain_model(Reads(head), (ids, x), world_size=world)
    assert r.ctx.record.fallbacks == [], r.ctx.record.fallbacks
    assert not [n for n in r.after.graph.nodes if "gather_seq" in str(n.target)], r.after.code


@pytest.mark.slow
@pytest.mark.parametrize("load_balance, world", [("contiguous", 2), ("striped", 4)])
def test_other_layouts_show_no_gather(load_balance: str, world: int) -> None:
    from cp_compile.tools.explain import explain_model

    ids, x = _inputs(15)
    for head in HEADS:
        torch.manual_seed(0)
        r = explain_model(Reads(head), (ids, x), world_size=world, load_balance=load_balance)
        assert r.ctx.record.fallbacks == [], (head, r.ctx.record.fallbacks)


@pytest.mark.slow
def test_a_symbolic_length_is_gathered_and_warned() -> None:
    """Under dynamic=True the rules fall back (warned), also where the result's size is found by data."""
    from cp_compile.tools.explain import explain_model

    ids, x = _inputs(15)
    for head, op in (("extrema", "max under a symbolic"), ("masked", "indexing with tensors")):
        torch.manual_seed(0)
        r = explain_model(Reads(head), (ids, x), world_size=2, dynamic=True)
        assert any(op in f for f in r.ctx.record.fallbacks), (head, r.ctx.record.fallbacks)


class Flattened(nn.Module):
    """argmax over tokens flattened with the batch (B·S): not a reduction over one sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, x: torch.Tensor):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b * s, D)
        return h.sum(), h.argmax(0)


def test_a_sequence_merged_with_the_batch_is_gathered_and_warned() -> None:
    from checks import cp_compile_warnings
    from cp_compile.tools.explain import explain_model

    with cp_compile_warnings() as warnings:
        r = explain_model(Flattened(), (torch.randn(B, 16, D),), world_size=2)
    assert any("argmax" in f and "merges the sequence" in f for f in r.ctx.record.fallbacks), r.ctx.record.fallbacks
    assert any("argmax" in w for w in warnings), warnings


# --------------------------------------------------------------------------- Hugging Face's own classes
HF_SEQ_CLS = {"llama": "LlamaForSequenceClassification", "gpt2": "GPT2ForSequenceClassification"}


def _hf_seq_cls(model_type: str) -> tuple:
    """(model, kwargs): the tiny config's classifier, rows right-padded with pad_token_id 0 to lengths 21, 15,
    6, the padding mask passed as Hugging Face users pass it."""
    import transformers
    from hf_configs import tiny_config

    cfg = tiny_config(model_type)
    cfg.num_labels, cfg.pad_token_id = 3, 0
    torch.manual_seed(0)
    model = getattr(transformers, HF_SEQ_CLS[model_type])._from_config(cfg).float().train()
    ids = torch.randint(5, 100, (3, 21), generator=torch.Generator().manual_seed(0))
    ids[1, 15:], ids[2, 6:] = 0, 0
    return model, {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": torch.tensor([0, 2, 1])}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(HF_SEQ_CLS))
def test_hf_sequence_classification_pools_without_a_gather(model_type: str) -> None:
    from cp_compile.tools.explain import explain_model

    model, kwargs = _hf_seq_cls(model_type)
    r = explain_model(model, (), world_size=2, example_kwargs=kwargs)
    assert r.ctx.record.fallbacks == [] and r.ctx.record.rings == 2, r.ctx.record.summary()
    assert not [n for n in r.after.graph.nodes if "gather_seq" in str(n.target)], r.after.code


def _hf_exact(model_type: str) -> dict:
    import copy

    import torch.distributed as dist

    import cp_compile

    ref_model, kwargs = _hf_seq_cls(model_type)
    cp_model = copy.deepcopy(ref_model)
    explained = explain_record(ref_model, (), kwargs, world_size=dist.get_world_size())
    ref = ref_model(**kwargs)
    ref.loss.backward()
    backend = cp_compile.RingCP(inner="aot_eager")
    out = torch.compile(cp_model, backend=backend, fullgraph=True)(**kwargs)
    out.loss.backward()
    return {"loss": rel(out.loss.detach(), ref.loss.detach()), "logits": rel(out.logits.detach(), ref.logits.detach()),
            "grads": max(grad_errors(cp_model, ref_model).values()), "same_record": backend.records == [explained],
            "fallbacks": list(backend.fallbacks)}


@pytest.mark.slow
def test_hf_llama_sequence_classification_is_exact(ranks) -> None:
    for rank, r in enumerate(ranks.run(2, _hf_exact, "llama", timeout=300)):
        assert r["loss"] <= 1e-5 and r["logits"] <= 1e-5 and r["grads"] <= 1e-5, (rank, r)
        assert r["same_record"] and r["fallbacks"] == [], (rank, r)
