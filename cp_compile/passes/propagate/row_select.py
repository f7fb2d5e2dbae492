"""This rank's rows of a whole value, selected as far upstream as is cheap.

Used by the rewrite where the sequence arises inside the graph (:mod:`.seq_origins`):
an *origin* holds the whole sequence on every rank and is indexed by this rank's
positions. Indexing the finished value would compute it whole first; instead the
selection moves up through the ops that built it, the way :mod:`.masks.rows` moves a
mask's query rows up through the ops that build a mask:

    before (every rank, whole):   x = linear(patches)            (B, S-1, D)
                                  t = cat([cls.expand(B, 1, D), x], 1)   (B, S, D)
                                  t.index_select(1, pos)          (B, c, D)
    after  (rank r, its rows):    x = linear(patches.index_select(1, pos_x))   (B, c_x, D)
                                  cat([cls.expand(B, 1, D) or its 0 rows, x], 1)

Two moves, applied recursively from the origin:

* a ``cat`` along the selected dim: each piece gives the positions that fall in it
  (shifted to the piece's own rows), in order, since a rank's positions are ascending;
  a piece the rank takes whole is used as it is, one it takes nothing of keeps zero rows
  (so its parameters still reach the gradient all-reduce on every rank);
* a per-token op (decided by the rule oracle, :func:`.oracle.rows_from_inputs`: DTensor
  propagation says the selected dim's rows come from the same rows of some inputs):
  the op runs on those inputs' selected rows;
* a reshape that merges dims of its input into the selected dim (the patches of an opened
  patch convolution, :mod:`.patch_conv`: (B, h, w, C, p, q) -> (B, h·w, C·p·q)): the input
  is indexed at the unravelled positions, ``v[:, i_h, i_w]`` (B, c, C, p, q), and reshaped
  to (B, c, C·p·q); only this rank's patches are read (``v`` is a view of the image).

A value used elsewhere too (more than one user), a graph input, or anything else is
indexed where it stands (``index_select``). Needs static shapes (the per-piece positions
are constants); under a symbolic S or ``load_balance="documents"`` (positions from a
per-batch table) the origin is indexed as a whole. The whole copies the
walk had already emitted for the nodes moved past are erased when nothing else uses them.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..context import global_shape
from ..op_vocab import CATS, FLATTENS, RESHAPES, arguments
from .emitter import mutates
from .oracle import rows_from_inputs



def select_rows(em: Any, origin: fx.Node, dim: int) -> fx.Node:
    """The new graph's value of ``origin`` (Global, size S along ``dim``) at this rank's positions."""
    if em.index.runtime:  # symbolic S or a per-batch table: positions are graph values
        return em.to_sharded(origin, dim)
    rows = em.index.index(em.ctx.seq_len, 1)  # the constant buffer node; its value:
    idx = em.gm.get_buffer(rows.target)  # (c,) ascending global positions, padding clamped to S-1
    select = _Select(em)
    new = select.rows(origin, dim, idx, top=True)
    _erase_dead(em, [em.env[n] for n in select.passed])
    return new


class _Select:
    def __init__(self, em: Any) -> None:
        self.em = em
        self.memo: Dict[Tuple[fx.Node, int, Tuple[int, ...]], fx.Node] = {}
        self.passed: List[fx.Node] = []  # old nodes the selection moved above (their whole copies may die)

    def rows(self, old: fx.Node, dim: int, idx: torch.Tensor, top: bool = False) -> fx.Node:
        """``old``'s rows ``idx`` (ascending, may repeat) along ``dim``, as a new node."""
        key = (old, dim, tuple(idx.tolist()))
        if key not in self.memo:
            self.memo[key] = self._rows(old, dim, idx, top)
        return self.memo[key]

    def _rows(self, old: fx.Node, dim: int, idx: torch.Tensor, top: bool) -> fx.Node:
        em, length = self.em, global_shape(old)[dim]
        if torch.equal(idx, torch.arange(length)):
            return em.env[old]  # every row, in order
        movable = top or len(old.users) == 1  # used elsewhere too: computing it twice is not cheaper
        pieces = _cat_pieces(old, dim) if movable else None
        if pieces is not None:
            self.passed.append(old)
            return self._cat(pieces, dim, idx)
        inputs = rows_from_inputs(old, dim, length, em.ctx.world) if movable else None
        if inputs:
            self.passed.append(old)
            return self._per_token(old, inputs, idx)
        merged = _merged_dims(old, dim) if movable else None
        if merged is not None:
            self.passed.append(old)
            return self._unravel(old, dim, merged, idx)
        return em.method("index_select", em.env[old], dim, em.const(f"_cp_rows{len(em._consts)}", idx))

    def _cat(self, pieces: List[fx.Node], dim: int, idx: torch.Tensor) -> fx.Node:
        """``cat`` of each piece's share of ``idx``. A piece this rank takes nothing of stays, with
        no rows: its parameters then get a zero gradient on this rank, so every rank still runs
        their gradient all-reduce (the same collectives on every rank)."""
        parts, start = [], 0
        for piece in pieces:
            size = global_shape(piece)[dim]
            parts.append(self.rows(piece, dim, idx[(idx >= start) & (idx < start + size)] - start))
            start += size
        return self.em.call(torch.cat, parts, dim)

    def _unravel(self, old: fx.Node, dim: int, sizes: Tuple[int, ...], idx: torch.Tensor) -> fx.Node:
        """``old``'s rows ``idx`` read off the input it reshapes: ``src[..., i_0, i_1, ...]``
        at the unravelled positions (adjacent index tensors keep their place), then the
        reshape with ``c`` rows."""
        em, src = self.em, _reshape_source(old)
        parts = torch.unravel_index(idx, sizes)  # one (c,) index per merged dim
        consts = [em.const(f"_cp_rows{len(em._consts)}", p.clone()) for p in parts]
        picked = em.call(operator.getitem, em.env[src], (slice(None),) * dim + tuple(consts))  # (.., c, rest)
        shape = list(global_shape(old))
        shape[dim] = len(idx)
        return em.method("reshape", picked, tuple(shape))

    def _per_token(self, old: fx.Node, inputs: Dict[int, int], idx: torch.Tensor) -> fx.Node:
        """``old`` re-emitted on the selected rows of the inputs that carry them."""
        leaves, spec = tree_flatten((old.args, old.kwargs))
        new = [self.rows(a, inputs[i], idx) if i in inputs else self.em.value(a) for i, a in enumerate(leaves)]
        args, kwargs = tree_unflatten(new, spec)
        return self.em.graph.create_node(old.op, old.target, tuple(args), dict(kwargs))


