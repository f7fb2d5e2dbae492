"""Attention written by hand becomes the ring (issue 14 item 4; passes/fuse_attention.py).

``softmax(q @ kᵀ * scale + mask) @ v`` as older model code writes it is matched before the
rewrite and replaced by ``scaled_dot_product_attention``, so ring_cp splits it like any
other attention: the loss and every gradient stay the single-process ones, each
hand-written attention is a ring op, and nothing gathers the sequence. When the S x S
weights are used elsewhere the code is left as written and the unsplit warning names it.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from checks import cp_compile_warnings, explain_record, grad_errors, loss_through_ring_cp, rel

TOL = 1e-5


class _CausalBlock(nn.Module):
    """GPT-2 style: fused qkv, 4-D heads, triu bool mask + masked_fill(-inf), dropout(p=0)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.c_attn, self.c_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(0.0)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, H, T, Dh)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        mask = torch.triu(torch.ones(T, T, device=x.device), diagonal=1).bool()
        att = att.masked_fill(mask, float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + self.c_proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class CausalGPT(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 32, heads: int = 4, max_len: int = 64) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(_CausalBlock(dim, heads) for _ in range(2))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.ln(x)).flatten(0, 1), labels.flatten())


class SingleHead(nn.Module):
    """Non-causal 3-D (B, L, D) attention: / sqrt(d), softmax in float32 cast back."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        # no key bias: softmax ignores it, so its gradient is 0 and a relative error would compare rounding noise
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)  # (B, L, D)
        scores = torch.matmul(q, k.transpose(1, 2)) / math.sqrt(q.shape[-1])
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.out(torch.matmul(weights, v)).square().mean()


class PaddedEncoder(nn.Module):
    """Multi-head encoder with an additive key-padding mask input (B, 1, 1, S): -1e9 where padded."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, pad_mask: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        qkv = self.qkv(x).view(B, S, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (B, H, S, Dh)
        scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5 + pad_mask
        y = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(B, S, D)
        return (x + self.proj(y)).square().mean()


class WeightsUsed(nn.Module):
    """Hand-written attention whose S x S weights are also regularised: left as written."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        weights = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1)  # (B, S, S)
        return (weights @ v).square().mean() + weights.square().mean()


def _model(name: str, seq_len: int = 16):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "causal":
        return CausalGPT(), (torch.randint(0, 50, (2, seq_len), generator=g),
                             torch.randint(0, 50, (2, seq_len), generator=g))
    if name == "3-d":
        return SingleHead(), (torch.randn(2, seq_len, 16, generator=g),)
    if name == "padding":
        pad = torch.zeros(2, 1, 1, seq_len)
        pad[1, ..., seq_len - 5:] = -1e9  # the second sequence's last 5 keys are padding
        return PaddedEncoder(), (torch.randn(2, seq_len, 32, generator=g), pad)
    return WeightsUsed(), (torch.randn(2, seq_len, 16, generator=g),)


HAND_WRITTEN = {"causal": 2, "3-d": 1, "padding": 1}  # model -> attentions written by hand


def _compare(name: str) -> dict:
    (ref_model, inputs), (cp_model, _) = _model(name), _model(name)
    ref, out, backend = loss_through_ring_cp(ref_model, cp_model, inputs)
    targets = [n.target for gm in backend.graphs for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    return {
        "loss": rel(out.detach(), ref.detach()),
        "grad": max(grad_errors(cp_model, ref_model).values()),
        "rings": sum(t is torch.ops.cp_compile.ring_attention_fwd.default for t in targets),
        "softmax": sum(t in (F.softmax, torch.softmax, "softmax") for t in targets),
        "fallbacks": list(backend.fallbacks),
        "graphs": len(backend.graphs),
    }


@pytest.mark.slow
@pytest.mark.parametrize("world,name", [(2, "causal"), (4, "causal"), (2, "3-d"), (2, "padding")])
def test_hand_written_attention_becomes_the_ring(ranks, world: int, name: str) -> None:
    for rank, r in enumerate(ranks.run(world, _compare, name, timeout=240)):
        assert r["loss"] <= TOL and r["grad"] <= TOL, (rank, r)
        assert r["graphs"] == 1 and r["rings"] == HAND_WRITTEN[name] and r["softmax"] == 0, (rank, r)
        assert r["fallbacks"] == [], (rank, r)


@pytest.mark.slow
def test_causal_triu_mask_becomes_the_causal_flag() -> None:
    """The triu-built mask is no tensor at all: the ring op gets causal=True and no attn_mask,
    and the S x S mask construction and scores are gone from the rewritten graph."""
    from cp_compile.tools.explain import explain_model

    model, inputs = _model("causal")
    report = explain_model(model, inputs, world_size=2)
    rings = [n for n in report.after.graph.nodes if n.target is torch.ops.cp_compile.ring_attention_fwd.default]
    assert len(rings) == 2
    for ring in rings:
        assert ring.args[3] is True and "attn_mask" not in ring.kwargs, (ring.args, ring.kwargs)
    after = {n.target for n in report.after.graph.nodes}
    assert not after & {torch.triu, torch.ones, F.softmax, "masked_fill"}, after
    assert [(m.call.causal, m.tensors.attn_mask) for m in report.rings] == [(True, None)] * 2, report.rings


def test_fused_sdpa_keeps_the_source_line() -> None:
    """The SDPA that replaces the hand-written attention points at the model's `att @ v` line."""
    from cp_compile.tools.explain import explain_model

    model, inputs = _model("3-d")
    report = explain_model(model, inputs, world_size=2)
    sdpa = [n for n in report.before.graph.nodes if n.target is F.scaled_dot_product_attention]
    assert len(sdpa) == 1 and "torch.matmul(weights, v)" in sdpa[0].meta["stack_trace"], sdpa
    assert sdpa[0].kwargs["scale"] == pytest.approx(0.25) and sdpa[0].kwargs["is_causal"] is False


def _warned(name: str) -> dict:
    (ref_model, inputs), (cp_model, _) = _model(name), _model(name)
    import cp_compile

    with cp_compile_warnings() as warnings:
        backend = cp_compile.RingCP(inner="aot_eager")
        out = torch.compile(cp_model, backend=backend)(*inputs)
    # explain says what the runtime did; asked after it (its warnings, once per line, would come first)
    explained = explain_record(ref_model, inputs, world_size=2)
    assert backend.records == [explained], (backend.records, explained)
    return {"err": rel(out.detach(), ref_model(*inputs).detach()), "graphs": len(backend.graphs),
            "warnings": warnings}


def test_weights_used_elsewhere_stay_as_written(ranks) -> None:
    for rank, r in enumerate(ranks.run(2, _warned, "weights used", timeout=240)):
        assert r["err"] <= TOL and r["graphs"] == 0, (rank, r)  # compiled unchanged: no rewrite
        found = [w for w in r["warnings"] if "attention that ring_cp cannot split" in w]
        assert found and "test_hand_attention.py:" in found[0], (rank, r["warnings"])
