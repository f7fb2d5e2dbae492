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
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from cp_compile import graph_ops
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
    "cumsum_over_sequence": (lambda m, x: x.cumsum(1), "scans", "cumsum", (2, C, D)),  # run totals, no gather
    "einsum": (lambda m, x: torch.einsum("bsd,de->bse", x, m.w), "einsum", torch.einsum, (2, C, D)),
    "local_response_norm": (lambda m, x: F.local_response_norm(x.transpose(1, 2), 3).transpose(1, 2), "pointwise",
                            F.local_response_norm, (2, D, C)),
    "causal_conv_halo": (lambda m, x: F.conv1d(F.pad(x.transpose(1, 2), (2, 0)), m.w[:, :, None].expand(D, D, 3))
                         .transpose(1, 2), "halo", graph_ops.seq_conv1d, (2, D, C)),
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
    """What ``original`` became: its copy (its global value kept in ``facts(node).global_val``, or at least its
    name), or for a reduction over the sequence the all-reduce of the local sums that replaces it."""
    from cp_compile import graph_ops
    from cp_compile.passes.node_facts import facts

    ex = original.meta["example_value"]
    copies = [n for n in report.after.graph.nodes if facts(n).global_val is ex and n.op != "placeholder"]
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
    tests/test_dead_code.py, the order-following reductions (order.py: Global results, no copy of the node
    to find here) by tests/test_order_reads.py; the table itself has no rule of its own)."""
    modules = {fn.__module__.rsplit(".", 1)[1] for fn in RULES.values()}
    covered: Tuple[str, ...] = tuple(row[1] for row in ROWS.values())
    uncovered = modules - set(covered)
    assert uncovered <= {"attention", "losses", "flex", "routing", "fill", "autograd_fn", "vmap", "order",
                             "assoc_scan", "setitem"}, uncovered


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


# ---------------------------------------------------------------------------- the registry, swept op by op
# Each registered target is called once on small inputs, with the sequence (S = 16, 2 ranks, no process
# group) along the dim the layout names; the rule runs on that node alone, and where the rule oracle
# (oracle.decide) also gives a verdict the two must agree on the output's layout. OpInfo-style: one sample
# per target, named by the target, so a new registration without a sample fails test_every_rule_has_a_sample.
B, V = 2, 5
# placeholder name -> (global value, layout); Sharded(d) as the int d, None for Global
_INPUTS: dict = {
    "x": (lambda: torch.randn(B, S, D), 1),
    "x4": (lambda: torch.randn(B, S, 2, D // 2), 1),
    "x1": (lambda: torch.randn(B, S, 1, D), 1),
    "m": (lambda: torch.randn(B, S, D) > 0, 1),
    "ids": (lambda: torch.randint(0, S, (B, S)), 1),
    "rows": (lambda: torch.randn(S, D), 0),
    "mask1": (lambda: torch.arange(S) % 3 == 0, 0),
    "expert": (lambda: torch.randint(0, 4, (S,)), 0),
    "logits": (lambda: torch.randn(S, V), 0),
    "labels": (lambda: torch.randint(0, V, (S,)), 0),
    "q": (lambda: torch.randn(B, 2, S, D), 2),
    "cplx": (lambda: torch.randn(B, S, D // 2, 2), 1),
    "xt": (lambda: torch.randn(B, D, S), 2),  # (B, C, S): the sequence as a convolution's length
    "wconv": (lambda: torch.randn(D, 1, 3) * 0.3, None),  # depthwise, K = 3
    "z": (lambda: torch.randn(B, S, D // 2, dtype=torch.complex64), 1),
    "w": (lambda: torch.randn(D, D) * 0.3, None),
    "w3": (lambda: torch.randn(B, D, D) * 0.3, None),
    "bias": (lambda: torch.randn(D), None),
    "table": (lambda: torch.randn(S, D), None),
    "pos": (lambda: torch.tensor([3, 0, 15, 3]), None),  # positions chosen by data, held whole
    "pos3": (lambda: torch.randint(0, S, (B, 4, D)), None),
}


class _p(str):
    """A sample argument naming a placeholder of _INPUTS."""


_SAMPLES: dict = {  # rule key -> (args, kwargs); _p(name) is the placeholder of that name
    **{k: ((_p("x"), _p("x")), {}) for k in (operator.add, operator.sub, operator.mul, operator.truediv,
                                            operator.floordiv, torch.add, torch.sub, torch.mul, torch.div,
                                            torch.maximum, torch.minimum, torch.polar)},
    **{k: ((_p("x"), 2), {}) for k in (operator.pow, torch.pow)},
    **{k: ((_p("x"),), {}) for k in (operator.neg, torch.neg, torch.rsqrt, torch.sqrt, torch.exp, torch.log,
                                     torch.tanh, torch.sigmoid, torch.sin, torch.cos, torch.abs, torch.square,
                                     F.silu, F.gelu, F.relu, F.sigmoid, F.tanh, F.softplus)},
    torch.clamp: ((_p("x"), -1.0, 1.0), {}),
    torch.masked_fill: ((_p("x"), _p("m"), 0.0), {}),
    F.dropout: ((_p("x"), 0.0), {}),
    torch.where: ((_p("m"), _p("x"), 0.0), {}),
    **{("method", m): ((_p("x"), _p("x")), {}) for m in ("add", "sub", "mul", "div", "type_as", "__add__",
                                                        "__mul__", "__sub__", "__truediv__", "__radd__",
                                                        "__rmul__", "copy_")},
    **{("method", m): ((_p("x"),), {}) for m in ("neg", "rsqrt", "sqrt", "exp", "log", "tanh", "sigmoid", "sin",
                                                  "cos", "abs", "float", "half", "bfloat16", "double", "clone",
                                                  "detach", "square", "contiguous")},
    ("method", "pow"): ((_p("x"), 2), {}),
    ("method", "to"): ((_p("x"), torch.float64), {}),
    ("method", "masked_fill"): ((_p("x"), _p("m"), 0.0), {}),
    ("method", "clamp"): ((_p("x"), -1.0, 1.0), {}),
    **{k: ((_p("x"), _p("w")), {}) for k in (F.linear, torch._C._nn.linear, operator.matmul, torch.matmul,
                                            ("method", "matmul"))},
    **{k: ((_p("x"), _p("w3")), {}) for k in (torch.bmm, ("method", "bmm"))},
    F.embedding: ((_p("ids"), _p("table")), {}),
    F.layer_norm: ((_p("x"), (D,)), {}),
    **{k: ((_p("x"), [D]), {}) for k in (F.rms_norm, torch.rms_norm)},
    **{k: ((_p("x"), -1), {}) for k in (F.softmax, F.log_softmax, ("method", "softmax"), ("method", "log_softmax"))},
    torch.addmm: ((_p("bias"), _p("rows"), _p("w")), {}),
    ("method", "addmm"): ((_p("bias"), _p("rows"), _p("w")), {}),
    ("method", "view"): ((_p("x"), B, S, 2, D // 2), {}),
    ("method", "reshape"): ((_p("x"), (B, S, 2, D // 2)), {}),
    torch.reshape: ((_p("x"), (B, S, 2, D // 2)), {}),
    **{k: ((_p("x4"), 2), {}) for k in (("method", "flatten"), torch.flatten)},
    **{k: ((_p("x1"), 2), {}) for k in (("method", "squeeze"), torch.squeeze)},
    **{k: ((_p("x"), 2), {}) for k in (("method", "unsqueeze"), torch.unsqueeze)},
    **{k: ((_p("x"), 1, 2), {}) for k in (("method", "transpose"), ("method", "swapaxes"), ("method", "swapdims"),
                                          torch.transpose, ("method", "movedim"), torch.movedim)},
    ("method", "permute"): ((_p("x"), 0, 2, 1), {}),
    torch.permute: ((_p("x"), (0, 2, 1)), {}),
    ("method", "t"): ((_p("rows"),), {}),
    ("method", "expand"): ((_p("x1"), B, S, 3, D), {}),
    **{k: ((_p("x"), 2, -1), {}) for k in (("method", "chunk"), ("method", "split"), torch.chunk, torch.split,
                                           ("method", "repeat_interleave"))},
    **{k: ((_p("x"), 0), {}) for k in (("method", "unbind"), torch.unbind)},
    **{k: (([_p("x"), _p("x")], -1), {}) for k in (torch.cat, torch.concat, torch.concatenate)},
    torch.stack: (([_p("x"), _p("x")], 0), {}),
    operator.getitem: ((_p("x"), (Ellipsis, slice(None, 2))), {}),
    ("method", "size"): ((_p("x"), 1), {}),
    **{k: ((_p("x"), -1), {}) for k in (("method", "sum"), ("method", "mean"), torch.sum, torch.mean)},
    **{k: ((_p("x"), 4, -1.0, 1.0), {}) for k in (torch.histc, ("method", "histc"))},
    # the methods with a negative dim: the oracle alone must still stop there (DTensor compares the dim as written)
    **{k: ((_p("x"), 1), {}) for k in (torch.cumsum, torch.cumprod, torch.logcumsumexp, torch.cummax, torch.cummin)},
    **{("method", m): ((_p("x"), -2), {}) for m in ("cumsum", "cumprod", "logcumsumexp", "cummax", "cummin")},
    F.scaled_dot_product_attention: ((_p("q"), _p("q"), _p("q")), {"is_causal": True}),
    torch._C._nn.scaled_dot_product_attention: ((_p("q"), _p("q"), _p("q")), {"is_causal": True}),
    **{k: ((_p("logits"), _p("labels")), {}) for k in (F.cross_entropy, F.nll_loss)},
    **{k: ((_p("x"), _p("x")), {}) for k in (F.mse_loss, F.l1_loss)},
    F.local_response_norm: ((_p("q"), 3), {}),  # over the 2 heads (channels) at each position
    torch.view_as_complex: ((_p("cplx"),), {}),
    torch.view_as_real: ((_p("z"),), {}),
    torch.einsum: (("bsd,de->bse", _p("x"), _p("w")), {}),
    torch.conv1d: ((_p("xt"), _p("wconv"), _p("bias"), 1, 1, 1, D), {}),
    graph_ops.seq_conv1d: ((_p("xt"), _p("wconv"), _p("bias"), 2, 0, 1, D), {}),
    graph_ops.seq_shift: ((_p("x"), 1, 1), {}),
    **{k: ((_p("x"), -3, 1), {}) for k in (torch.roll, ("method", "roll"))},
    **{("method", m): ((_p("x"), (B, S, D)), {}) for m in ("new_empty", "new_zeros", "new_ones")},
    ("method", "new_full"): ((_p("x"), (B, S, D), 1.0), {}),
    **{k: ((_p("mask1"),), {}) for k in (torch.nonzero, ("method", "nonzero"), torch.argwhere,
                                         ("method", "argwhere"))},
    **{k: ((_p("expert"),), {}) for k in (torch.sort, ("method", "sort"), torch.argsort, ("method", "argsort"))},
    **{k: ((_p("x"), 1), {}) for k in (torch.argmax, torch.argmin, ("method", "argmax"), ("method", "argmin"),
                                       torch.max, torch.min, ("method", "max"), ("method", "min"), torch.median,
                                       ("method", "median"))},
    **{k: ((_p("x"), 3, 1), {}) for k in (torch.topk, ("method", "topk"), torch.kthvalue, ("method", "kthvalue"))},
    **{k: ((_p("x"), 1, _p("pos")), {}) for k in (torch.index_select, ("method", "index_select"))},
    **{k: ((_p("x"), 1, _p("pos3")), {}) for k in (torch.gather, ("method", "gather"))},
    **{k: ((_p("x"), _p("pos3"), 1), {}) for k in (torch.take_along_dim, ("method", "take_along_dim"))},
    **{k: ((_p("x"), -1, 0, 2), {}) for k in (torch.narrow, ("method", "narrow"))},
    operator.setitem: ((_p("x"), (Ellipsis, slice(0, 2)), 0.0), {}),  # every position's first two features
}
_NOT_SWEPT = {  # rule key name -> why it has no sample here, and where it is tested
    "scaled_dot_product_attention_with_scores": "needs a score_fn submodule (tests/test_attention_forms.py)",
    "whole": "marks a mask's input; needs the mask classification of an attention (tests/test_packed_docs.py)",
    "flex_attention": "needs mask_mod / score_mod subgraphs (tests/test_flex_attention.py)",
    "autograd_function_apply": "needs forward / backward subgraphs (test_custom_autograd_function above)",
    "_add_batch_dim": "needs a functorch vmap level (tests/test_dead_code.py)",
    "_remove_batch_dim": "needs a functorch vmap level (tests/test_dead_code.py)",
    "scan_leaves": "needs a combine submodule and a process group (tests/test_recurrence_scan.py)",
}




def _key_name(key: Any) -> str:
    target = key[1] if isinstance(key, tuple) else key
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def _graph(key: Any) -> Tuple[torch.fx.Graph, torch.fx.Node]:
    """A graph of placeholders and one node calling ``key`` on its sample, with global example values."""
    torch.manual_seed(0)
    graph, values = torch.fx.Graph(), {}

    def place(a: Any) -> Any:
        if isinstance(a, _p):
            found = [n for n in values if n.name == a]
            if not found:
                found = [graph.placeholder(str(a))]
                values[found[0]] = _INPUTS[a][0]()
            return found[0]
        if isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
            return type(a)(place(b) for b in a)
        return a

    args, kwargs = place(_SAMPLES[key][0]), {k: place(v) for k, v in _SAMPLES[key][1].items()}
    method = isinstance(key, tuple)
    node = graph.call_method(key[1], args, kwargs) if method else graph.call_function(key, args, kwargs)
    fn = getattr(torch.Tensor, key[1]) if method else key
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:  # fake values, as Dynamo's (nonzero: an unbacked size)
        for p, v in values.items():
            p.meta["example_value"] = mode.from_tensor(v)
        fake = lambda v: torch.fx.node.map_arg(v, lambda n: n.meta["example_value"])  # noqa: E731
        node.meta["example_value"] = fn(*fake(args), **fake(kwargs))
    return graph, node


def _emitter(graph: torch.fx.Graph) -> Any:
    """An emitter of a 2-rank rewrite without a process group, the placeholders laid out as _INPUTS says."""
    from cp_compile.group import CPGroup
    from cp_compile.passes.context import RewriteContext
    from cp_compile.passes.propagate.emitter import Emitter
    from cp_compile.passes.propagate.placements import GLOBAL, Sharded

    ctx = RewriteContext(group=CPGroup(pg=None, rank=0, size=2), seq_len=S)
    em = Emitter(torch.fx.GraphModule(torch.nn.Module(), graph), ctx, {})
    for p in (n for n in graph.nodes if n.op == "placeholder"):
        em.env[p] = em.graph.placeholder(p.name)
        dim = _INPUTS[p.name][1]
        em.layouts[p] = GLOBAL if dim is None else Sharded(dim)
    return em


_BAKED = "its arguments hold the sequence length (a baked size the oracle will not run on the local values)"
_MIXES = "it reduces over the tokens (the rule's result is Global, all-reduced)"
_SELECTS = "it selects rows by data (Local: no DTensor strategy keeps a data-dependent selection per token)"
_UNDECIDED = {  # ops the oracle gives no verdict for, and why (the rule's verdict is then the only one)
    "view": _BAKED, "reshape": _BAKED, "expand": _BAKED, "new_empty": _BAKED, "new_zeros": _BAKED,
    "new_ones": _BAKED, "new_full": _BAKED,
    "getitem": "its index (slices, `...`) is not a constant the oracle's cache key takes",
    "size": "it returns sizes, not a tensor",
    "setitem": "it returns nothing (it writes into its first argument)",
    "histc": _MIXES, "cross_entropy": _MIXES, "nll_loss": _MIXES, "mse_loss": _MIXES, "l1_loss": _MIXES,
    "scaled_dot_product_attention": "attention reads every position's keys (the rule makes it the ring)",
    "local_response_norm": "its ATen decomposition (avg_pool3d over the channels) has no DTensor strategy",
    **{k: "it reads neighbouring tokens (the rule exchanges the runs' boundary tokens)"
       for k in ("conv1d", "seq_conv1d", "seq_shift", "roll")},
    "nonzero": _SELECTS, "argwhere": _SELECTS, "sort": _SELECTS, "argsort": _SELECTS,
    **{k: _MIXES for k in ("argmax", "argmin", "max", "min", "median", "topk", "kthvalue")},
    **{k: "it reads positions chosen by data (the owner's rows, all-reduced: Global)"
       for k in ("index_select", "gather", "take_along_dim")},
    **dict.fromkeys(("cumsum", "cumprod", "logcumsumexp", "cummax", "cummin"),
                    "a scan along the sequence mixes tokens (the rule combines every rank's run totals)"),
}


def test_every_rule_has_a_sample() -> None:
    """Every registered target is swept below or named in _NOT_SWEPT with the reason."""
    unsampled = {_key_name(k) for k in RULES if k not in _SAMPLES} - set(_NOT_SWEPT)
    assert not unsampled, f"registered without a sample in tests/test_rules.py _SAMPLES: {sorted(unsampled)}"
    assert set(_SAMPLES) <= set(RULES), set(_SAMPLES) - set(RULES)


@pytest.mark.parametrize("key", list(_SAMPLES), ids=lambda k: ".".join(k) if isinstance(k, tuple) else _key_name(k))
def test_rule_agrees_with_the_oracle(key: Any) -> None:
    """The registered rule keeps its sample exact (no gather); the oracle agrees on the layout, or is listed
    in _UNDECIDED as giving no verdict."""
    from cp_compile.passes.propagate import oracle

    graph, node = _graph(key)
    em = _emitter(graph)
    _, layout = RULES[key](em, node)
    assert em.ctx.fallbacks == [], em.ctx.fallbacks
    graph, node = _graph(key)
    decided = oracle.decide(_emitter(graph), node)
    if _key_name(key) in _UNDECIDED:
        assert decided is None, (key, decided)
    else:
        assert decided is not None and decided[1] == layout, (key, layout, decided)


def _design_rule_modules() -> list:
    """The rule-module cells of docs/design.md §6's rule table, one per row."""
    import pathlib

    text = (pathlib.Path(__file__).parents[1] / "docs" / "design.md").read_text()
    lines = text[text.index("| op class | rule module |"):].splitlines()[2:]
    rows = [ln for ln in lines[:next(i for i, ln in enumerate(lines) if not ln.startswith("|"))]]
    return [ln.split(" | ")[1].strip() for ln in rows]


