"""Learned, position-indexed attention biases become score rules whose tables train (masks/lift.py).

* T5's bucketed relative bias ``embedding(bucket(kv - q), weight).permute([2, 0, 1]).unsqueeze(0)``
  (a learned (num_buckets, H) table read at a rule of positions), passed as SDPA's attn_mask or added
  to hand-written, unscaled scores (``scores += position_bias``), and learned ALiBi slopes (an
  nn.Parameter (H,) read at the head): the ring op gets a score_mod whose score buffers include the
  learned tensor itself (whole, requiring grad), no explicit S x S or c x S mask, no fallback.
* Exact on 2 and 4 ranks and at a length that does not divide (padding): the loss and every
  gradient, the table's and the slopes' included, within 1e-5 of one process.
* A bias computed from activations is no rule of positions: refused at SDPA, left as written (and
  warned) by hand.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from checks import AttentionCount, grad_errors, rel, ring_mismatches
from cp_compile.passes.context import CPRewriteError
from cp_compile.tools.explain import explain_model
from zoo import alibi, t5_encoder

TOL = 1e-5
S, B, DIM, HEADS = 24, 2, 32, 4
FWD = torch.ops.cp_compile.ring_attention_fwd.default


class T5Layer(nn.Module):
    """One T5 attention (the zoo's bias code) on x (B, S, D): SDPA with the bias as attn_mask, or by hand."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.attn = t5_encoder.T5Attention(DIM, HEADS, has_bias=True)
        with torch.no_grad():
            self.attn.relative_attention_bias.weight.normal_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.form == "scores":
            return self.attn(x)[0].square().mean()
        b, s, _ = x.shape
        q, k, v = (f(x).view(b, s, HEADS, -1).transpose(1, 2) for f in (self.attn.q, self.attn.k, self.attn.v))
        if self.form == "getitem":  # weight[bucket] and two transposes instead of embedding and permute
            pos = torch.arange(s, device=x.device)
            bucket = self.attn._relative_position_bucket(pos[None, :] - pos[:, None], True, self.attn.num_buckets,
                                                         self.attn.max_distance)
            bias = self.attn.relative_attention_bias.weight[bucket].transpose(0, 2).transpose(1, 2)[None]
        else:
            bias = self.attn.compute_bias(s, s, device=x.device)  # (1, H, S, S), requires grad
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)
        return self.attn.o(out.transpose(1, 2).reshape(b, s, -1)).square().mean()


class LearnedAlibi(nn.Module):
    """ALiBi whose slopes are an nn.Parameter (H,): ``slopes[:, None, None] * (k - q)``, causal."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.attn = alibi.AlibiAttention(DIM, HEADS, causal=True, form=form, slopes="buffer", bias="relative")
        del self.attn.slopes
        self.attn.slopes = nn.Parameter(alibi.alibi_slopes(HEADS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x).square().mean()


class ActivationBias(nn.Module):
    """A per-head bias computed from the activations (q's mean): no rule of positions."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form, self.qkv = form, nn.Linear(DIM, 3 * DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        pos = torch.arange(s, device=x.device)
        bias = q.mean(dim=(0, 2, 3))[:, None, None] * (pos[None, :] - pos[:, None])  # (H, S, S)
        if self.form == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None])
        else:
            out = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias, dim=-1) @ v
        return out.square().mean()


def _t5_zoo(seq_len: int = S):
    model, args = t5_encoder.factory(seq_len, batch=B)
    return model, args


MODELS = {
    "t5_sdpa": (lambda: T5Layer("sdpa"), "relative_attention_bias"),
    "t5_scores": (lambda: T5Layer("scores"), "relative_attention_bias"),
    "t5_getitem": (lambda: T5Layer("getitem"), "relative_attention_bias"),
    "alibi_sdpa": (lambda: LearnedAlibi("sdpa"), "slopes"),
    "alibi_scores": (lambda: LearnedAlibi("scores"), "slopes"),
}


