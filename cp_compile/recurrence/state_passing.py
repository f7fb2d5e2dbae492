"""State passing: the state entering each of this rank's runs, from every run's O(state) summary.

A run of consecutive tokens of a linear recurrence ``h_t = A_t h_{t-1} + b_t`` is one affine map of
the state, ``h_out = M ∘ h_in + c`` (``∘``: elementwise ``*`` for a diagonal/scalar ``A``, ``@`` on
dim -2 for a matrix one). Each rank computes ``(M_j, c_j)`` of its own runs from a zero state (its
local work, all ranks at once); one all-gather exchanges them; every rank then composes them in
*global* order (zig-zag runs are not contiguous on a rank), which is a loop over the N·k runs of
state-sized ops:

    maps (k, *M), finals (k, *h) ── pack, exchange ──> (N, k, |M| + |h|)       one collective
    h = h0
    for (r, j) in global order:           # run (r, j): rank r's j-th run
        incoming[r, j] = h
        h = M[r, j] ∘ h + c[r, j]
    -> (this rank's incoming states..., h: the state leaving the sequence)

Gradients are autograd's: through the composition and the exchange (a reduce-scatter backward), so
each rank's summaries get the sum of every rank's share (the contract of ``graph_ops.gather_stack``).
The exchange is its own custom op, ``cp_compile::state_exchange`` (and ``state_exchange_grad`` for the
backward), so that its bytes are counted where they are sent (:mod:`cp_compile.traffic`, kinds
``"state exchange"`` and ``"state exchange grad"``: the bytes each rank receives, its own share
included, which is the record's figure), as the ring's are; a functional all-gather traced into the
graph runs no Python at run time.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

import torch.distributed as dist

from .. import traffic
from ..group import group_by_name

Tensor = torch.Tensor


def apply_map(kind: str, m: Tensor, h: Tensor, c: Tensor) -> Tensor:
    """``m ∘ h + c``: elementwise (m shaped like h) or a (..., K, K) matrix on dim -2 of h (..., K, V)."""
    return m * h + c if kind == "elementwise" else torch.matmul(m, h) + c


def incoming_states(maps: Tensor, finals: Tensor, h0: Tensor, world: int, group_name: str,
                    order: Sequence[Tuple[int, int]], rank: int, kind: str) -> Tuple[Tensor, ...]:
    """This rank's k incoming states and the final state (see the module docstring).

    maps: (k, *M) this rank's run maps; finals: (k, *h) its runs' states from a zero state;
    h0: the state entering the sequence (broadcastable to h); order: (rank, run) of every run in
    global order. Returns k + 1 tensors shaped like h."""
    k, state = finals.shape[0], finals.shape[1:]
    width = maps[0].numel()
    packed = torch.cat([maps.reshape(k, -1), finals.reshape(k, -1).to(maps.dtype)], 1)  # (k, |M| + |h|)
    stacked = state_exchange(packed, world, group_name)  # (N, k, |M| + |h|), the same on every rank
    h = h0.to(finals.dtype).expand(state)
    incoming: List[Tensor] = [h] * k
    for r, j in order:
        if r == rank:
            incoming[j] = h
        m = stacked[r, j, :width].view(maps.shape[1:])
        c = stacked[r, j, width:].view(state)
        h = apply_map(kind, m, h, c)
    return (*incoming, h)


@torch.library.custom_op("cp_compile::state_exchange", mutates_args=())
def state_exchange(x: Tensor, world: int, group_name: str) -> Tensor:
    """Every rank's ``x`` (k, w) stacked in rank order, (N, k, w): one all-gather, its bytes counted."""
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))  # (N·k, w)
    traffic.add("state exchange", out.numel() * out.element_size())
    dist.all_gather_single(out, x.contiguous(), group=group_by_name(group_name).pg)
    return out.view(world, *x.shape)


@state_exchange.register_fake
def _state_exchange_fake(x: Tensor, world: int, group_name: str) -> Tensor:
    return x.new_empty((world, *x.shape))


@torch.library.custom_op("cp_compile::state_exchange_grad", mutates_args=())
def state_exchange_grad(grad: Tensor, world: int, group_name: str) -> Tensor:
    """The exchange's backward: a reduce-scatter of every rank's share of (N, k, w), (k, w) each."""
    out = grad.new_empty(grad.shape[1:])
    traffic.add("state exchange grad", grad.numel() * grad.element_size())
    dist.reduce_scatter_single(out, grad.contiguous().view(-1, *grad.shape[2:]), group=group_by_name(group_name).pg)
    return out


@state_exchange_grad.register_fake
def _state_exchange_grad_fake(grad: Tensor, world: int, group_name: str) -> Tensor:
    return grad.new_empty(grad.shape[1:])


def _exchange_context(ctx, inputs, output) -> None:
    ctx.world, ctx.group_name = inputs[1], inputs[2]


def _exchange_backward(ctx, grad: Tensor):
    return state_exchange_grad(grad, ctx.world, ctx.group_name), None, None


state_exchange.register_autograd(_exchange_backward, setup_context=_exchange_context)


@torch.library.custom_op("cp_compile::keep_alive", mutates_args=())
def keep_alive(x: Tensor, anchor: Tensor) -> Tensor:
    """``x`` (a copy), computed after ``anchor``: an op no dead-code pass sees through, so the
    collectives that produce ``anchor`` run on every rank even where nothing else reads it (the
    serial relay's last all-reduces, whose result only later ranks use). Backward: ``x``'s
    gradient passes, ``anchor`` gets zeros computed from that gradient, so the backward of those
    collectives runs too, and in the backward graph: zeros that did not depend on the gradient
    would let AOTAutograd's partitioner move the first few of those all-reduces into the forward
    graph, a different number on each rank (a collective mismatch)."""
    return x.clone()


@keep_alive.register_fake
def _keep_alive_fake(x: Tensor, anchor: Tensor) -> Tensor:
    return torch.empty_like(x)


def _keep_alive_context(ctx, inputs, output) -> None:
    anchor = inputs[1]
    ctx.anchor = (anchor.shape, anchor.dtype, anchor.device)


def _keep_alive_backward(ctx, grad: Tensor):
    shape, dtype, device = ctx.anchor
    zero = grad.reshape(-1)[:1].mul(0).to(dtype=dtype, device=device)  # (1,), depends on the gradient
    return grad, zero.reshape((1,) * len(shape)).expand(shape).contiguous()


keep_alive.register_autograd(_keep_alive_backward, setup_context=_keep_alive_context)


def summary_bytes(maps_shape: Sequence[int], state_shape: Sequence[int], runs: int, world: int,
                  itemsize: int) -> int:
    """Bytes every rank receives in the one all-gather of a state-passed recurrence: N·k summaries."""
    per_run = _numel(maps_shape) + _numel(state_shape)
    return world * runs * per_run * itemsize


def _numel(shape: Sequence[int]) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out


__all__ = ["apply_map", "incoming_states", "keep_alive", "state_exchange", "summary_bytes"]
