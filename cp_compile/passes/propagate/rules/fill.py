"""Layout rules for writes into fresh per-token buffers: ``x.new_empty(shape)`` then ``buf[..., :n].copy_(y)``.

    x (B, H, S, D) Sharded(2) ─ x.new_empty(B, H, S, E) / new_zeros / new_ones / new_full ─> (B, H, c, E) Sharded(2)
    x (B, H, S, D) Sharded(2) ─ x.new_zeros(B, H, K, V) (no sequence extent, int sizes) ─> (B, H, K, V) Global
    buf (B, H, c, E) Sharded(2) ─ buf[..., :n] (a view) ─ .copy_(y (B, H, c, n) Sharded(2)) ─> buf's rows written here

(Hugging Face's DeepSeek-V3 attention assembles its keys this way.) A factory's values do not
depend on position, so a buffer shaped like a Sharded value with the global length at the same
dim is created at the local length. ``copy_`` into a Sharded destination is elementwise: the
pointwise rule, writing this rank's rows of the destination in place. A destination held
whole, or a factory of another shape, takes the path of an op with no rule (the oracle, else a
gather, warned).
"""

from __future__ import annotations

import torch.fx as fx

from ...context import global_shape
from ..emitter import Emitter
from ..placements import GLOBAL, Sharded
from ..oracle import decide
from .common import _name
from .registry import chunk_aware, register_rule
from .pointwise import pointwise

FACTORIES = ("new_empty", "new_zeros", "new_ones", "new_full")


def _sizes(node: fx.Node):
    """The size arguments of ``x.new_*(*sizes)`` / ``x.new_*(sizes)``, and the fill value if any."""
    args = list(node.args[1:])
    if args and isinstance(args[0], (tuple, list)):
        return list(args[0]), args[1:]
    n_fill = 1 if node.target == "new_full" else 0
    return args[:len(args) - n_fill], args[len(args) - n_fill:]


@chunk_aware
@register_rule(*FACTORIES)
def new_factory(em: Emitter, node: fx.Node):
    """``x.new_empty(sizes)`` with x Sharded(d) and sizes[d] the global length: made at the local length
    (x in chunks: this rank's chunks). Sizes all ints and none of them x's sharded length there (a
    recurrence's zero state ``q.new_zeros(B, H, K, V)``): the same whole value on every rank."""
    x, lay = node.args[0], em.layout(node.args[0])
    sizes, rest = _sizes(node)
    shape = global_shape(x)
    ints = all(type(s) is int for s in sizes)
    if not (isinstance(lay, Sharded) and lay.inner == 1 and len(sizes) == len(shape) and ints
            and sizes[lay.dim] == shape[lay.dim]):
        if ints and not any(isinstance(a, fx.Node) for a in rest):
            return em.copy(node, (em.env[x], tuple(sizes), *rest), dict(node.kwargs)), GLOBAL
        return _unruled(em, node)
    sizes[lay.dim] = em.method("size", em.env[x], lay.dim)  # this rank's length (padding included)
    return em.copy(node, (em.env[x], tuple(sizes), *rest), dict(node.kwargs)), Sharded(lay.dim, chunk=lay.chunk)


@register_rule("copy_")
def copy_into(em: Emitter, node: fx.Node):
    """``dst.copy_(src)`` with a Sharded destination: elementwise, this rank's rows in place."""
    if isinstance(em.layout(node.args[0]), Sharded):
        return pointwise(em, node)
    return _unruled(em, node)


def _unruled(em: Emitter, node: fx.Node):
    """Outside these rules: the path of an op with no rule (the oracle, else a gather)."""
    return decide(em, node) or em.fallback(node, f"{_name(node)} is not known to be per-token")

