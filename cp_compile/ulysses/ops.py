"""The Ulysses all-to-alls as ``torch.library`` custom ops: sequence-sharded <-> head-sharded.

``cp_compile::seq_to_heads(x, heads, u, group_name, cp_name, load_balance, positions)``::

    x (B, Hx, c, ...)  this rank's c tokens of every head
      -> pick the sent head slots ``heads`` (u·m of them, rank-major; -1: a zero head)
      -> all-to-all over the Ulysses group (slot block p to peer p)
      -> (B, m, u·c, ...)  this rank's m head slots for the u·c tokens of its Ulysses group,
         put in increasing global position (the order the ring over the other dim expects)

``cp_compile::heads_to_seq(y, heads, n_heads, ...)`` is its adjoint: the tokens put back in the
peers' order, the all-to-all back, each slot added into its head (a K/V head replicated on several
ranks gets the sum of their gradients; zero heads are dropped). Each op's backward is the other.
They are opaque to Dynamo / AOTAutograd like the ring op, so a compiled graph keeps them whole and
AOTAutograd saves the head-sharded q, k, v for the ring's backward (4 all-to-alls forward, 4 backward).

The token order is computed in the op from the CP group and layout (``cp_name``, ``load_balance``,
or the per-batch ``positions`` table): the Ulysses group of CP rank ``i·u + j`` is row i of the
grid (:mod:`.groups`), whose tokens are the rows' positions concatenated, sorted. Bytes sent are
counted in :mod:`cp_compile.traffic` ("all_to_all").
"""

from __future__ import annotations

import functools
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import traffic
from ..group import group_by_name
from ..sequence import rank_positions

Tensor = torch.Tensor

_ARGS = "int[] heads, int u, str group_name, str cp_name, str load_balance, Tensor? positions=None"


@functools.lru_cache(maxsize=64)
def _fixed_order(c: int, u: int, rank: int, world: int, load_balance: str,
                 device: torch.device) -> Tuple[Tensor, Tensor]:
    i = rank // u
    pos = torch.cat([rank_positions(world * c, world, i * u + j, load_balance) for j in range(u)])
    return _with_inverse(torch.argsort(pos, stable=True), device)


def _with_inverse(order: Tensor, device: torch.device) -> Tuple[Tensor, Tensor]:
    """(order, its inverse permutation), both on ``device``."""
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel())
    return order.to(device), back.to(device)


def token_order(c: int, u: int, cp_name: str, load_balance: str, positions: Optional[Tensor],
                device: torch.device) -> Tuple[Tensor, Tensor]:
    """(u·c,) int64 on ``device``: where each of the Ulysses group's tokens goes once they are sorted by
    position, and the inverse permutation (the peers' order back). A fixed layout's pair is cached; a
    per-batch ``positions`` table's is computed per call."""
    cp = group_by_name(cp_name)
    if positions is None:
        return _fixed_order(c, u, cp.rank, cp.size, load_balance, device)
    i = cp.rank // u
    return _with_inverse(torch.argsort(positions[i * u:(i + 1) * u].reshape(-1).cpu(), stable=True), device)


@functools.lru_cache(maxsize=256)
def _head_index(heads: Tuple[int, ...], zero: int, device: torch.device) -> Tensor:
    """``heads`` as an index tensor on ``device``, -1 (a zero head) read as ``zero``."""
    return torch.tensor([h if h >= 0 else zero for h in heads], device=device)


def _pick_heads(x: Tensor, heads: List[int]) -> Tensor:
    """(B, len(heads), c, ...): x's heads in ``heads`` order, zeros for -1."""
    if min(heads) < 0:
        x = torch.cat([x, x.new_zeros(x[:, :1].shape)], 1)
    return x.index_select(1, _head_index(tuple(heads), x.shape[1] - 1, x.device))


def _all_to_all(send: Tensor, group_name: str) -> Tensor:
    """Block p of ``send`` (u, ...) to peer p; returns (u, ...) with block p from peer p."""
    g = group_by_name(group_name)
    if g.size == 1:
        return send
    recv = torch.empty_like(send)
    traffic.add("all_to_all", send[0].numel() * send.element_size() * (g.size - 1))
    dist.all_to_all_single(recv, send, group=g.pg)
    return recv


