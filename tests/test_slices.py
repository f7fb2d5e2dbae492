"""Slices of the sequence (``h[:, 1:]``, ``h[:, :-1]``, ``x[:, num_prefix_tokens:]``, ``narrow``) stay on the
ranks' shards as *windowed* Sharded values (placements.py, rules/getitem.py): the same local rows, the rows
outside the window masked wherever padding is. Only the window-aware rules read them; any other op gathers
them (warned), exactly.

Each head below runs on the output of a small attention model; on real gloo ranks (N = 2 and 4, lengths
that divide and that are padded) the loss, the returned tensors, every parameter gradient and the input's
gradient match the one-process run on the whole sequence and the record is explain's. The common uses
(ViT pooling without the prefix tokens, an MAE-style loss against a whole target, shifted logits outside a
loss) gather nothing and record no fallback; a neighbour difference ``h[:, 1:] - h[:, :-1]`` (two different
windows) aligns them by a halo exchange (rules/halo.py); the uses no window-aware rule covers (a cumsum
or a matmul over a slice) are gathered, recorded, and still exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from checks import explain_record, grad_errors, graph_summary, rel, twin_models

V, D, B, P = 11, 8, 2, 3


def _w(*shape: int) -> torch.Tensor:
    """Distinct weights, so a value moved to another place changes the loss."""
    n = 1
    for v in shape:
        n *= v
    return torch.linspace(0.5, 1.5, n).view(*shape)


def _vit(m, h, x, ids, tgt, mask):  # timm: average pooling without the prefix tokens, then a head
    s = h.shape[1]
    pooled = h[:, 1:].mean(1)
    rest = h[:, m.num_prefix_tokens:].mean(dim=1)
    mid = h.narrow(1, 1, s - 2).sum(1)
    last = h[:, 1:][:, -1]  # one position of a slice: its owner's row, all-reduced
    heads = h[:, 1:].reshape(B, s - 1, 2, D // 2).sum(-1).mean(1)  # a view keeping the slice's rows: (B, 2)
    out = m.head(F.layer_norm(pooled, (D,))) + m.head(rest) + m.head(mid) + m.head(last) + heads.sum(-1, True)
    return (out * _w(B, V)).sum(), (pooled, h[:, 1:])  # a windowed output: gathered, then narrowed


def _mae(m, h, x, ids, tgt, mask):  # MAE: the patches after the first against a whole target
    pred = m.dec(h)  # (B, S, P)
    per_patch = ((pred[:, 1:] - tgt) ** 2).mean(-1)  # (B, S - 1)
    loss = (per_patch * mask).sum() / mask.sum()
    loss = loss + F.mse_loss(pred[:, 1:], tgt) + ((pred[:, 1:] - x[:, 1:, :P]) ** 2).mean()
    return loss, (per_patch,)


def _logits(m, h, x, ids, tgt, mask):  # shifted logits outside a loss, and the shifted loss itself
    lg = m.out(h)  # (B, S, V)
    p = lg[:, :-1].softmax(-1)
    n = p.shape[1]
    loss = (p * _w(1, n, V)).sum() + F.cross_entropy(lg[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
    loss = loss + F.cross_entropy(lg[:, 1:].transpose(1, 2), (mask * 5).long())  # (B, V, S-1), whole labels
    return loss, (p,)


def _diff(m, h, x, ids, tgt, mask):  # neighbours: h[:, 1:] pairs position p with p - 1 of h[:, :-1] (a halo)
    d = h[:, 1:] - h[:, :-1]
    back = h[:, :-1] * h[:, 1:] * _w(1, h.shape[1] - 1, D)  # the other way round: p with p + 1
    two = h[:, 2:] * h[:, :-2]  # two positions apart
    return (d ** 2).mean() + back.sum() + two.mean(), ()


def _unaware(m, h, x, ids, tgt, mask):  # ops with no window-aware rule: gathered
    a = h[:, 1:]
    c = a.cumsum(1)
    g = a.transpose(1, 2) @ a  # contracts the slice
    one = h[:, 3:4] * _w(1, h.shape[1], 1)  # a window of one position broadcast to S rows
    return (c * _w(1, c.shape[1], D)).sum() + g.square().sum() + one.square().sum(), (c,)


HEADS = {f.__name__[1:]: f for f in (_vit, _mae, _logits, _diff, _unaware)}
GATHERED = {"unaware": "window-aware rule"}  # head -> what its fallback says
OUTPUT_GATHERS = {"vit": 1, "mae": 1, "logits": 1, "diff": 0}  # windowed tensors returned (gathered)


class Slices(nn.Module):
    """Token embedding plus a float input, one causal attention, then a head on slices of the sequence."""

    num_prefix_tokens = 2

    def __init__(self, head: str) -> None:
        super().__init__()
        self.emb, self.qkv = nn.Embedding(V, D), nn.Linear(D, 3 * D)
        self.head, self.dec, self.out = nn.Linear(D, V), nn.Linear(D, P), nn.Linear(D, V)
        self.which = head

    def forward(self, ids, x, tgt, mask):
        b, s = ids.shape
        h = self.emb(ids) + x
        q, k, v = self.qkv(h).view(b, s, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        h = h + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, D)
        return HEADS[self.which](self, h, x, ids, tgt, mask)


def _inputs(s: int) -> tuple:
    g = torch.Generator().manual_seed(s)
    mask = (torch.rand(B, s - 1, generator=g) < 0.7).float()  # MAE's masked patches
    return (torch.randint(0, V, (B, s), generator=g), torch.randn(B, s, D, generator=g),
            torch.randn(B, s - 1, P, generator=g), mask)


def _compare(head: str, s: int) -> dict:
    import torch.distributed as dist

    import cp_compile

    ref_model, cp_model = twin_models(lambda: Slices(head))
    ids, x, tgt, mask = _inputs(s)
    xr, xc = x.clone().requires_grad_(), x.clone().requires_grad_()  # (explain too: a slice of an input
    explained = explain_record(ref_model, (ids, xr, tgt, mask), world_size=dist.get_world_size())  # needing none
    # of a gradient slices the whole input every rank was passed)
    ref, ref_outs = ref_model(ids, xr, tgt, mask)
    ref.backward()
    backend = cp_compile.RingCP(inner="aot_eager")
    out, outs = torch.compile(cp_model, backend=backend, fullgraph=True)(ids, xc, tgt, mask)
    out.backward()
    return {"loss": rel(out.detach(), ref.detach()), "grads": max(grad_errors(cp_model, ref_model).values()),
            "x_grad": rel(xc.grad, xr.grad),
            "outs": max([rel(a.detach(), b.detach()) for a, b in zip(outs, ref_outs)], default=0.0),
            "n_outs": (len(outs), len(ref_outs)), "same_record": backend.records == [explained],
            "fallbacks": list(backend.fallbacks), "gathers": graph_summary(backend)["gather_seq"]}


def _compare_all(lengths: tuple) -> dict:
    with torch._dynamo.config.patch(cache_size_limit=64):  # one model per head and length: recompiles (restored)
        return {(head, s): _compare(head, s) for s in lengths for head in HEADS}


@pytest.mark.slow
@pytest.mark.parametrize("world, lengths", [(2, (16, 21)), (4, (15,))])
def test_slices_are_exact_and_gather_only_without_a_window_aware_rule(ranks, world: int, lengths: tuple) -> None:
    per_rank = ranks.run(world, _compare_all, lengths, timeout=300)
    worst = {k: max(r[k] for results in per_rank for r in results.values())
             for k in ("loss", "grads", "x_grad", "outs")}
    print(f"world {world}, lengths {lengths}: worst relative errors {worst}")  # (for the report; asserted below)
    for rank, results in enumerate(per_rank):
        for (head, s), r in results.items():
            case = (rank, head, s, r)
            assert r["loss"] <= 1e-5 and r["grads"] <= 1e-5 and r["x_grad"] <= 1e-5, case
            assert r["outs"] <= 1e-5 and r["n_outs"][0] == r["n_outs"][1], case
            assert r["same_record"], case
            if head in GATHERED:
                assert any(GATHERED[head] in f for f in r["fallbacks"]) and r["gathers"] > 0, case
            else:
                assert r["fallbacks"] == [] and r["gathers"] == OUTPUT_GATHERS[head], case


def _explain(head: str, world: int, s: int = 15, **options):
    from cp_compile.tools.explain import explain_model

    torch.manual_seed(0)
    return explain_model(Slices(head), _inputs(s), world_size=world, **options)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("head", sorted(set(HEADS) - set(GATHERED)))
def test_explain_shows_no_gather(head: str, world: int) -> None:
    r = _explain(head, world)
    assert r.ctx.record.fallbacks == [], r.ctx.record.fallbacks
    gathers = [n for n in r.after.graph.nodes if "gather_seq" in str(n.target)]
    assert len(gathers) == OUTPUT_GATHERS[head], r.after.code  # only the windowed outputs'
    for g in gathers:  # each feeds the output only (through the narrow to its window)
        assert [u.target for u in g.users] == ["narrow"], r.after.code


@pytest.mark.parametrize("head", sorted(GATHERED))
def test_a_consumer_without_a_window_aware_rule_is_gathered_and_warned(head: str) -> None:
    r = _explain(head, 2)
    assert any(GATHERED[head] in f for f in r.ctx.record.fallbacks), r.ctx.record.fallbacks


def test_each_unaware_consumer_is_named_and_a_slice_is_gathered_once() -> None:
    r = _explain("unaware", 4)
    fallbacks = r.ctx.record.fallbacks
    for what in ("cumsum of a slice", "matmul of a slice", "broadcast along its own dim"):
        assert any(what in f for f in fallbacks), (what, fallbacks)
    gathers = [n for n in r.after.graph.nodes if "gather_seq" in str(n.target)]
    assert len(gathers) == 3, r.after.code  # h[:, 1:] once for its cumsum and its matmul, its transpose, h[:, 3:4]


def test_different_windows_without_contiguous_runs_are_gathered() -> None:
    """Striped: no runs to exchange halos between, so h[:, 1:] - h[:, :-1] is gathered (warned)."""
    r = _explain("diff", 4, load_balance="striped")
    assert any("different windows" in f and "striped" in f for f in r.ctx.record.fallbacks), r.ctx.record.fallbacks


def test_a_symbolic_length_gathers_the_slice() -> None:
    """Windows need a static S (their positions are constants): under dynamic=True the slice is gathered."""
    r = _explain("vit", 2, dynamic=True)
    assert any("slicing the sequence dim" in f for f in r.ctx.record.fallbacks), r.ctx.record.fallbacks
