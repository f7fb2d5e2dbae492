"""Every way of writing attention by hand is found: fused into the ring, or named in a WARNING
(issue 25 item 3; passes/attention_match.py, passes/fuse_attention.py, passes/unsplit.py).

One process, no ranks: each form's Dynamo graph is fused (:func:`fuse_attention`) and the fused
graph, run eagerly in float64, must give the original module's output and input gradients; the
fused graph must hold one SDPA and no softmax. Forms that cannot be fused must be listed by the
detector (``ctx.unsplit``, a WARNING), in graphs with and without other attention. A few forms
then run on 2 ranks end to end. Non-attention softmaxes (vocabulary, experts) are not flagged.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Tuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from checks import cp_compile_warnings, rel
from cp_compile.passes.op_vocab import SDPA_TARGETS

B, H, S, D = 2, 4, 16, 8
TOL = 1e-10  # float64: the fused graph is the same function up to rounding
ROUNDED = {"softcapped": 1e-6}  # forms whose softmax runs in float32 (Gemma 2's): fused SDPA keeps float64


def _qkv(x: torch.Tensor, w: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """(B, H, S, D) q, k, v from x (B, S, H·D) and a (H·D, 3·H·D) weight."""
    q, k, v = (x @ w).chunk(3, dim=-1)
    return tuple(t.view(B, S, H, D).transpose(1, 2) for t in (q, k, v))


def _causal() -> torch.Tensor:
    return torch.triu(torch.ones(S, S, dtype=torch.bool), 1)  # True = masked


def _alibi() -> torch.Tensor:
    pos = torch.arange(S)
    slopes = 2.0 ** (-8.0 / H * torch.arange(1, H + 1, dtype=torch.float64))
    return slopes[:, None, None] * (pos[None, :] - pos[:, None]).to(torch.float64)  # (H, S, S)


# Each form: (B, S, H·D) x, weights -> (B, S, H·D) output; the attention is written differently in each.
def matmul_scale(q, k, v, p):
    return torch.softmax(q @ k.transpose(-2, -1) * D ** -0.5, dim=-1) @ v


def matmul_mt_div(q, k, v, p):
    w = F.softmax(torch.matmul(q, k.mT) / math.sqrt(D), dim=-1)
    return torch.matmul(w, v)


def scale_before(q, k, v, p):
    return (q * D ** -0.5 @ k.transpose(-1, -2)).softmax(-1) @ v


def scale_after_bias(q, k, v, p):  # the bias is scaled with the scores
    s = (q @ k.transpose(-2, -1) + _alibi()) * 0.5
    return s.masked_fill(_causal(), float("-inf")).softmax(-1) @ v


def bias_minus_and_where(q, k, v, p):
    s = q @ k.transpose(-2, -1) / 3.0 - _alibi().abs()
    s = torch.where(~_causal(), s, torch.finfo(s.dtype).min)
    return torch.softmax(s, dim=-1) @ v


def einsum_heads_first(q, k, v, p):
    w = torch.einsum("bhqd,bhkd->bhqk", q, k).mul(D ** -0.5).softmax(-1)
    return torch.einsum("bhqk,bhkd->bhqd", w, v)


def einsum_heads_last(q, k, v, p):  # q, k, v as (B, S, H, D): the product permutes
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    w = torch.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
    w = w.masked_fill(_causal(), -1e9).softmax(dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", w, v).transpose(1, 2)


def bmm_merged_heads(q, k, v, p):  # (B·H, S, D), scores viewed to (B, H, S, S) for the mask
    q3, k3, v3 = (t.reshape(B * H, S, D) for t in (q, k, v))
    s = torch.bmm(q3, k3.transpose(1, 2)).view(B, H, S, S) * D ** -0.5
    s = s + _causal().to(s.dtype) * -1e30
    w = F.softmax(s, dim=-1, dtype=torch.float64).view(B * H, S, S)
    return torch.bmm(w, v3).view(B, H, S, D)


def baddbmm_bias(q, k, v, p):  # BLOOM: alibi (B·H, 1, S) as baddbmm's input
    q3, v3 = q.reshape(B * H, S, D), v.reshape(B * H, S, D)
    kt = k.reshape(B * H, S, D).transpose(-1, -2)
    alibi = (_alibi()[None, :, -1:, :]).expand(B, H, 1, S).reshape(B * H, 1, S)
    s = alibi.baddbmm(batch1=q3, batch2=kt, beta=1.0, alpha=D ** -0.5).view(B, H, S, S)
    s = s.masked_fill(_causal(), torch.finfo(s.dtype).min)
    w = F.softmax(s, dim=-1, dtype=torch.float64).to(q.dtype)
    return torch.bmm(w.view(B * H, S, S), v3).view(B, H, S, D)


def single_head_3d(q, k, v, p):
    q3, k3, v3 = (t.reshape(B * H, S, D) for t in (q, k, v))
    w = torch.softmax(torch.matmul(q3, k3.transpose(1, 2)) / D ** 0.5, dim=-1)
    return torch.matmul(w, v3).view(B, H, S, D)


def learned_temperature(q, k, v, p):  # a tensor scale per head (requires grad): multiplies q
    s = (q @ k.transpose(-2, -1)) * p["temperature"]
    return F.dropout(s.softmax(-1), p=0.0, training=True) @ v


def softcapped(q, k, v, p):  # Gemma 2: c · tanh(s / c) of the scaled scores, then the causal mask
    s = torch.matmul(q, k.transpose(2, 3)) * D ** -0.5
    s = torch.tanh(s / 2.0) * 2.0
    s = s + torch.zeros(S, S, dtype=s.dtype).masked_fill(_causal(), torch.finfo(s.dtype).min)
    return F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def output_written_in_place(q, k, v, p):  # Nystromformer: `context_layer += conv(value_layer)`
    out = torch.softmax(q @ k.transpose(-2, -1) * D ** -0.5, dim=-1) @ v
    out += v
    return out


FUSED: Dict[str, Callable] = {f.__name__: f for f in (
    matmul_scale, matmul_mt_div, scale_before, scale_after_bias, bias_minus_and_where, einsum_heads_first,
    einsum_heads_last, bmm_merged_heads, baddbmm_bias, single_head_3d, learned_temperature, softcapped,
    output_written_in_place)}


class Form(nn.Module):
    """x -> projections -> the attention ``form`` -> output; float64."""

    def __init__(self, form: Callable) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.form = form
        self.w = nn.Parameter(torch.randn(H * D, 3 * H * D, dtype=torch.float64) / 8)
        self.temperature = nn.Parameter(torch.rand(H, 1, 1, dtype=torch.float64) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = _qkv(x, self.w)
        out = self.form(q, k, v, {"temperature": self.temperature})  # (B, H, S, D)
        return out.transpose(1, 2).reshape(B, S, H * D)


def _graph(model: nn.Module, x: torch.Tensor) -> torch.fx.GraphModule:
    graphs: List[torch.fx.GraphModule] = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=capture, fullgraph=True)(x)
    assert len(graphs) == 1
    return graphs[0]


def _ctx():
    from cp_compile.group import CPGroup
    from cp_compile.passes.context import RewriteContext

    return RewriteContext(group=CPGroup(pg=None, rank=0, size=2))


def _grads(fn: Callable, x: torch.Tensor, params: List[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    x = x.detach().requires_grad_()
    for p in params:
        p.grad = None
    out = fn(x)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out))
    return (out.detach(), x.grad, *(p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params))


@pytest.mark.parametrize("name", sorted(FUSED))
def test_form_is_fused_into_one_sdpa_with_the_same_values_and_gradients(name: str) -> None:
    from cp_compile.passes.normalize.fuse_attention import fuse_attention

    model = Form(FUSED[name])
    x = torch.randn(B, S, H * D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    gm = _graph(model, x)
    assert fuse_attention(gm, _ctx()) == 1
    targets = [n.target for n in gm.graph.nodes]
    assert sum(t in SDPA_TARGETS for t in targets) == 1, gm.code
    assert not {F.softmax, torch.softmax, "softmax"} & set(targets), gm.code
    params = [model.w, model.temperature]
    # Dynamo's graph takes the parameters as inputs, in the order its placeholders name them
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    by_name = {"w": model.w, "temperature": model.temperature}

    def fused(t: torch.Tensor) -> torch.Tensor:
        args = [t if "x" in n.name.lower() and "self" not in n.name else
                next(p for k, p in by_name.items() if k in n.name) for n in holders]
        return gm(*args)[0]

    want, got = _grads(model, x, params), _grads(fused, x, params)
    for i, (a, b) in enumerate(zip(got, want)):
        if b.abs().max() > 0:
            assert rel(a, b) <= ROUNDED.get(name, TOL), (name, i, rel(a, b))


# -- forms that are attention but cannot be fused: named, never silent ------------------------------
def weights_also_returned(q, k, v, p):
    w = torch.softmax(q @ k.transpose(-2, -1) * D ** -0.5, dim=-1)
    return w @ v + w.mean(-1, keepdim=True)


def logsumexp_form(q, k, v, p):
    s = q @ k.transpose(-2, -1) * D ** -0.5
    return torch.exp(s - torch.logsumexp(s, dim=-1, keepdim=True)) @ v


def learned_bias(q, k, v, p):  # a bias from activations: the ring applies rules of positions and tables only
    return torch.softmax(q @ k.transpose(-2, -1) + q.mean() * _alibi(), dim=-1) @ v


def active_dropout(q, k, v, p):
    return F.dropout(torch.softmax(q @ k.transpose(-2, -1), dim=-1), p=0.1, training=True) @ v


def scale_per_key(q, k, v, p):
    s = q @ k.transpose(-2, -1) * torch.linspace(0.5, 1.0, S, dtype=q.dtype)
    return s.softmax(-1) @ v


UNFUSED = {"weights_also_returned": "also used elsewhere", "logsumexp_form": "logsumexp",
           "learned_bias": "requires grad", "active_dropout": "dropout p=0.1", "scale_per_key": "differs per key"}
FORMS_UNFUSED = {f.__name__: f for f in (weights_also_returned, logsumexp_form, learned_bias, active_dropout,
                                         scale_per_key)}


def _unsplit(model: nn.Module, x: torch.Tensor, **opts) -> Tuple[List[str], List[str]]:
    from cp_compile.tools.explain import explain_model

    torch._dynamo.reset()
    with cp_compile_warnings() as warnings:
        report = explain_model(model, (x,), world_size=2, **opts)
    return report.ctx.unsplit, warnings


@pytest.mark.parametrize("name", sorted(FORMS_UNFUSED))
def test_unfusable_attention_is_named_in_a_warning(name: str) -> None:
    model = Form(FORMS_UNFUSED[name])
    x = torch.randn(B, S, H * D, dtype=torch.float64)
    unsplit, warnings = _unsplit(model, x)
    assert len(unsplit) == 1 and "test_attention_forms.py:" in unsplit[0], unsplit
    assert UNFUSED[name] in unsplit[0], unsplit
    # warned once per process and line; tests/conftest.py resets the warnings before each test
    assert any("attention that ring_cp cannot split" in w and "no context parallelism" in w for w in warnings), warnings
    from cp_compile.passes.context import CPRewriteError
    from cp_compile.tools.explain import explain_model

    torch._dynamo.reset()
    with pytest.raises(CPRewriteError, match="cannot split"):
        explain_model(model, (x,), world_size=2, strict=True)



class Mixed(nn.Module):
    """One SDPA layer (the ring) and one hand-written attention whose weights are also returned."""

    def __init__(self) -> None:
        super().__init__()
        self.a = Form(matmul_scale)
        self.b = Form(weights_also_returned)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = _qkv(x, self.a.w)
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, H * D)
        return self.b(x)


def test_unfusable_attention_next_to_ring_attention_is_named() -> None:
    unsplit, warnings = _unsplit(Mixed(), torch.randn(B, S, H * D, dtype=torch.float64))
    assert len(unsplit) == 1 and "also used elsewhere" in unsplit[0], unsplit


class NotAttention(nn.Module):
    """Softmaxes over a vocabulary (S == V) and over experts: products with a weight, not attention."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(S, 8), nn.Linear(8, S)  # vocabulary of S tokens
        self.router = nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)  # (B, S, 8)
        gate = torch.softmax(self.router(h), dim=-1)  # (B, S, experts)
        probs = torch.softmax(h @ self.head.weight.T, dim=-1)  # (B, S, V = S)
        q = h @ torch.ones(8, 8)
        return F.scaled_dot_product_attention(q[:, None], q[:, None], q[:, None])[:, 0].sum() + probs.sum() \
            + gate.sum()


