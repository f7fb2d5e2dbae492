"""The rewritten graph holds only what runs: no value without a reader (issue 25 item 4).

A mask that became the ring's causal flag (``nn.Transformer.generate_square_subsequent_mask``:
an (S, S) ``full`` + ``triu``) or a whole value of which only this rank's rows were taken would
otherwise stay in the graph, run on every rank, and count in the record's bytes and in
``cp-compile explain`` (passes/rewrite.py ``_drop_dead_code``).
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from cp_compile.passes.emitter import mutates

VOCAB, DIM, HEADS, SEQ = 64, 32, 4, 16


class CausalEncoderLM(nn.Module):
    """``nn.TransformerEncoder`` with the causal mask nn.Transformer builds, and is_causal=True."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        layer = nn.TransformerEncoderLayer(DIM, HEADS, 2 * DIM, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])  # (S, S) float, -inf above
        x = self.enc(self.emb(tokens), mask=mask, is_causal=True)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten(0, 1))


def _dead(gm: fx.GraphModule) -> list:
    return [n.format_node() for n in gm.graph.nodes
            if n.op in ("call_function", "call_method") and not n.users and not mutates(n)]


def test_no_dead_values_after_the_rewrite() -> None:
    from cp_compile.tools.explain import inspect

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, VOCAB, (2, SEQ), generator=g) for _ in range(2))
    report = inspect(CausalEncoderLM(), (tokens, labels), world_size=2)
    assert report.rewritten and [m.causal for m in report.masks] == [True, True], report.masks
    assert _dead(report.after) == [], _dead(report.after)
    targets = {n.target for n in report.after.graph.nodes}
    assert not targets & {torch.full, torch.triu, "triu", "full"}, sorted(map(str, targets))
    # the record's bytes describe what runs: nothing (S, S) is left to count
    square = [n.name for n in report.after.graph.nodes if isinstance(v := n.meta.get("val"), torch.Tensor)
              and v.dim() >= 2 and v.shape[-1] == v.shape[-2] == SEQ]
    assert square == [], square
