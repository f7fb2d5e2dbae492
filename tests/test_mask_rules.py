"""Every mask the rewrite turns into flags or rules means what the tensor it replaces means
(issue 25 item 1: HF MPT trained with its per-key ALiBi bias read as a boolean mask).

One process: for each mask form a model builds, Dynamo's graph goes through fuse_attention and
find_attention; what the ring op will apply (``MaskKind``: causal flag, window, mask_mod /
score_mod rules with their leaves, explicit terms) is assembled on the whole (S, S) grid the way
the ring evaluates it per rectangle (``ring.mods.Mods``), and attention with it must give the
values and the q/k/v gradients of SDPA with the model's own mask tensor (float64).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

B, H, S, D, L = 2, 4, 16, 8, 40  # L: the length a bias table is built for (MPT: max_seq_len)
TOL = 1e-10


def _pos() -> Tuple[torch.Tensor, torch.Tensor]:
    p = torch.arange(S)
    return p[:, None], p[None, :]  # q (S, 1), kv (1, S)


def _slopes() -> torch.Tensor:
    return 2.0 ** (-8.0 / H * torch.arange(1, H + 1, dtype=torch.float64))  # (H,)


# Each form returns the attn_mask SDPA gets (built in the model, from positions and constants).
def mpt_per_key_bias() -> torch.Tensor:  # slope · (j - (L - 1)) for L keys, sliced to the last S; causal fill
    table = (torch.arange(1 - L, 1, dtype=torch.float64)[None, None, :] * _slopes()[:, None, None])  # (H, 1, L)
    q, kv = _pos()
    return table[:, :, L - S:].masked_fill(kv > q, torch.finfo(torch.float64).min)  # (H, S, S)


def bloom_alibi() -> torch.Tensor:  # slope · key position from a cumsum of ones, (B·H, 1, S) -> (B, H, 1, S)
    pos = torch.ones(B, S).cumsum(-1) - 1
    alibi = (_slopes()[None, :, None] * pos[:, None, :].double()).reshape(B * H, 1, S).view(B, H, 1, S)
    q, kv = _pos()
    return alibi + torch.zeros(S, S, dtype=torch.float64).masked_fill(kv > q, float("-inf"))


def symmetric_alibi() -> torch.Tensor:
    q, kv = _pos()
    return -_slopes()[:, None, None] * (kv - q).abs()  # (H, S, S), no mask


def causal_alibi_where() -> torch.Tensor:
    q, kv = _pos()
    return torch.where(kv <= q, _slopes()[:, None, None] * (kv - q), float("-inf"))


def per_query_bias() -> torch.Tensor:
    q, _ = _pos()
    return (0.1 * q).double().expand(H, S, 1) * _slopes()[:, None, None]  # (H, S, 1): varies along q only


def prefix_lm() -> torch.Tensor:
    q, kv = _pos()
    return (kv <= q) | (kv < 5)


def bidirectional_window() -> torch.Tensor:
    q, kv = _pos()
    return (kv - q).abs() <= 3


def sliding_causal() -> torch.Tensor:
    q, kv = _pos()
    return (kv <= q) & (kv > q - 4)


FORMS: Dict[str, Callable[[], torch.Tensor]] = {f.__name__: f for f in (
    mpt_per_key_bias, bloom_alibi, symmetric_alibi, causal_alibi_where, per_query_bias, prefix_lm,
    bidirectional_window, sliding_causal)}
# what each must become: no mask tensor, the ring's own flags, and rules of positions
EXPECT = {"mpt_per_key_bias": (True, 0, 1), "bloom_alibi": (True, 0, 1), "symmetric_alibi": (False, 0, 1),
          "causal_alibi_where": (True, 0, 1), "per_query_bias": (False, 0, 1), "prefix_lm": (False, 1, 0),
          "bidirectional_window": (False, 1, 0), "sliding_causal": (True, 0, 0)}  # (causal, mask rules, score rules)


class Attn(nn.Module):
    def __init__(self, form: Callable[[], torch.Tensor]) -> None:
        super().__init__()
        self.form = form

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.form())


def _kind(form: Callable[[], torch.Tensor], q, k, v):
    from cp_compile.group import CPGroup
    from cp_compile.passes.context import RewriteContext
    from cp_compile.passes.analyze.find_attention import find_attention
    from cp_compile.passes.normalize.mask_views import distribute_mask_views

    graphs: List[torch.fx.GraphModule] = []
    torch._dynamo.reset()
    torch.compile(Attn(form), backend=lambda gm, ex: graphs.append(gm) or gm.forward, fullgraph=True)(q, k, v)
    ctx = RewriteContext(group=CPGroup(pg=None, rank=0, size=2))
    distribute_mask_views(graphs[0], ctx)  # the pass before find_attention (passes/pipeline.py)
    find_attention(graphs[0], ctx)
    (node,) = ctx.attention
    return ctx.masks[node], node


def _grid(kind, node) -> Tuple[torch.Tensor, torch.Tensor]:
    """(keep, bias) on (B|1, H|1, S, S) as the ring op applies ``kind`` (flags, then rules, then explicit)."""
    from cp_compile.passes.analyze.masks.buffers import real_values
    from cp_compile.passes.analyze.masks.lift import as_mod
    from cp_compile.ring.mods import Mods

    q, kv = _pos()
    keep = torch.ones(1, 1, S, S, dtype=torch.bool)
    if kind.causal:
        keep = keep & (kv <= q)
    if kind.window > 0:
        keep = keep & (q - kv < kind.window)
    bias = torch.zeros(1, 1, S, S, dtype=torch.float64)
    pos = torch.arange(S)
    for rules, additive in ((kind.rules, False), (kind.scores, True)):
        if not rules:
            continue
        leaves = [t.reshape(s) for r in rules for t, s in zip(real_values(list(r.leaves)), r.shapes)]
        b, h = (max(s[i] for r in rules for s in r.shapes) for i in (0, 1))
        if additive:
            mods = Mods(score_mod=as_mod("score", rules, node), score_buffers=tuple(leaves))
            bias = bias + mods.scores(torch.zeros(b, h, S, S, dtype=torch.float64), pos, pos)
        else:
            keep = keep & Mods(mask_mod=as_mod("mask", rules, node), mask_buffers=tuple(leaves)).mask(b, h, pos, pos)
    for term in real_values(list(kind.explicit)) or []:
        if term.dtype is torch.bool:
            keep = keep & term
        else:
            bias = bias + term
    return keep, bias


def _attend(q, k, v, keep, bias) -> torch.Tensor:
    s = q @ k.transpose(-2, -1) * D ** -0.5 + bias
    return torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1) @ v


@pytest.mark.parametrize("name", sorted(FORMS))
def test_mask_as_the_ring_applies_it_is_the_mask_tensor(name: str) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, dtype=torch.float64, generator=g) for _ in range(3))
    kind, node = _kind(FORMS[name], q, k, v)
    assert (kind.causal, len(kind.rules), len(kind.scores)) == EXPECT[name], kind
    assert kind.explicit == (), kind  # every form here is a rule of positions: no mask tensor
    keep, bias = _grid(kind, node)
    outs = []
    for fn in (lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=FORMS[name]()),
               lambda a, b, c: _attend(a, b, c, keep, bias)):
        a, b, c = (t.clone().requires_grad_() for t in (q, k, v))
        out = fn(a, b, c)
        out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out))
        outs.append((out.detach(), a.grad, b.grad, c.grad))
    for i, (got, want) in enumerate(zip(outs[1], outs[0])):
        err = ((got - want).norm() / want.norm()).item()
        assert err <= TOL, (name, ["out", "dq", "dk", "dv"][i], err)


def test_a_rule_that_does_not_compute_its_term_is_not_used(monkeypatch) -> None:
    """The compile-time check (masks/verify.py): a lifted rule whose body is wrong is refused, and
    the term stays an explicit mask (exact); the WARNING names the term."""
    from cp_compile.passes.analyze.masks import lift

    real = lift._Walk._op

    def off_by_one(self, node, shape, roles):  # a body that adds 1 to every value it computes
        out = real(self, node, shape, roles)
        return None if out is None else self.graph.call_function(torch.add, (out, 1))

    monkeypatch.setattr(lift._Walk, "_op", off_by_one)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, dtype=torch.float64, generator=g) for _ in range(3))
    from checks import cp_compile_warnings

    with cp_compile_warnings() as warnings:
        kind, _ = _kind(symmetric_alibi, q, k, v)
    assert not kind.scores and len(kind.explicit) == 1, kind
    assert any("does not compute that term" in w for w in warnings), warnings
