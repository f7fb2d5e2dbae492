"""DeepSeek-style attention pieces under ring_cp (Hugging Face's DeepseekV3 writes them this way).

* keys assembled in a fresh buffer: ``k = kv.new_empty(..., D_qk)``, ``k[..., :n].copy_(k_nope)``,
  ``k[..., n:].copy_(k_rot)`` -> the buffer made at the local length, the copies per token
  (passes/rules/fill.py), no gather;
* V with another head dim than Q/K (MLA: D_v < D_qk) -> the ring on zero-padded heads, the output
  sliced back (passes/rules/attention.py);
* a group mask written in place along the groups (``mask.scatter_(1, idx, 1)``): per token (the
  oracle), no gather; then written in place along the sequence (``mask.cumsum_(1)``, which mixes
  tokens): gathered, and later readers of ``mask`` read the written rows (passes/emitter.py); that
  write into a view of a sharded value is refused by name.
Loss and every gradient against one process on 2 ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cp_compile
from checks import AttentionCount, grad_errors, rel, ring_mismatches
from cp_compile.errors import CPRewriteError
from cp_compile.tools.explain import explain_model

S, B, VOCAB, DIM, H, NOPE, ROPE, DV, GROUPS = 32, 2, 61, 32, 2, 8, 8, 4, 4


class MLA(nn.Module):
    def __init__(self, view_write: bool = False) -> None:
        super().__init__()
        self.view_write = view_write
        self.emb, self.head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB)
        self.q = nn.Linear(DIM, H * (NOPE + ROPE))
        self.kv = nn.Linear(DIM, H * (NOPE + DV))
        self.k_rot = nn.Linear(DIM, ROPE, bias=False)  # a key bias has a zero gradient (softmax shift)
        self.o = nn.Linear(H * DV, DIM)
        self.gate = nn.Linear(DIM, GROUPS)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, H, NOPE + ROPE).transpose(1, 2)  # (B, H, S, D_qk)
        kv = self.kv(x).view(b, s, H, NOPE + DV).transpose(1, 2)
        k_nope, v = torch.split(kv, [NOPE, DV], dim=-1)  # v: (B, H, S, D_v), D_v < D_qk
        k_rot = self.k_rot(x).view(b, 1, s, ROPE).expand(-1, H, -1, -1)
        k = k_nope.new_empty(*k_nope.shape[:-1], NOPE + ROPE)
        k[..., :NOPE].copy_(k_nope)
        k[..., NOPE:].copy_(k_rot)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, S, D_v)
        return self.o(out.transpose(1, 2).reshape(b, s, H * DV))

    def gated(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.gate(x).sigmoid()  # (B, S, G)
        idx = scores.topk(2, dim=-1).indices
        if self.view_write:
            scores[..., :2].cumsum_(1)  # mixes tokens, in place on a view: refused
            return x * scores.sum(-1, keepdim=True)
        mask = torch.zeros_like(scores)
        mask.scatter_(-1, idx, 1.0)  # per token: on this rank's rows
        mask.cumsum_(1)  # mixes tokens: runs on the gathered mask, whose rows later readers see
        return x * (scores * mask).sum(-1, keepdim=True)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.attend(h)
        return F.cross_entropy(self.head(self.gated(h)).flatten(0, 1), labels.flatten())


def _inputs():
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(3))
    return ids, torch.roll(ids, -1, 1)


def _rank_errors() -> dict:
    torch.manual_seed(0)
    ref = MLA()
    cp, args = copy.deepcopy(ref), _inputs()
    with AttentionCount() as count:
        want = ref(*args)
    want.backward()
    backend = cp_compile.RingCP(inner="aot_eager")
    got = torch.compile(cp, backend=backend, fullgraph=True)(*args)
    got.backward()
    return {"loss": rel(got.detach(), want.detach()), "grad": max(grad_errors(cp, ref).values()),
            "fallbacks": [f for r in backend.records for f in r.fallbacks],
            "rings": ring_mismatches(backend, count.calls)}


def test_mla_keys_padded_heads_and_an_in_place_gathered_write_are_exact(ranks):
    for r in ranks.run(2, _rank_errors, timeout=300):
        assert r["loss"] <= 1e-6 and r["grad"] <= 1e-5 and not r["rings"], r
        assert len(r["fallbacks"]) == 1 and "cumsum_" in r["fallbacks"][0], r["fallbacks"]  # not scatter_/copy_


def test_assembled_keys_need_no_gather_and_v_is_padded_to_the_key_head_dim():
    torch.manual_seed(0)
    report = explain_model(MLA(), _inputs(), world_size=2)
    nodes = list(report.after.graph.nodes)
    new_empty = next(n for n in nodes if n.target == "new_empty")
    assert S not in new_empty.args[1]  # (B, H, size(kv_nope, 2), D_qk): made at the local length
    assert not any(n.target == "copy_" and "gather" in str(n.args[0].target) for n in nodes)
    ring = next(n for n in nodes if "ring_attention_fwd" in str(n.target))
    pads = [n for n in nodes if n.target is F.pad]
    assert ring.args[2] in pads and len(pads) == 1  # only V is padded (D_v < D_qk)


def test_an_unruled_in_place_write_into_a_view_of_a_sharded_value_is_refused():
    torch.manual_seed(0)
    with pytest.raises(CPRewriteError, match=r"cumsum_ at .*test_mla.py:\d+.*view of a sequence-sharded.*Fix:"):
        explain_model(MLA(view_write=True), _inputs(), world_size=2)