def test_design_rule_table_matches_the_registry() -> None:
    """docs/design.md §6 names every module that registers a rule, and each rule module it names registers
    one (a row in parentheses is no rule: the oracle, the fallback)."""
    registered = {fn.__module__.rsplit(".", 1)[1] + ".py" for fn in RULES.values()}
    named = [m for m in _design_rule_modules() if not m.startswith("(")]
    assert registered - set(named) == set(), f"rule modules missing from docs/design.md §6: {registered - set(named)}"
    assert set(named) - registered == set(), f"docs/design.md §6 names modules without rules: {set(named) - registered}"


def test_a_second_rule_for_one_op_is_an_error() -> None:
    """Two rules for one target would make the table depend on the order of the imports: refused."""
    from cp_compile.passes.propagate.rules import register_rule

    with pytest.raises(RuntimeError, match="two layout rules"):
        register_rule(torch.tanh)(lambda em, node: None)
    assert RULES[torch.tanh].__name__ == "pointwise"


def test_local_response_norm_on_this_ranks_positions_is_the_one_process_value() -> None:
    """rules/pointwise.py's local_response_norm: the rewrite runs it on this rank's positions (no gather),
    and each position's value is the one-process value of that position (a window over channels only)."""
    report = _rewrite(ROWS["local_response_norm"][0])
    assert report.ctx.fallbacks == [], report.ctx.fallbacks
    from cp_compile.sequence import rank_positions

    x = torch.randn(2, D, S)
    whole = F.local_response_norm(x, 3)
    for rank in range(2):
        pos = rank_positions(S, 2, rank, "zigzag")  # this rank's positions (explain_model's default layout)
        torch.testing.assert_close(F.local_response_norm(x[..., pos], 3), whole[..., pos], rtol=0, atol=0)
