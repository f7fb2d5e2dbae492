"""Masks held in module buffers (nanoGPT's ``bias``) are classified from their values at compile time.

cp_compile/passes/analyze/masks/buffers.py evaluates a mask term that reads only constants and
gradient-free state once, on the real buffer, and compares it with a band: nanoGPT's
``tril`` buffer becomes the ring op's ``causal=True`` with no attention-mask tensor (it
was an explicit c x S mask per rank). Each case compiles a small GPT unchanged and
compares, on gloo ranks, its loss and every parameter gradient with the same model run
eagerly in one process on the full sequence (fp32, relative error <= 1e-5), and reads
the ring op's arguments off the rewritten graph:

- nanoGPT's hand-written attention, ``masked_fill(bias[:, :, :T, :T] == 0, -inf)`` of a
  float ``tril`` buffer (static, and dynamic=True where T is symbolic);
- SDPA with a bool ``tril`` buffer as ``attn_mask``; a bool band buffer (a causal sliding
  window of 4);
- a random bool buffer (diagonal kept): no band, so it stays an explicit mask, still exact.

Then, in one process (the rewrite's decision only, as ``cp-compile explain`` traces it): a
float buffer cast with ``.bool()``, an additive 0 / -inf buffer, an all-True one, a buffer
term ANDed with a graph-built one, a buffer the graph writes to (not trusted: explicit), a
bool buffer written into a fresh float mask as nn.MultiheadAttention does, a learned bias
(still refused), and the band comparison on its own.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

TOL = 1e-5
MAX_LEN, VOCAB, DIM, HEADS = 64, 50, 32, 4
RING = "ring_attention_fwd"


def _buffer(style: str) -> torch.Tensor:
    """The (1, 1, MAX_LEN, MAX_LEN) mask buffer of ``style``."""
    ones = torch.ones(MAX_LEN, MAX_LEN)
    if style in ("sdpa", "window", "random"):
        ones = ones.bool()
    mask = {"window": lambda: ones.tril() & ~ones.tril(-4),  # 0 <= q - kv < 4
            "random": lambda: (torch.rand(MAX_LEN, MAX_LEN, generator=torch.Generator().manual_seed(3)) < 0.5)
            | torch.eye(MAX_LEN, dtype=torch.bool)}.get(style, ones.tril)()
    return mask.view(1, 1, MAX_LEN, MAX_LEN)


class _Block(nn.Module):
    """nanoGPT's CausalSelfAttention + MLP; the attention as ``style`` writes it."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.style = style
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.c_attn, self.c_proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.fc1, self.fc2 = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)
        self.register_buffer("bias", _buffer(style))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        T = q.size(-2)  # q, k, v (B, H, T, Dh)
        if self.style == "nanogpt":
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            return F.softmax(att, dim=-1) @ v
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias[:, :, :T, :T])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, HEADS, C // HEADS).transpose(1, 2) for t in (q, k, v))
        x = x + self.c_proj(self.attention(q, k, v).transpose(1, 2).reshape(B, T, C))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, style: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(MAX_LEN, DIM)
        self.blocks = nn.ModuleList(_Block(style) for _ in range(2))
        self.ln, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.ln(x)).flatten(0, 1), labels.flatten())


def _batch(S: int) -> tuple:
    """(idx, labels) of length ``S``, the same on every rank."""
    g = torch.Generator().manual_seed(S)
    return tuple(torch.randint(0, VOCAB, (2, S), generator=g) for _ in range(2))


def _case(style: str, lengths: tuple, dynamic: bool) -> dict:
    """Errors of ring_cp against one process over ``lengths`` (one compile), and the ring ops' args."""
    import torch.distributed as dist

    import cp_compile
    from checks import AttentionCount, explain_record, grad_errors, rel, ring_mismatches

    torch._dynamo.reset()
    ref_model, cp_model = TinyGPT(style), TinyGPT(style)
    explained = explain_record(ref_model, _batch(lengths[0]), world_size=dist.get_world_size(), dynamic=dynamic)
    backend = cp_compile.RingCP(inner="aot_eager")
    compiled = torch.compile(cp_model, backend=backend, fullgraph=True, dynamic=dynamic or None)
    loss_err = grad_err = 0.0
    for S in lengths:
        idx, labels = _batch(S)
        for m in (ref_model, cp_model):
            m.zero_grad(set_to_none=True)
        with AttentionCount() as count:
            ref = ref_model(idx, labels)
        ref.backward()
        loss = compiled(idx, labels)
        loss.backward()
        grad_err = max([grad_err, *grad_errors(cp_model, ref_model).values()])
        loss_err = max(loss_err, rel(loss.detach(), ref.detach()))
    assert backend.records == [explained], (style, backend.records, explained)  # explain says what the runtime did
    rings = [n for gm in backend.graphs for n in gm.graph.nodes if RING in str(n.target)]
    return {"loss": loss_err, "grad": grad_err, "fallbacks": list(backend.fallbacks), "graphs": len(backend.graphs),
            "rings": [(n.args[3], n.kwargs.get("window", -1), "attn_mask" in n.kwargs) for n in rings],
            "ring_mismatches": ring_mismatches(backend, count.calls)}


def _cases(cases: list) -> dict:
    """Every case on this rank, one after the other (one pool task: the rank start-up is paid once)."""
    return {name: _case(*args) for name, args in cases}


