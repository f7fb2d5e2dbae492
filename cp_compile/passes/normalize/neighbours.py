"""Neighbour reads along a dim, written in two ops, become one call the halo rule reads.

A causal convolution along the sequence (Hyena, Mamba, "causal conv" blocks) is spelt as a pad
then a convolution without padding, or as a convolution padded on both sides whose output is
sliced back to S; RWKV's token shift as a pad that adds a row at one end and drops one at the
other, or a ``cat`` of zeros and a slice. Each op alone changes the length of the sequence dim,
which no layout can hold (:mod:`..propagate.placements`: one S per rewrite); together they keep
it. This pass writes each pair as one plain function of :mod:`cp_compile.graph_ops` (the same
ops on one device, a program identity), whose rule (:mod:`..propagate.rules.halo`) reads the
neighbouring ranks' boundary tokens:

    conv1d(pad(x, (L, R)), w, b, stride=1, padding=0, d, g)  ->  seq_conv1d(x, w, b, L, R, d, g)
    conv1d(x, w, b, stride=1, padding=P, d, g)[..., a:e]      ->  seq_conv1d(x, w, b, P - a, P - (n - e), d, g)
                                                                   (n: the conv's output length; L, R >= 0)
    pad(x, (.., o, -o, ..)) (constant zeros)                  ->  seq_shift(x, dim, o)
    cat([zeros_like(z), x[.., :n-o]], dim)                    ->  seq_shift(x, dim, o)
    cat([x[.., o:], zeros_like(z)], dim)                      ->  seq_shift(x, dim, -o)

Applied to any such pair (static sizes), wherever its dim is; the rule copies it unchanged where
the dim is not the sequence.
"""

from __future__ import annotations

import operator
from typing import Any, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F

from ... import graph_ops
from ..context import RewriteContext, fake_value, log
from ..fx_utils import erase_unused, source_line
from ..op_vocab import CATS, arguments
from .fake_emit import FakeEmitter

_PADS = {torch._C._nn.pad, F.pad}
_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}
Match = Tuple[Any, tuple]  # (graph_ops function, its arguments)


def fold_neighbour_reads(gm: fx.GraphModule, ctx: RewriteContext) -> int:
    """Write causal / sliced convolutions and token shifts as ``seq_conv1d`` / ``seq_shift``; the count."""
    count = 0
    for node in list(gm.graph.nodes):
        found = _pad_conv(node) or _conv_slice(node) or _pad_shift(node) or _cat_shift(node)
        if found is None:
            continue
        target, args = found
        new = FakeEmitter(gm.graph, node, args[0]).fn(target, *args)
        inputs = node.all_input_nodes
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        erase_unused(gm.graph, inputs)
        log.info("cp_compile: %s (%s) written as %s", node.name, source_line(new), target.__name__)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _int(v: Any) -> Any:
    """A 1-d conv argument as an int (``(1,)`` -> 1); strings and anything else as given."""
    return v[0] if isinstance(v, (tuple, list)) and len(v) == 1 else v


def _conv(node: Any) -> Optional[dict]:
    """A stride-1 ``conv1d``'s arguments by name (1-d ones as ints), or None."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target is not torch.conv1d:
        return None
    a = {k: _int(v) for k, v in dict(_CONV_DEFAULTS, **arguments(node, _CONV_ARGS)).items()}
    ok = set(a) == set(_CONV_ARGS) and a["stride"] == 1 and type(a["dilation"]) is int and type(a["groups"]) is int
    return a if ok and isinstance(a["input"], fx.Node) else None


def _zero_pad(node: Any) -> Optional[Tuple[fx.Node, list]]:
    """``(x, pads)`` of a constant zero ``F.pad`` with static int pads, else None."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target not in _PADS:
        return None
    a = arguments(node, ("input", "pad", "mode", "value"))
    pads = a.get("pad")
    if a.get("mode", "constant") != "constant" or a.get("value") not in (None, 0, 0.0) \
            or not isinstance(pads, (list, tuple)) or not all(type(p) is int for p in pads):
        return None
    return (a["input"], list(pads)) if isinstance(a["input"], fx.Node) else None