def _args(name: str, seq_len: int = S) -> tuple:
    torch.manual_seed(1)
    return (torch.randn(B, seq_len, DIM),)


def _placeholders(node: torch.fx.Node, hops: int = 4) -> set:
    """The graph inputs a buffer of the ring op is, within a few views (and the parameters' gradient sync)."""
    if node.op == "placeholder":
        return {node.name}
    if hops == 0 or node.op not in ("call_function", "call_method"):
        return set()
    return set().union(*(_placeholders(a, hops - 1) for a in node.all_input_nodes))


def _rings(report) -> list:
    return [n for n in report.after.graph.nodes if n.op == "call_function" and n.target is FWD]


@pytest.mark.parametrize("name", list(MODELS))
def test_a_learned_position_bias_becomes_a_score_rule_with_its_table(name: str) -> None:
    make, table = MODELS[name]
    report = explain_model(make(), _args(name), world_size=2)
    rings = _rings(report)
    assert len(rings) == 1 and not report.ctx.record.fallbacks, report.ctx.record.summary()
    ring = rings[0]
    assert "attn_mask" not in ring.kwargs and ring.kwargs.get("mods"), ring.kwargs  # no S x S / c x S mask
    inputs = set().union(*(_placeholders(b) for b in ring.kwargs["score_buffers"]))
    assert any(table in i for i in inputs), inputs  # the learned tensor itself is a score buffer


def test_t5_encoder_shares_one_bias_and_keeps_only_the_padding_row() -> None:
    """The zoo's T5: the bias of layer 0, plus padding, reused by layer 1: both rings read the one table;
    the padding (1 - mask) * min stays a (B, 1, 1, S) key row."""
    model, args = _t5_zoo()
    report = explain_model(model, args, world_size=2)
    rings = _rings(report)
    assert len(rings) == 2 and not report.ctx.record.fallbacks, report.ctx.record.summary()
    for ring in rings:
        inputs = set().union(*(_placeholders(b) for b in ring.kwargs["score_buffers"]))
        assert any("relative_attention_bias" in i for i in inputs), inputs
        mask = ring.kwargs["attn_mask"]
        assert mask.op == "call_method" and mask.target == "expand", mask.format_node()
        assert not report.ctx.masks or all(not k.explicit and len(k.explicit_adds) == 1
                                           for k in report.ctx.masks.values())
        shape = tuple(next(iter(report.ctx.masks.values())).explicit_adds[0].meta["example_value"].shape)
        assert shape == (B, 1, 1, S), shape  # one row for every query: O(B·S)
    assert rings[0].kwargs["score_buffers"] == rings[1].kwargs["score_buffers"]


def test_a_bias_from_activations_is_refused_at_sdpa() -> None:
    with pytest.raises(CPRewriteError, match="requires grad") as err:
        explain_model(ActivationBias("sdpa"), _args("x"), world_size=2)
    assert "test_learned_bias.py:" in str(err.value) and "Fix:" in str(err.value)


