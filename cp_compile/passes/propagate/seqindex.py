"""Which entries of a sequence dim this rank holds, as graph values.

With static shapes the sequence length S is a Python int and every index is a
constant buffer computed here, except under ``load_balance="documents"``: the positions
are then the rows of a table the graph computes from each batch's document ids
(:attr:`SeqIndex.table`, ``torch.ops.cp_compile.document_table``), and every index is
emitted as graph ops on ``table[rank]``, as under a symbolic S. Under ``dynamic=True`` (or Dynamo's automatic
dynamic shapes after a new length) S is a SymInt graph input: the same indices
are then emitted as graph ops on it, so one compiled graph serves every length.

    S_pad = ceil(S / m) * m   (m: 2N for zig-zag, N otherwise)    c = S_pad / N
    index of local entry (o, t, i) along a dim of size outer * S * inner:
        o * S * inner + min(pos[t], S - 1) * inner + i
"""

from __future__ import annotations

import operator
from typing import Any, Optional, Tuple, Union

import torch
import torch.fx as fx

from ...sequence import rank_positions, split_multiple

Value = Union[int, fx.Node]


class SeqIndex:
    """Index and mask builders of one rewrite (``em``: the rewrite.Emitter)."""

    def __init__(self, em: Any) -> None:
        self.em, self.ctx = em, em.ctx
        self._memo: dict = {}
        self.table: Optional[fx.Node] = None  # load_balance="documents": the (N, c) positions table node

    @property
    def runtime(self) -> bool:
        """Whether positions are graph values (symbolic S, or a per-batch table), not constants."""
        return self.ctx.seq_sym is not None or self.table is not None

    # -- scalars ---------------------------------------------------------------
    def op(self, fn, a: Value, b: Value) -> Value:
        """``fn(a, b)``, folded when both are ints, a graph node otherwise."""
        if isinstance(a, int) and isinstance(b, int):
            return fn(a, b)
        return self.em.call(fn, a, b)

    def S(self) -> Value:
        return self.ctx.seq_len if self.ctx.seq_sym is None else self.em.seq_node()

    def S_pad(self) -> Value:
        if self.ctx.seq_sym is None:
            return self.ctx.padded_len
        m = split_multiple(self.ctx.world, self.ctx.options.load_balance)
        return self.op(operator.mul, self.op(operator.floordiv, self.op(operator.add, self.S(), m - 1), m), m)

    def c(self) -> Value:
        return self.op(operator.floordiv, self.S_pad(), self.ctx.world)

    def local_size(self, size: Value, chunk: int = 1) -> Value:
        """Per-rank size of a dim of global size outer * S * inner (S / chunk entries: chunks of tokens)."""
        if chunk > 1:  # static S only (:meth:`chunk_refusal`)
            return size // (self.ctx.seq_len // chunk) * (self.ctx.padded_len // self.ctx.world // chunk)
        return self.op(operator.mul, self.op(operator.floordiv, size, self.S()), self.c())

    # -- chunks of tokens (placements.Sharded.chunk) -----------------------------
    def chunk_refusal(self, chunk: int) -> Optional[str]:
        """Why this layout cannot hold the sequence in chunks of ``chunk`` tokens, or None: each rank's
        runs must be whole chunks of the single-device chunk grid, with no padding row."""
        ctx = self.ctx
        if self.runtime:
            return "the sequence length is symbolic or the runs are per batch (fix: dynamic=False)"
        if ctx.padded or ctx.seq_len % chunk:
            return (f"S = {ctx.seq_len} is not a multiple of the chunk size {chunk} times the split "
                    f"({split_multiple(ctx.world, ctx.options.load_balance)}) (fix: pad the sequence to a "
                    "multiple of it)")
        pos = ctx.positions()
        rows = pos.view(-1, chunk) if pos.numel() % chunk == 0 else None
        if rows is None or bool((rows[:, :1] % chunk != 0).any()) \
                or bool((rows - rows[:, :1] != torch.arange(chunk)).any()):
            runs = self.chunks()
            length = f"runs of {runs[1]} tokens" if runs is not None else "no contiguous runs"
            return (f"load_balance={ctx.options.load_balance!r} on {ctx.world} ranks gives each rank {length}, "
                    f"not whole chunks of {chunk} (fix: a length that is a multiple of {chunk} times the split, "
                    "or load_balance='contiguous')")
        return None

    def chunk_positions(self, chunk: int, rank: Optional[int] = None) -> torch.Tensor:
        """Global chunk indices held by ``rank`` (this rank by default), in local order (c / chunk,)."""
        ctx = self.ctx
        pos = ctx.positions() if rank is None else rank_positions(ctx.padded_len, ctx.world, rank,
                                                                     ctx.options.load_balance)
        return pos.view(-1, chunk)[:, 0] // chunk

    def valid_len(self) -> Value:
        """The ring op's valid_len: S when the sequence may be padded, else -1."""
        if self.ctx.seq_sym is not None:
            return self.S()
        return self.ctx.seq_len if self.ctx.padded else -1

    # -- tensors ---------------------------------------------------------------
    def _arange(self, *args: Value) -> fx.Node:
        return self.em.call(torch.arange, *args)

    def positions(self, rank: int) -> fx.Node:
        """Global positions held by ``rank`` (c,), padding included."""
        key = ("pos", rank)
        if key not in self._memo:
            ctx, n = self.ctx, self.ctx.world
            if self.table is not None:
                self._memo[key] = self.em.call(operator.getitem, self.table, rank)  # (c,) this batch's row
            elif ctx.seq_sym is None:
                positions = rank_positions(ctx.padded_len, n, rank, ctx.options.load_balance)
                self._memo[key] = self.em.const(f"_cp_pos{rank}", positions)
            elif ctx.options.load_balance == "striped":
                self._memo[key] = self._arange(rank, self.S_pad(), n)
            else:
                contiguous = ctx.options.load_balance == "contiguous"
                blk = self.c() if contiguous else self.op(operator.floordiv, self.S_pad(), 2 * n)
                at = lambda i: self.op(operator.mul, i, blk)  # noqa: E731
                first = self._arange(at(rank), at(rank + 1))
                if ctx.options.load_balance == "contiguous":
                    self._memo[key] = first
                else:
                    second = self._arange(at(2 * n - 1 - rank), at(2 * n - rank))
                    self._memo[key] = self.em.call(torch.cat, [first, second])
        return self._memo[key]

    def chunks(self) -> Optional[Tuple[torch.Tensor, Value]]:
        """This layout as equal contiguous runs of global positions, for the rules that follow the
        global order across ranks (scans, neighbour reads): ``(table, length)``, ``table`` an
        (N, k) int64 tensor whose row r lists the global chunk index of rank r's j-th run of
        ``length`` tokens (rank r's local tokens are its k runs one after the other); chunk i
        covers global positions [i·length, (i+1)·length) of the padded sequence. None when the
        runs are not fixed (``load_balance="documents"``: per batch) or are single tokens
        (``"striped"`` on several ranks).

            zigzag     (N=2): [[0, 3], [1, 2]], length c/2     contiguous: [[0], [1]], length c
        """
        n, lb = self.ctx.world, self.ctx.options.load_balance
        if self.table is not None or (lb == "striped" and n > 1) or lb == "documents":
            return None
        if n == 1 or lb == "contiguous":
            return torch.arange(n).view(n, 1), self.c()
        table = torch.tensor([[r, 2 * n - 1 - r] for r in range(n)])  # zigzag
        return table, self.op(operator.floordiv, self.c(), 2)

    def index(self, size: Value, inner: int, chunk: int = 1) -> fx.Node:
        """Indices of this rank's entries along a dim of global ``size`` (1-D, outer * c * inner)."""
        if chunk > 1:
            return self.em.const(f"_cp_index_{size}_{inner}_chunk{chunk}", self._static_index(size, inner, chunk)[0])
        if not self.runtime:
            return self.em.const(f"_cp_index_{size}_{inner}", self._static_index(size, inner)[0])
        s, em = self.S(), self.em
        span = self.op(operator.mul, s, inner)
        outer = self.op(operator.floordiv, size, span)
        pos = em.method("clamp", self.positions(self.ctx.group.rank), max=self.op(operator.sub, s, 1))
        grid = em.call(operator.add, em.call(operator.mul, em.method("view", self._arange(outer), -1, 1, 1), span),
                       em.call(operator.mul, em.method("view", pos, 1, -1, 1), inner))
        return em.method("reshape", em.call(operator.add, grid, em.method("view", self._arange(inner), 1, 1, -1)), -1)

    def valid(self, local: fx.Node, ndim: int, dim: int, inner: int, global_size: int) -> Optional[fx.Node]:
        """Bool mask broadcastable to ``local`` (a sharded value): False at padding rows."""
        ctx, em = self.ctx, self.em
        view = [-1 if d == dim else 1 for d in range(ndim)]
        if ctx.seq_sym is None:
            if not ctx.padded:
                return None  # (always so under a table: S divides by N, no padding)
            mask = self._static_index(global_size, inner)[1]
            return em.const(f"_cp_valid_{global_size}_{inner}_{dim}_{ndim}", mask.reshape(view))
        outer = self.op(operator.floordiv, em.method("size", local, dim), self.op(operator.mul, self.c(), inner))
        ok = em.call(operator.lt, self.positions(ctx.group.rank), self.S())  # (c,)
        ok = em.method("expand", em.method("view", ok, 1, -1, 1), outer, -1, inner)
        return em.method("view", em.method("reshape", ok, -1), *view)

    def order_inverse(self, chunk: int = 1) -> Tuple[fx.Node, fx.Node]:
        """Positions of ranks 0..N-1 concatenated (S_pad,) and the first S of its argsort (chunk > 1:
        the chunks' indices, S / chunk)."""
        ctx, em = self.ctx, self.em
        if chunk > 1:
            order = torch.cat([self.chunk_positions(chunk, r) for r in range(ctx.world)])
            return em.const(f"_cp_order_chunk{chunk}", order), em.const(f"_cp_inverse_chunk{chunk}",
                                                                        torch.argsort(order))
        if self.table is not None:  # (N, c) -> (S,): a partition of range(S), no padding
            order = em.method("reshape", self.table, -1)
            return order, em.call(torch.argsort, order)
        if ctx.seq_sym is None:
            order = ctx.order()
            return em.const("_cp_order", order), em.const("_cp_inverse", torch.argsort(order)[: ctx.seq_len])
        order = em.call(torch.cat, [self.positions(r) for r in range(ctx.world)])
        return order, em.method("narrow", em.call(torch.argsort, order), 0, 0, self.S())

    def _static_index(self, size: int, inner: int, chunk: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
        s, pos = self.ctx.seq_len, self.ctx.positions()
        if chunk > 1:
            s, pos = s // chunk, self.chunk_positions(chunk)
        outer = size // (s * inner)
        grid = lambda p: (torch.arange(outer)[:, None, None] * (s * inner) + p[None, :, None] * inner  # noqa: E731
                          + torch.arange(inner)[None, None, :]).reshape(-1)
        valid = (pos < s)[None, :, None].expand(outer, -1, inner).reshape(-1)
        return grid(pos.clamp(max=s - 1)), valid