def _pad_conv(node: fx.Node) -> Optional[Match]:
    """``conv1d(pad(x, (L, R)), padding=0)`` with L, R >= 0."""
    a = _conv(node)
    padded = _zero_pad(a["input"]) if a is not None and a["padding"] in (0, "valid") else None
    if padded is None or len(padded[1]) != 2 or min(padded[1]) < 0:
        return None
    (x, (left, right)) = padded
    return graph_ops.seq_conv1d, (x, a["weight"], a["bias"], left, right, a["dilation"], a["groups"])


def _conv_slice(node: fx.Node) -> Optional[Match]:
    """``conv1d(x, padding=P)[..., a:e]`` (step 1) that reads no zero beyond P on either side."""
    sliced = _dim_slice(node)
    a = _conv(sliced[0]) if sliced is not None else None
    if a is None or type(a["padding"]) is not int or sliced[1] != len(fake_value(sliced[0]).shape) - 1:
        return None
    (_, _, start, stop, n) = sliced
    left, right = a["padding"] - start, a["padding"] - (n - stop)
    if left < 0 or right < 0:
        return None
    return graph_ops.seq_conv1d, (a["input"], a["weight"], a["bias"], left, right, a["dilation"], a["groups"])


def _pad_shift(node: fx.Node) -> Optional[Match]:
    """``pad(x, (.., o, -o, ..))``: one dim padded at one end and cropped at the other by as much."""
    padded = _zero_pad(node)
    if padded is None or len(padded[1]) % 2:
        return None
    x, pads = padded
    pairs = [(i, pads[2 * i], pads[2 * i + 1]) for i in range(len(pads) // 2) if pads[2 * i] or pads[2 * i + 1]]
    if len(pairs) != 1 or pairs[0][1] + pairs[0][2] != 0:
        return None
    i, offset, _ = pairs[0]
    return graph_ops.seq_shift, (x, len(fake_value(x).shape) - 1 - i, offset)


def _cat_shift(node: fx.Node) -> Optional[Match]:
    """``cat([zeros_like(z), x[.., :n-o]], d)`` or ``cat([x[.., o:], zeros_like(z)], d)``."""
    if node.op != "call_function" or node.target not in CATS:
        return None
    a = arguments(node, ("tensors", "dim"))
    parts = a.get("tensors")
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or not all(isinstance(p, fx.Node) for p in parts):
        return None
    zeros_first = _is_zeros(parts[0])
    sliced = _dim_slice(parts[1] if zeros_first else parts[0])
    if sliced is None or not _is_zeros(parts[0] if zeros_first else parts[1]):
        return None
    x, dim, start, stop, n = sliced
    out, val = fake_value(node), fake_value(x)
    if dim != a.get("dim", 0) % len(val.shape) or tuple(out.shape) != tuple(val.shape) or out.dtype != val.dtype:
        return None
    offset = n - stop if zeros_first else -start
    kept = (start, stop) == ((0, n - offset) if zeros_first else (-offset, n))
    return (graph_ops.seq_shift, (x, dim, offset)) if kept and offset else None


def _is_zeros(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.zeros_like and not node.kwargs


def _dim_slice(node: Any) -> Optional[Tuple[fx.Node, int, int, int, int]]:
    """``(x, dim, start, stop, n)`` when ``node`` is ``x[..]`` slicing one dim of static size n with step 1
    (every other dim whole), else None."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target is not operator.getitem \
            or not isinstance(node.args[0], fx.Node) or not isinstance(fake_value(node.args[0]), torch.Tensor):
        return None
    shape, index = fake_value(node.args[0]).shape, node.args[1]
    index = list(index) if isinstance(index, tuple) else [index]
    if index.count(Ellipsis) == 1:
        at = index.index(Ellipsis)
        index = index[:at] + [slice(None)] * (len(shape) - len(index) + 1) + index[at + 1:]
    if len(index) > len(shape) or not all(isinstance(i, slice) for i in index):
        return None
    cut = [d for d, i in enumerate(index) if i != slice(None)]
    if len(cut) != 1 or type(shape[cut[0]]) is not int:
        return None
    s = index[cut[0]]
    if not all(v is None or type(v) is int for v in (s.start, s.stop, s.step)):
        return None
    start, stop, step = s.indices(shape[cut[0]])
    return (node.args[0], cut[0], start, stop, shape[cut[0]]) if step == 1 and stop > start else None
