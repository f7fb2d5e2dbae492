"""Layout rules for neighbour reads along the sequence: convolutions, shifts, ``roll`` (halo exchange).

    x (B, C, S/N) Sharded(2)   conv1d(x, w, b, padding=P)  (stride 1, 2P = d(K-1), or "same")
                               seq_conv1d(x, w, b, L, R, d, g)  (causal: pad + conv, conv + slice;
                                                                 normalize/neighbours.py, L + R = d(K-1))
                                  -> (B, C, S/N) Sharded(2)
    x (B, S/N, D) Sharded(1)   seq_shift(x, 1, o)  (RWKV's token shift)  -> Sharded(1)
    x (B, S/N, D) Sharded(1)   torch.roll(x, o, 1)                       -> Sharded(1)

A rank's tokens are k contiguous runs of the global order (``em.index.chunks()``: one run for
"contiguous", two for zig-zag). An output near a run's edge needs the last L tokens of the run
before it in global order or the first R of the run after it (zeros beyond the ends, as the pad
gives; ``roll`` wraps around). So every rank contributes, for each of its runs, its first R and
last L tokens (padding rows zeroed first, so reads past the real end see zeros); one
``gather_stack`` gives every rank all of them, O(N·k·(L+R)·B·C) values. The op runs on the local
tokens as if they were one run (right inside each run), and each run's first L and last R outputs
are recomputed from a small window and written in place (one local-sized result, no copy per run):

    run j (chunk i):  y = conv1d(local, padding)            right but at the runs' edges
                      y[first L of run j] = conv1d([last L of chunk i-1 | first L+R of run j])
                      y[last R of run j]  = conv1d([last L+R of run j | first R of chunk i+1])

The gradient flows through autograd: the gather's backward reduce-scatters each halo's gradient
back to the rank that owns those tokens. Refused to the gather (warned): a layout without
contiguous runs (striped on several ranks, documents), a symbolic S, halos L + R wider than a run (tiny
S, wide kernel), a stride other than 1 or padding that changes the length (a stride-k conv
with kernel k is a patch embedding, opened before the rewrite where the sequence arises after it:
``normalize/patch_conv.py``), and ``roll`` along a padded sequence (its wrap would have to skip
the padding).
"""

from __future__ import annotations

import operator
from typing import Any, Dict, List, Optional

import torch
import torch.fx as fx

from .... import graph_ops
from ...context import global_shape
from ...op_vocab import arguments
from ..emitter import Emitter
from ..oracle import decide
from ..placements import Sharded
from .common import _ndim, _sharded
from .registry import register_rule

_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}


@register_rule(torch.conv1d)
def conv1d(em: Emitter, node: fx.Node):
    """``conv1d`` along the sequence with stride 1 and an output of length S ("same" or 2P = d(K-1)):
    the halo version; along another dim: per token (or the oracle)."""
    a = {k: _int(v) for k, v in dict(_CONV_DEFAULTS, **arguments(node, _CONV_ARGS)).items()}
    x, s = a["input"], _sharded(em, a["input"])
    if not _along_length(em, node, x, _ndim(x) - 1):
        return _off_sequence(em, node, x, s)
    total = a["dilation"] * (global_shape(a["weight"])[-1] - 1)  # d(K-1): the halo the kernel reads
    if a["padding"] == "same":
        left = total // 2
    elif type(a["padding"]) is int and 2 * a["padding"] == total:
        left = a["padding"]
    else:
        left = None
    if a["stride"] != 1 or left is None or type(a["groups"]) is not int or type(a["dilation"]) is not int:
        return em.fallback(node, f"conv1d along the sequence with stride {a['stride']} and padding {a['padding']} "
                                 "(its output length is not S)")
    return _conv(em, node, a, left, total - left)


@register_rule(graph_ops.seq_conv1d)
def seq_conv1d(em: Emitter, node: fx.Node):
    """``seq_conv1d(x, w, b, L, R, d, g)`` along the sequence with L + R = d(K-1) (causal, any split):
    the halo version; along another dim: per token."""
    a = arguments(node, ("x", "weight", "bias", "left", "right", "dilation", "groups"))
    a["input"] = a.pop("x")
    x, s = a["input"], _sharded(em, a["input"])
    if not _along_length(em, node, x, _ndim(x) - 1):
        return _off_sequence(em, node, x, s)
    if a["left"] + a["right"] != a["dilation"] * (global_shape(a["weight"])[-1] - 1):
        return em.fallback(node, f"a convolution along the sequence padded by ({a['left']}, {a['right']}) "
                                 "(its output length is not S)")
    return _conv(em, node, a, a["left"], a["right"])


@register_rule(graph_ops.seq_shift)
def seq_shift(em: Emitter, node: fx.Node):
    """``seq_shift(x, d, o)`` (y[p] = x[p - o], zeros outside): along the sequence the halo version."""
    a = arguments(node, ("x", "dim", "offset"))
    x, dim, offset = a["x"], a["dim"], a["offset"]
    s, dim = _sharded(em, x), dim % _ndim(x)
    if s is None or s.dim != dim:  # along another dim: each token's row shifted on its own
        return em.copy(node, *em.value((node.args, node.kwargs))), s
    return _shifted(em, node, x, em.env[x], dim, offset, circular=False)