CAUSAL, WINDOW_4, EXPLICIT = (True, -1, False), (True, 4, False), (False, -1, True)
# name -> (style, lengths, dynamic), the ring op's (causal, window, attn_mask given)
CASES = {
    "nanogpt": (("nanogpt", (32,), False), CAUSAL),
    "nanogpt-padded-dynamic": (("nanogpt", (32, 30), True), CAUSAL),  # T symbolic; 30 is padded by the rewrite
    "sdpa-bool-buffer": (("sdpa", (32,), False), CAUSAL),
    "window-buffer": (("window", (32,), False), WINDOW_4),
    "random-buffer": (("random", (32,), False), EXPLICIT),
}
WORLD_CASES = {2: list(CASES), 4: ["nanogpt", "sdpa-bool-buffer", "random-buffer"]}


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(WORLD_CASES))
def test_buffer_masks_are_exact_and_causal_masks_are_the_flag(ranks, world: int) -> None:
    todo = [(name, CASES[name][0]) for name in WORLD_CASES[world]]
    for rank, results in enumerate(ranks.run(world, _cases, todo, timeout=300)):
        for name, r in results.items():
            assert r["loss"] <= TOL and r["grad"] <= TOL, (world, rank, name, r)
            assert r["graphs"] == 1 and r["fallbacks"] == [], (world, rank, name, r)
            assert r["rings"] == [CASES[name][1]] * 2 and not r["ring_mismatches"], (world, rank, name, r)


# -- one process: what the rewrite decides (cp-compile explain's trace, no process group) --------
class _OneLayer(nn.Module):
    """SDPA whose attn_mask is ``mask_fn(self, T)``; ``bias`` a buffer or a parameter."""

    def __init__(self, bias: torch.Tensor, mask_fn, parameter: bool = False) -> None:
        super().__init__()
        self.qkv, self.mask_fn = nn.Linear(16, 48), mask_fn
        if parameter:
            self.bias = nn.Parameter(bias)
        else:
            self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, 2, 8).permute(2, 0, 3, 1, 4)  # 3 x (B, 2, T, 8)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask_fn(self, T))
        return out.square().mean()


def _ring_args(model: nn.Module) -> list:
    from cp_compile.tools.explain import explain_model

    report = explain_model(model, (torch.randn(2, 16, 16),), world_size=2)
    return [(n.args[3], n.kwargs.get("window", -1), "attn_mask" in n.kwargs)
            for n in report.after.graph.nodes if RING in str(n.target)]


def _mutated(self: nn.Module, T: int) -> torch.Tensor:
    self.bias.mul_(1.0)  # written in the graph: the value at compile time is not trusted
    return self.bias[:T, :T].bool()


def _canonical(self: nn.Module, T: int) -> torch.Tensor:
    """What nn.MultiheadAttention makes of a bool mask (True = masked): written into a fresh tensor."""
    masked = self.bias[:T, :T]
    return torch.zeros_like(masked, dtype=torch.float32).masked_fill_(masked, float("-inf"))


ADDITIVE = torch.full((MAX_LEN, MAX_LEN), float("-inf")).triu(1)  # 0 on and below the diagonal
ONE_LAYER = {  # name -> (buffer, attn_mask, the ring op's args)
    "float-cast-to-bool": (torch.ones(1, 1, MAX_LEN, MAX_LEN).tril(), lambda self, T: self.bias[:, :, :T, :T].bool(),
                           CAUSAL),
    "additive-causal": (ADDITIVE, lambda self, T: self.bias[:T, :T], CAUSAL),  # float 0 / -inf, 2-D
    "all-true": (torch.ones(1, 1, MAX_LEN, MAX_LEN, dtype=torch.bool), lambda self, T: self.bias[..., :T, :T],
                 (False, -1, False)),
    "and-key-term": (torch.ones(MAX_LEN, MAX_LEN).tril(), lambda self, T: (self.bias[:T, :T] > 0)
                     & (torch.arange(T) < T - 3), (True, -1, True)),  # composes with a graph-built term
    "mutated-in-graph": (torch.ones(MAX_LEN, MAX_LEN).tril(), _mutated, EXPLICIT),
    "canonical-mask": (torch.ones(MAX_LEN, MAX_LEN, dtype=torch.bool).triu(1), _canonical, CAUSAL),
}


@pytest.mark.parametrize("name", list(ONE_LAYER))
def test_what_a_buffer_mask_becomes(name: str) -> None:
    bias, mask_fn, ring = ONE_LAYER[name]
    assert _ring_args(_OneLayer(bias.clone(), mask_fn)) == [ring]


def test_a_learned_bias_is_still_refused() -> None:
    from cp_compile.passes.context import CPRewriteError

    with pytest.raises(CPRewriteError, match="requires grad"):
        _ring_args(_OneLayer(ADDITIVE.clamp_min(-1e4).clone(), lambda self, T: self.bias[:T, :T], parameter=True))


def test_band_of_a_pattern() -> None:
    """The comparison itself: a band when the pattern is one, for every batch and head, else None."""
    from cp_compile.passes.analyze.masks.buffers import _band

    ones = torch.ones(6, 6, dtype=torch.bool)
    per_batch = torch.stack([ones.tril(), ones.tril(-1) | torch.eye(6, dtype=torch.bool).flip(0)])[:, None]
    assert _band(ones.tril(), 6) == (None, 0)  # causal
    assert _band(ones.tril() & ~ones.tril(-3), 6) == (-2, 0)  # a causal window of 3
    assert _band(ones[None, None], 6) == (None, None)  # all True: no mask
    assert _band(ones.tril(1).triu(-1), 6) == (-1, 1)  # bidirectional: masks.py makes it explicit
    assert _band(ones.tril()[None].expand(3, 6, 6), 6) == (None, 0)  # the same for every batch
    assert _band(per_batch, 6) is None  # differs by batch
    assert _band(ones.tril() ^ torch.eye(6, dtype=torch.bool).roll(1, 0), 6) is None  # holes: no band
    assert _band(torch.ones(1, 6, dtype=torch.bool), 6) == (None, None)  # (1, S): every query alike