def _merged_dims(node: fx.Node, dim: int) -> Optional[Tuple[int, ...]]:
    """The sizes of the input dims ``node`` (a row-major reshape) merges into its ``dim``, when
    the dims before ``dim`` stay as they are and more than one input dim merges, else None."""
    src = _reshape_source(node)
    ins, out = (global_shape(src), global_shape(node)) if src is not None else (None, None)
    if ins is None or out is None or tuple(ins[:dim]) != tuple(out[:dim]):
        return None
    for end in range(dim + 2, len(ins) + 1):
        if math.prod(ins[dim:end]) == out[dim] and math.prod(ins[end:]) == math.prod(out[dim + 1:]):
            return tuple(ins[dim:end])
    return None


def _reshape_source(node: fx.Node) -> Optional[fx.Node]:
    """The tensor ``node`` reshapes in row-major order (``view``, ``reshape``, ``flatten``), else None."""
    reshape = node.op in ("call_method", "call_function") and node.target in RESHAPES | FLATTENS
    return node.args[0] if reshape and isinstance(node.args[0], fx.Node) else None


def _cat_pieces(node: fx.Node, dim: int) -> Optional[List[fx.Node]]:
    """The tensor pieces of ``torch.cat(pieces, dim)`` along ``dim``, else None."""
    if node.op != "call_function" or node.target not in CATS:
        return None
    a = arguments(node, ("tensors", "dim"))
    tensors, cat_dim = a.get("tensors"), a.get("dim", 0)
    ndim = len(global_shape(node))
    if not isinstance(tensors, (list, tuple)) or not isinstance(cat_dim, int) or cat_dim % ndim != dim:
        return None
    pieces = [t for t in tensors if isinstance(t, fx.Node)]
    if len(pieces) != len(tensors) or any(global_shape(p) is None or len(global_shape(p)) != ndim for p in pieces):
        return None  # a legacy empty (0,) piece or a non-node: leave it to index_select
    return pieces


def _erase_dead(em: Any, todo: List[fx.Node]) -> None:
    """Erase the whole copies of the nodes the selection moved above, now without users."""
    order = {n: i for i, n in enumerate(em.graph.nodes)}
    for node in sorted(set(todo), key=lambda n: -order[n]):  # users before their inputs
        if not node.users and node.op in ("call_function", "call_method") and not mutates(node):
            em.graph.erase_node(node)