@register_rule(torch.roll, "roll")
def roll(em: Emitter, node: fx.Node):
    """``torch.roll(x, shifts, dims)``: along the sequence the halo version, wrapping around the sequence
    (other dims rolled first, per token); over the flattened tensor (no dims) gathered."""
    a = arguments(node, ("input", "shifts", "dims"))
    x, s, shifts, dims = a["input"], _sharded(em, a["input"]), a.get("shifts"), a.get("dims")
    if dims is None or dims == ():
        return em.fallback(node, "roll over the flattened tensor")
    shifts, dims = _tuple(shifts), [d % _ndim(x) for d in _tuple(dims)]
    if s.dim not in dims:
        return em.copy(node, *em.value((node.args, node.kwargs))), s
    at = dims.index(s.dim)
    rest_shifts, rest_dims = shifts[:at] + shifts[at + 1:], dims[:at] + dims[at + 1:]
    local = em.call(torch.roll, em.env[x], rest_shifts, rest_dims) if rest_dims else em.env[x]
    if type(shifts[at]) is not int or em.ctx.seq_sym is not None:
        return em.fallback(node, "roll along the sequence by a computed shift, or of a symbolic length")
    if em.ctx.padded:
        return em.fallback(node, f"roll along a sequence padded from {em.ctx.seq_len} to {em.ctx.padded_len} "
                                 "tokens (its wrap would have to skip the padding; a length divisible by 2N has none)")
    n = em.ctx.seq_len
    offset = shifts[at] % n
    offset = offset - n if offset > n // 2 else offset  # the nearer way round: the narrower halo
    if offset == 0:
        return em.method("clone", local), s
    return _shifted(em, node, x, local, s.dim, offset, circular=True)


# -- the halo ---------------------------------------------------------------------------------------------
def _conv(em: Emitter, node: fx.Node, a: Dict[str, Any], left: int, right: int):
    """The convolution on the local tokens as if they were one run (zero padded), then each run's first L and
    last R outputs, which read the neighbouring runs, recomputed from small windows and written in place."""
    x, w, b = a["input"], em.value(a["weight"]), em.value(a["bias"])
    dim = _ndim(x) - 1
    conv = lambda t, pad: em.call(torch.conv1d, t, w, b, 1, pad, a["dilation"], a["groups"])  # noqa: E731
    if left == right == 0:  # a kernel of one token (or dilation 0): per token
        return _named(node, conv(em.env[x], 0)), Sharded(dim)
    halo = _halo(em, x, em.env[x], dim, left, right, circular=False)
    if isinstance(halo, str):
        return em.fallback(node, f"conv1d along the sequence: {halo}")
    local, runs, run = halo
    width, c = max(left, right), run * len(runs)
    y = conv(local, width)  # (B, C', c + 2·width - L - R): right inside each run, not at its L first / R last
    if width != left or left != right:
        y = em.method("narrow", y, dim, width - left, c)  # (B, C', c), a view
    for start, before, after in runs:  # windows of 2L + R / L + 2R tokens give the boundary outputs
        if left:
            window = em.call(torch.cat, [before, em.method("narrow", local, dim, start, left + right)], dim)
            em.method("copy_", em.method("narrow", y, dim, start, left), conv(window, 0))
        if right:
            window = em.call(torch.cat, [em.method("narrow", local, dim, start + run - left - right, left + right),
                                         after], dim)
            em.method("copy_", em.method("narrow", y, dim, start + run - right, right), conv(window, 0))
    return _named(node, y), Sharded(dim)


def _shifted(em: Emitter, node: fx.Node, x: fx.Node, local: fx.Node, dim: int, offset: int, circular: bool):
    """y[p] = x[p - offset] along the sequence dim ``dim``: the local tokens shifted as one run, then each
    run's first ``offset`` (or last ``-offset``) rows written from the neighbouring run's end."""
    what = "roll" if circular else "a shift"
    if not _along_length(em, node, x, dim):
        return em.fallback(node, f"{what} along tokens merged with other dims")
    y = _shift_local(em, x, local, dim, offset, circular)
    if isinstance(y, str):
        return em.fallback(node, f"{what} along the sequence: {y}")
    return _named(node, y), Sharded(dim)


def shifted_rows(em: Emitter, x: fx.Node, dim: int, offset: int) -> Any:
    """The local rows of Sharded ``x`` moved ``offset`` positions along the global order of ``dim``
    (y[p] = x[p - offset], zeros outside the sequence) as a new local value, or why not (a str).
    pointwise.py aligns two windows of one value with it (``h[:, 1:] - h[:, :-1]``)."""
    return _shift_local(em, x, em.env[x], dim, offset, False)


