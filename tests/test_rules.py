"""The layout rules, one table row at a time, through the rewrite ``cp-compile explain`` runs
(no process group, a synthetic CP group of 2: ``cp_compile.tools.explain.inspect``).

Each row is an op on the sequence-sharded input x (B, S, D) = (2, 16, 8) before an attention.
The row names the rule module that must handle it (so a rule moving to the oracle, or the
fallback, is noticed), the op's node in the rewritten graph and its per-rank shape there
(c = S / 2 = 8 rows). No row may gather the sequence.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cp_compile.passes.propagate.rules import RULES
from cp_compile.passes.propagate.rules.common import _key
from cp_compile.tools.explain import explain_model

S, D, C = 16, 8, 8


class _Op(nn.Module):
    def __init__(self, op: Callable) -> None:
        super().__init__()
        self.op = op
        self.qkv = nn.Linear(D, 3 * D)
        self.w = nn.Parameter(torch.randn(D, D) * 0.3)
        self.table = nn.Parameter(torch.randn(S, D))  # one row per position

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.op(self, x)  # (B, S, D)
        q, k, v = self.qkv(h).view(2, S, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


# name: (op, rule module, node target in the graph, its per-rank shape)
ROWS: dict = {
    "pointwise_with_table": (lambda m, x: x * 2 + m.table, "pointwise", operator.add, (2, C, D)),
    "per_token_layer_norm": (lambda m, x: F.layer_norm(x, (D,)), "pointwise", F.layer_norm, (2, C, D)),
    "matmul_rows": (lambda m, x: x @ m.w, "pointwise", operator.matmul, (2, C, D)),
    # tokens in a batch dim, with a whole operand holding a matrix per position (DeepSeek's DSA indexer)
    "matmul_batch_tokens": (lambda m, x: x * (x.unsqueeze(-2) @ m.table[:, :, None]).squeeze(-1), "pointwise",
                            operator.matmul, (2, C, 1, 1)),
    "view_baked_length": (lambda m, x: x.view(2, S, 2, D // 2).reshape(2, S, D), "views", "view", (2, C, 2, D // 2)),
    "transpose": (lambda m, x: x.transpose(1, 2).transpose(1, 2), "views", "transpose", (2, D, C)),
    "expand_then_sum_features": (lambda m, x: x[:, :, None].expand(2, S, 2, D).sum(2), "views", "expand",
                                 (2, C, 2, D)),
    "chunk_cat_features": (lambda m, x: torch.cat(x.chunk(2, dim=-1)[::-1], dim=-1), "views", torch.cat, (2, C, D)),
    "getitem_features": (lambda m, x: x[..., : D // 2].repeat(1, 1, 2), "getitem",
                         operator.getitem, (2, C, D // 2)),
    "mean_over_sequence": (lambda m, x: x + x.mean(1, keepdim=True), "reductions", "mean", (2, 1, D)),  # Global
    "einsum": (lambda m, x: torch.einsum("bsd,de->bse", x, m.w), "einsum", torch.einsum, (2, C, D)),
    "complex_views": (lambda m, x: torch.view_as_real(torch.view_as_complex(x.view(2, S, D // 2, 2))).view(2, S, D),
                      "complex", torch.view_as_complex, (2, C, D // 2)),
}


def _rewrite(op: Callable) -> Any:
    torch.manual_seed(0)
    return explain_model(_Op(op), (torch.randn(2, S, D),), world_size=2)


def _node(gm: torch.fx.GraphModule, target: Any) -> torch.fx.Node:
    """The first node calling ``target`` (the op under test comes before the attention's own ops)."""
    found = [n for n in gm.graph.nodes
             if ((n.op == "call_method" and n.target == target) or (n.op == "call_function" and n.target is target))
             and not (target is operator.getitem and n.args[0].op == "placeholder" and "x" not in n.args[0].name)]
    assert found, f"no {target} in the graph"
    return found[0]


def _result(report: Any, original: torch.fx.Node) -> torch.fx.Node:
    """What ``original`` became: its copy (its global value kept in ``cp_global_val``, or at least its name), or for
    a reduction over the sequence the all-reduce of the local sums that replaces it."""
    from cp_compile import graph_ops

    ex = original.meta["example_value"]
    copies = [n for n in report.after.graph.nodes if n.meta.get("cp_global_val") is ex and n.op != "placeholder"]
    named = [n for n in report.after.graph.nodes if n.name == original.name]
    return (copies or named or [_node(report.after, graph_ops.all_reduce_sum)])[0]


@pytest.mark.parametrize("name", sorted(ROWS))
def test_rule_row(name: str) -> None:
    op, module, target, local = ROWS[name]
    report = _rewrite(op)
    assert report.ctx.fallbacks == [], report.ctx.fallbacks
    original = _node(report.before, target)
    node = _result(report, original)
    assert tuple(node.meta["val"].shape) == local, (name, tuple(node.meta["val"].shape))
    rule = RULES[_key(original)]
    assert rule.__module__ == f"cp_compile.passes.propagate.rules.{module}", (name, rule.__module__)


def test_rows_cover_every_rule_module() -> None:
    """Every module of the rules package that holds rules has a row here (attention and the
    losses (losses.py) are covered by every model test, FlexAttention by tests/test_flex_attention.py, the
    data-dependent selections of MoE routing by tests/test_zoo_moe.py, fresh buffers (new_empty,
    copy_) by tests/test_mla.py, custom autograd functions below, torch.vmap's batch dims by
    tests/test_dead_code.py; the table itself has no rule of its own)."""
    modules = {fn.__module__.rsplit(".", 1)[1] for fn in RULES.values()}
    covered: Tuple[str, ...] = tuple(row[1] for row in ROWS.values())
    assert modules - set(covered) <= {"attention", "losses", "flex", "routing", "fill", "autograd_fn",
                                            "vmap"}, modules - set(covered)


class _TanhGelu(torch.autograd.Function):
    """A per-token activation with a hand-written backward (Hugging Face BLOOM's GeLU)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        return g * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * 0.79788456 * (1 + 3 * 0.044715 * x * x))


class _RunningSum(torch.autograd.Function):
    """Mixes tokens (a cumulative sum over the sequence): not per-token, so gathered."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.cumsum(1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g.flip(1).cumsum(1).flip(1)


@pytest.mark.parametrize("fn,per_token", [(_TanhGelu, True), (_RunningSum, False)])
def test_custom_autograd_function(fn: Any, per_token: bool) -> None:
    """autograd_fn.py: a Function whose forward and backward are per-token runs on the shards; one
    that mixes tokens is gathered (warned), never run on the shards."""
    report = _rewrite(lambda m, x: fn.apply(x @ m.w))  # an input that needs grad: Dynamo keeps the Function
    apply = torch.ops.higher_order.autograd_function_apply
    (node,) = [n for n in report.after.graph.nodes if n.target is apply]
    assert (report.ctx.fallbacks == []) is per_token, report.ctx.fallbacks
    assert tuple(node.meta["val"][0].shape) == ((2, C, D) if per_token else (2, S, D))
