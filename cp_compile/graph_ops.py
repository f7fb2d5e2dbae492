"""Autograd-aware primitives that the rewritten graphs call.

Gradient contract of a rewritten graph (what makes every rule below compose):
on each rank, the backward computes a *share* of every gradient such that the sum
of the shares over the CP group is the single-device gradient.

* a ``Sharded`` value's local rows get their full gradient on the owning rank;
* a ``Global`` value (replicated on every rank: weights, positions, a gathered
  tensor, the loss) gets a share per rank, summing to its gradient.

Hence: graph outputs that every rank computes identically scale their incoming
gradient by 1/N (:func:`grad_scale`); a gather's backward is a reduce-scatter
(:func:`gather_seq`); an all-reduce's backward is an all-reduce
(:func:`all_reduce_sum`); and parameters (Global leaves) get their gradient as the
sum of the shares, an all-reduce in the backward graph (:func:`grad_all_reduce`).
Collectives are ``_c10d_functional`` ops, so AOTAutograd traces them into the
forward/backward graphs where Inductor can schedule them.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .ring.masking import additive_mask

Tensor = torch.Tensor
_c10d = torch.ops._c10d_functional


def _all_reduce(x: Tensor, group_name: str) -> Tensor:
    return _c10d.wait_tensor(_c10d.all_reduce(x.contiguous(), "sum", group_name))


class _GradAllReduce(torch.autograd.Function):
    """Identity forward; the backward sums the gradient shares over the group."""

    @staticmethod
    def forward(ctx, x: Tensor, group_name: str) -> Tensor:
        ctx.group_name = group_name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_reduce(grad, ctx.group_name), None


class _AllReduceSum(_GradAllReduce):
    """Sums the forward too; same backward."""

    @staticmethod
    def forward(ctx, x: Tensor, group_name: str) -> Tensor:
        ctx.group_name = group_name
        return _all_reduce(x, group_name)


class _GradAllReduceBucket(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group_name: str, *xs: Tensor):
        ctx.group_name = group_name
        ctx.shapes = [x.shape for x in xs]
        ctx.set_materialize_grads(False)  # a member nothing reads gets no gradient, as in one process
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads: Optional[Tensor]):
        # one collective for the whole bucket; a member without a gradient sends zeros and gets None
        flat = torch.cat([(g if g is not None else torch.zeros(shape, dtype=_dtype(grads), device=_device(grads)))
                          .reshape(-1) for g, shape in zip(grads, ctx.shapes)])
        summed = _all_reduce(flat, ctx.group_name)
        sizes = [math.prod(shape) for shape in ctx.shapes]
        parts = [part.view(shape) for part, shape in zip(summed.split(sizes), ctx.shapes)]
        return (None, *(p if g is not None else None for p, g in zip(parts, grads)))


def _dtype(grads: tuple) -> torch.dtype:
    return next(g.dtype for g in grads if g is not None)


def _device(grads: tuple) -> torch.device:
    return next(g.device for g in grads if g is not None)


class _GatherStack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, world: int, group_name: str) -> Tensor:
        ctx.world, ctx.group_name = world, group_name
        flat = _c10d.wait_tensor(_c10d.all_gather_into_tensor(x.contiguous(), world, group_name))  # (N·a, ...)
        return flat.view(world, *x.shape)

    @staticmethod
    def backward(ctx, grad: Tensor):
        # every rank holds the same (N, ...) value, so each holds a share of its gradient: rank r's
        # contribution gets the sum over ranks of their shares of entry r
        flat = grad.contiguous().view(-1, *grad.shape[2:])
        return _c10d.wait_tensor(_c10d.reduce_scatter_tensor(flat, "sum", ctx.world, ctx.group_name)), None, None


class _GradScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.scale, None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, dim: int, order: Tensor, inverse: Tensor, world: int, group_name: str) -> Tensor:
        ctx.dim, ctx.world, ctx.group_name = dim, world, group_name
        ctx.save_for_backward(order)
        local = x.movedim(dim, 0).contiguous()  # (c, ...)
        gathered = _c10d.wait_tensor(_c10d.all_gather_into_tensor(local, world, group_name))  # (S, ...) rank-major
        # global order, in a fresh row-major tensor as one process holds it: not a view of a value made
        # in here (autograd forbids writing into those: HF Qwen3-Next's chunked delta rule writes into
        # its gathered output), and view()-able like the original (HF's Qwen4 views it)
        return gathered.index_select(0, inverse).movedim(0, dim).contiguous()

    @staticmethod
    def backward(ctx, grad: Tensor):
        (order,) = ctx.saved_tensors
        g = grad.movedim(ctx.dim, 0)  # (S, ...); padding positions (S..S_pad) get zero gradient
        g = torch.cat([g, g.new_zeros((order.numel() - g.shape[0], *g.shape[1:]))])
        rank_major = g.index_select(0, order).contiguous()  # (S_pad, ...)
        local = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(rank_major, "sum", ctx.world, ctx.group_name))
        return local.movedim(0, ctx.dim), None, None, None, None, None


def all_reduce_sum(x: Tensor, group_name: str) -> Tensor:
    """Sum over the CP group (Partial -> Global); backward: all-reduce of the gradient shares."""
    return _AllReduceSum.apply(x, group_name)


def grad_all_reduce(x: Tensor, group_name: str) -> Tensor:
    """Identity forward; backward sums the gradient shares over the CP group (parameters)."""
    return _GradAllReduce.apply(x, group_name)


def grad_all_reduce_bucket(xs: list, group_name: str) -> tuple:
    """``grad_all_reduce`` for several small tensors at once: one flat all-reduce in the backward."""
    return _GradAllReduceBucket.apply(group_name, *xs)


def grad_scale(x: Tensor, scale: float) -> Tensor:
    """Identity forward; backward multiplies the gradient by ``scale`` (1/N at Global outputs)."""
    return _GradScale.apply(x, scale)


def gather_stack(x: Tensor, world: int, group_name: str) -> Tensor:
    """Every rank's ``x`` stacked in rank order: (N, *x.shape), the same value on every rank (Global).

    For small per-rank summaries (candidates of a reduction, totals of a scan, boundary tokens);
    backward: a reduce-scatter of the gradient shares, so rank r's ``x`` gets the sum of every
    rank's share of entry r."""
    return _GatherStack.apply(x, world, group_name)