def _shift_local(em: Emitter, x: fx.Node, local: fx.Node, dim: int, offset: int, circular: bool) -> Any:
    """y[p] = x[p - offset] on this rank's rows ``local`` of x: shifted as one run, then each run's first
    ``offset`` (or last ``-offset``) rows written from the neighbouring run's end; or why not (a str)."""
    halo = _halo(em, x, local, dim, max(offset, 0), max(-offset, 0), circular)
    if isinstance(halo, str):
        return halo
    local, runs, run = halo
    y = em.call(graph_ops.seq_shift, local, dim, offset)  # right inside each run
    for start, before, after in runs:
        if offset > 0:
            em.method("copy_", em.method("narrow", y, dim, start, offset), before)
        else:
            em.method("copy_", em.method("narrow", y, dim, start + run + offset, -offset), after)
    return y


def _halo(em: Emitter, x: fx.Node, local: fx.Node, dim: int, left: int, right: int, circular: bool) -> Any:
    """``(local, runs, run)``: the local tokens (padding rows zeroed), and for each of this rank's runs of
    ``run`` tokens along ``dim`` its start and the ``left`` tokens before it and ``right`` after it in
    global order (zeros beyond the ends, or wrapped when ``circular``); or why it cannot be done (a str)."""
    found = em.index.chunks()
    if found is None:
        return f"load_balance={em.ctx.options.load_balance!r} holds no contiguous runs of tokens"
    table, run = found
    if not isinstance(run, int):
        return "a symbolic sequence length (compile with dynamic=False)"
    if left + right > run:
        return f"a halo of ({left}, {right}) tokens is wider than a rank's run of {run}"
    mask = em.valid_mask(x, local, dim, 1)
    if mask is not None:  # padding rows read as zeros, as the single-device pad gives
        local = em.method("masked_fill", local, em.call(torch.logical_not, mask), 0)
    n, k = table.shape
    mine = [em.call(torch.cat, [em.method("narrow", local, dim, j * run, right),
                                em.method("narrow", local, dim, j * run + run - left, left)], dim)
            for j in range(k)]  # (.., R + L, ..): the first R and last L tokens of each run
    every = em.call(graph_ops.gather_stack, em.call(torch.stack, mine), n, em.ctx.group.name)  # (N, k, .., R+L, ..)
    every = em.method("flatten", every, 0, 1)  # (N·k, .., R+L, ..): row r·k + j is rank r's run j
    order = torch.argsort(table.reshape(-1))  # global chunk i -> its row
    if not torch.equal(order, torch.arange(n * k)):
        every = em.method("index_select", every, 0, em.const(f"_cp_halo_order_{n}_{k}", order))  # chunk order
    first, last = (em.method("narrow", every, 0, at, 1) for at in (0, n * k - 1))
    if not circular:  # zeros beyond the ends
        first = last = em.call(torch.zeros_like, first)
    ends = em.call(torch.cat, [last, every, first], 0)  # (N·k + 2, ..): entry i + 1 is chunk i's ends
    runs = []
    for j in range(k):  # every rank reads ``ends``: the gather is live on all of them
        i = int(table[em.ctx.group.rank, j])
        before = em.method("narrow", em.call(operator.getitem, ends, i), dim, right, left)  # last L of chunk i - 1
        after = em.method("narrow", em.call(operator.getitem, ends, i + 2), dim, 0, right)  # first R of chunk i + 1
        runs.append((j * run, before, after))
    return local, runs, run


# -- helpers ----------------------------------------------------------------------------------------------
def _named(node: fx.Node, out: fx.Node) -> fx.Node:
    """``out`` as ``node``'s value: its meta (global value, source line)."""
    out.meta = dict(node.meta)
    return out


def _along_length(em: Emitter, node: fx.Node, x: Any, dim: int) -> bool:
    """Whether ``x`` is Sharded along ``dim`` as a plain sequence dim (size S, nothing merged into it) and
    no other tensor argument of ``node`` is Sharded: the case the halo handles."""
    s = _sharded(em, x)
    others = [a for a in node.all_input_nodes if a is not x and _sharded(em, a) is not None]
    return s is not None and not others and s.dim == dim and s.inner == 1 and global_shape(x)[dim] == em.ctx.seq_len


def _off_sequence(em: Emitter, node: fx.Node, x: fx.Node, s: Optional[Sharded]):
    """A convolution whose input is Sharded other than along its length: per token along a batch dim
    (tokens flattened into it), else the oracle's verdict, else gathered."""
    others = [a for a in node.all_input_nodes if a is not x and _sharded(em, a) is not None]
    if s is not None and s.dim == 0 and _ndim(x) == 3 and not others:
        return em.copy(node, *em.value((node.args, node.kwargs))), s
    decided = decide(em, node) if node.target is torch.conv1d else None
    return decided if decided is not None else em.fallback(node, "a convolution mixing the sequence with other dims")


def _int(v: Any) -> Any:
    """A 1-d conv argument as an int (``(1,)`` -> 1); strings and anything else as given."""
    return v[0] if isinstance(v, (tuple, list)) and len(v) == 1 else v


def _tuple(v: Any) -> List[Any]:
    return list(v) if isinstance(v, (tuple, list)) else [v]