@torch.library.custom_op("cp_compile::seq_to_heads", mutates_args=(),
                         schema=f"(Tensor x, {_ARGS}) -> Tensor")
def seq_to_heads(x: Tensor, heads: List[int], u: int, group_name: str, cp_name: str, load_balance: str,
                 positions: Optional[Tensor] = None) -> Tensor:
    """(B, Hx, c, ...) sequence-sharded -> (B, m, u·c, ...) head-sharded (module docstring)."""
    b, c, rest, m = x.shape[0], x.shape[2], tuple(x.shape[3:]), len(heads) // u
    tail = tuple(range(3, 3 + len(rest)))
    send = _pick_heads(x, heads).view(b, u, m, c, *rest).transpose(0, 1).contiguous()  # (u, B, m, c, ...)
    recv = _all_to_all(send, group_name)  # recv[p]: peer p's tokens of my head slots
    y = recv.permute(1, 2, 0, 3, *(d + 1 for d in tail)).reshape(b, m, u * c, *rest)
    order, _ = token_order(c, u, cp_name, load_balance, positions, y.device)
    return y.index_select(2, order)


@seq_to_heads.register_fake
def _seq_to_heads_fake(x, heads, u, group_name, cp_name, load_balance, positions=None):
    return x.new_empty((x.shape[0], len(heads) // u, u * x.shape[2], *x.shape[3:]))


@torch.library.custom_op("cp_compile::heads_to_seq", mutates_args=(),
                         schema=f"(Tensor y, SymInt n_heads, {_ARGS}) -> Tensor")
def heads_to_seq(y: Tensor, n_heads: int, heads: List[int], u: int, group_name: str, cp_name: str,
                 load_balance: str, positions: Optional[Tensor] = None) -> Tensor:
    """(B, m, u·c, ...) head-sharded -> (B, n_heads, c, ...) sequence-sharded: the adjoint of
    :func:`seq_to_heads` (slots of one head summed, zero heads dropped)."""
    b, m, c, rest = y.shape[0], y.shape[1], y.shape[2] // u, tuple(y.shape[3:])
    tail = tuple(range(3, 3 + len(rest)))
    _, back = token_order(c, u, cp_name, load_balance, positions, y.device)
    z = y.index_select(2, back).view(b, m, u, c, *rest)  # peers' token order
    send = z.permute(2, 0, 1, 3, *(d + 1 for d in tail)).contiguous()  # (u, B, m, c, ...): block p to peer p
    recv = _all_to_all(send, group_name)  # recv[p]: my tokens of peer p's head slots
    slots = recv.transpose(0, 1).reshape(b, u * m, c, *rest)
    out = y.new_zeros((b, n_heads + 1, c, *rest))
    return out.index_add_(1, _head_index(tuple(heads), n_heads, y.device), slots)[:, :n_heads].contiguous()


@heads_to_seq.register_fake
def _heads_to_seq_fake(y, n_heads, heads, u, group_name, cp_name, load_balance, positions=None):
    return y.new_empty((y.shape[0], n_heads, y.shape[2] // u, *y.shape[3:]))


def _setup(ctx, inputs, output) -> None:
    ctx.n_heads = inputs[0].shape[1]
    ctx.rest = inputs[1:]


def _seq_to_heads_bwd(ctx, grad: Tensor):
    heads, u, group_name, cp_name, load_balance, positions = ctx.rest
    return (torch.ops.cp_compile.heads_to_seq(grad, ctx.n_heads, heads, u, group_name, cp_name, load_balance,
                                              positions), None, None, None, None, None, None)


def _heads_to_seq_bwd(ctx, grad: Tensor):
    n_heads, heads, u, group_name, cp_name, load_balance, positions = ctx.rest
    return (torch.ops.cp_compile.seq_to_heads(grad, heads, u, group_name, cp_name, load_balance, positions),
            None, None, None, None, None, None, None)


seq_to_heads.register_autograd(_seq_to_heads_bwd, setup_context=_setup)
heads_to_seq.register_autograd(_heads_to_seq_bwd, setup_context=_setup)