def test_softmax_over_a_weight_product_is_not_attention() -> None:
    unsplit, _ = _unsplit(NotAttention(), torch.randint(0, S, (B, S)))
    assert unsplit == [], unsplit


# -- end to end on 2 ranks: the forms whose regrouping the ring rewrite must follow ----------------------
def _through_ring_cp(name: str) -> dict:
    import cp_compile

    ref, cp = Form(FUSED[name]), Form(FUSED[name])
    x = torch.randn(B, S, H * D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = _grads(lambda t: ref(t), x, [ref.w, ref.temperature])
    backend = cp_compile.RingCP(inner="aot_eager")
    compiled = torch.compile(cp, backend=backend, fullgraph=True)
    got = _grads(lambda t: compiled(t), x, [cp.w, cp.temperature])
    rings = sum(r.rings for r in backend.records)
    errs = [rel(a, b) for a, b in zip(got, want) if b.abs().max() > 0]
    return {"errs": errs, "rings": rings, "fallbacks": list(backend.fallbacks),
            "unsplit": [u for r in backend.records for u in r.unsplit]}


@pytest.mark.parametrize("name", ["baddbmm_bias", "einsum_heads_last", "learned_temperature", "softcapped"])
def test_fused_forms_are_exact_ring_attention_on_two_ranks(ranks, name: str) -> None:
    for rank, r in enumerate(ranks.run(2, _through_ring_cp, name, timeout=240)):
        assert max(r["errs"]) <= ROUNDED.get(name, TOL) and r["rings"] == 1, (rank, r)
        assert r["fallbacks"] == [] and r["unsplit"] == [], (rank, r)


class Recurrent(nn.Module):
    """No attention at all (a causal convolution language model, as state-space models mix tokens):
    ring_cp cannot split it, and must say so."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)
        self.conv = nn.Conv1d(16, 16, 4, padding=3, groups=16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.conv(self.emb(ids).transpose(1, 2))[..., : ids.shape[1]].transpose(1, 2)  # (B, S, 16)
        return F.cross_entropy(self.head(h).flatten(0, 1), ids.flatten())


def _recurrent_warnings() -> List[str]:
    import cp_compile

    torch.manual_seed(0)
    with cp_compile_warnings() as warnings:
        torch.compile(Recurrent(), backend=cp_compile.RingCP(inner="aot_eager"))(torch.randint(0, 32, (2, S)))
    return warnings


def test_a_model_without_attention_is_warned(ranks) -> None:
    for rank, warnings in enumerate(ranks.run(2, _recurrent_warnings, timeout=240)):
        assert any("found no attention" in w and "ids (2, 16)" in w for w in warnings), (rank, warnings)