def gather_seq(x: Tensor, dim: int, order: Tensor, inverse: Tensor, world: int, group_name: str) -> Tensor:
    """Sharded(dim) -> Global: all-gather the shards and undo the layout permutation.

    ``order``: global positions held by ranks 0..N-1, concatenated (S_pad,);
    ``inverse``: the first S entries of its argsort (padding dropped). Backward:
    permute back and reduce-scatter the gradient shares.
    """
    return _GatherSeq.apply(x, dim, order, inverse, world, group_name)


def seq_conv1d(x: Tensor, weight: Tensor, bias: Optional[Tensor], left: int, right: int, dilation: int,
               groups: int) -> Tensor:
    """``F.conv1d(F.pad(x, (left, right)), weight, bias, 1, 0, dilation, groups)``: a stride-1 convolution
    along the last dim with ``left`` / ``right`` zeros around it. The one spelling a causal or "same"
    convolution along the sequence gets (:mod:`cp_compile.passes.normalize.neighbours`), whose layout
    rule reads the neighbouring ranks' boundary tokens (:mod:`cp_compile.passes.propagate.rules.halo`)."""
    return torch.nn.functional.conv1d(torch.nn.functional.pad(x, (left, right)), weight, bias, 1, 0, dilation,
                                      groups)


def seq_shift(x: Tensor, dim: int, offset: int) -> Tensor:
    """``y[p] = x[p - offset]`` along ``dim``, zeros where ``p - offset`` falls outside (RWKV's token shift
    ``F.pad(x, (0, 0, 1, -1))``, ``cat([zeros, x[:, :-1]], 1)``): one spelling for the halo rule."""
    n = x.shape[dim]
    o = min(abs(offset), n)
    zeros = torch.zeros_like(x.narrow(dim, 0, o))
    if offset >= 0:
        return torch.cat([zeros, x.narrow(dim, 0, n - o)], dim)
    return torch.cat([x.narrow(dim, o, n - o), zeros], dim)


def ring_outputs(out: Tensor, lse: Tensor) -> tuple:
    """``(out, lse)``: a ring op's outputs as one value again, after each was put back in sequence shards
    (an attention given Ulysses, :mod:`cp_compile.passes.finalize.strategy`)."""
    return out, lse


# The functions above that send or receive in the forward (a checkpointed region saves their results
# rather than recomputing them in the backward: cp_compile.passes.normalize.regions).
COMMUNICATING = (all_reduce_sum, gather_seq, gather_stack)

# Every function above that the rewrite emits as a graph node (see :mod:`cp_compile.backend.aot_cache`).
GRAPH_FUNCTIONS = (all_reduce_sum, grad_all_reduce, grad_all_reduce_bucket, grad_scale, gather_seq, gather_stack,
                   seq_conv1d, seq_shift, ring_outputs,
                   additive_mask)  # the last: an explicit attention mask for the ring op (passes/masks/rows.py)