def test_a_bias_from_activations_is_left_as_written_by_hand(caplog) -> None:
    with caplog.at_level("WARNING", logger="cp_compile"):
        report = explain_model(ActivationBias("scores"), _args("x"), world_size=2)
    assert not _rings(report) and len(report.ctx.record.unsplit) == 1
    assert "not a rule of positions" in report.ctx.record.unsplit[0], report.ctx.record.unsplit
    assert any("not a rule of positions" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


# -- exactness on real ranks -------------------------------------------------------------------
def _errors(name: str, seq_len: int) -> tuple:
    import cp_compile

    torch._dynamo.reset()
    if name == "t5_encoder":
        (ref, args), (cp, _) = _t5_zoo(seq_len), _t5_zoo(seq_len)
    else:
        make, _ = MODELS[name]
        torch.manual_seed(0)
        ref = make()
        cp = make()
        cp.load_state_dict(ref.state_dict())
        args = _args(name, seq_len)
    with AttentionCount() as count:
        loss_ref = ref(*args)
    loss_ref.backward()
    backend = cp_compile.RingCP(inner="aot_eager")
    loss = torch.compile(cp, backend=backend, fullgraph=True)(*args)
    loss.backward()
    errors = grad_errors(cp, ref)
    learned = max(e for n, e in errors.items() if "relative_attention_bias" in n or n.endswith("slopes"))
    return rel(loss.detach(), loss_ref.detach()), max(errors.values()), learned, ring_mismatches(backend, count.calls)


def _rank_errors(cases: list) -> list:
    return [_hf_errors(name[3:], seq_len) if name.startswith("hf_") else _errors(name, seq_len)
            for name, seq_len in cases]


class HFT5Encoder(nn.Module):
    """Hugging Face's own T5EncoderModel (tiny config of examples/hf_configs.py), a token-level loss."""

    def __init__(self, impl: str) -> None:
        super().__init__()
        from hf_configs import tiny_config
        from transformers import T5EncoderModel

        config = tiny_config("t5")
        config._attn_implementation = impl
        self.model = T5EncoderModel(config)
        self.head = nn.Linear(config.d_model, 7)  # a loss that moves (the final RMS norm fixes mean(h²) near 1)
        with torch.no_grad():  # a bias as large as the unscaled scores, as trained T5s have
            self.model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.normal_()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(hidden).square().mean()


def _hf_errors(impl: str, seq_len: int) -> tuple:
    import cp_compile

    torch._dynamo.reset()
    torch.manual_seed(0)
    ref = HFT5Encoder(impl)
    cp = HFT5Encoder(impl)
    cp.load_state_dict(ref.state_dict())
    ids = torch.randint(0, ref.model.config.vocab_size, (B, seq_len))
    mask = torch.ones(B, seq_len, dtype=torch.long)
    mask[-1, seq_len - seq_len // 4:] = 0
    with AttentionCount() as count:
        loss_ref = ref(ids, mask)
    loss_ref.backward()
    backend = cp_compile.RingCP(inner="aot_eager")
    loss = torch.compile(cp, backend=backend, fullgraph=True)(ids, mask)
    loss.backward()
    errors = grad_errors(cp, ref)
    learned = max(e for n, e in errors.items() if "relative_attention_bias" in n)
    return rel(loss.detach(), loss_ref.detach()), max(errors.values()), learned, ring_mismatches(backend, count.calls)


@pytest.mark.slow
@pytest.mark.parametrize("world,cases", [
    (2, [("t5_sdpa", S), ("t5_getitem", S), ("alibi_scores", S), ("t5_encoder", 40)]),
    (4, [("t5_scores", S), ("alibi_sdpa", S)]),
    (2, [("t5_sdpa", 37), ("alibi_sdpa", 37)]),  # a length that does not divide: padding
], ids=["N2", "N4", "odd"])
def test_learned_biases_are_exact(ranks, world: int, cases: list) -> None:
    for rank, errors in enumerate(ranks.run(world, _rank_errors, cases, timeout=300)):
        for (name, _), (loss, grad, learned, rings) in zip(cases, errors):
            assert loss <= TOL and grad <= TOL and learned <= TOL and not rings, (rank, name, loss, grad, learned,
                                                                                   rings)


@pytest.mark.slow
def test_hf_t5_encoder_model_is_exact(ranks) -> None:
    """transformers' T5EncoderModel, SDPA (``where(mask, position_bias, min)`` as attn_mask) and eager
    (``attn_weights + position_bias`` by hand, then the mask) implementations, with padding: the ring,
    no fallback, exact at N = 2."""
    pytest.importorskip("transformers")
    cases = [("hf_sdpa", S), ("hf_eager", S)]
    for rank, errors in enumerate(ranks.run(2, _rank_errors, cases, timeout=300)):
        for (name, _), (loss, grad, learned, rings) in zip(cases, errors):
            assert loss <= TOL and grad <= TOL and learned <= TOL and not rings, (rank, name, loss, grad, learned,
                                                                                   rings)
