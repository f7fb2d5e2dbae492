"""A patch-embedding convolution becomes patchify + linear, one patch per row.

A convolution whose stride equals its kernel, with no padding, dilation 1 and one group
(ViT's ``nn.Conv2d(C, D, p, stride=p)``, a video tubelet ``nn.Conv3d(C, D, (t, p, p),
stride=(t, p, p))``, an audio ``nn.Conv1d`` over frames) computes each output position
from its own patch only: it is a per-token linear over the patches. As one ATen
``convolution`` the rewrite cannot see that (the rule oracle keeps only a batch-sharded
convolution), so where the sequence arises after it (:mod:`.seq_origins`) every rank
would embed every patch. This pass writes it as what it is, so the row selection
(:mod:`.row_select`) moves this rank's positions up to the image itself.

Before (2-D; kernel (p, q), stride (p, q), input (B, C, H, W) with H = h·p, W = w·q)::

    y = conv2d(x, w, b, stride=(p, q))                          # (B, D, h, w)
    t = y.flatten(2)                                            # (B, D, h·w)

After::

    v = x.reshape(B, C, h, p, w, q).permute(0, 2, 4, 1, 3, 5)   # (B, h, w, C, p, q), a view
    P = v.reshape(B, h·w, C·p·q)                                 # (B, L, K) one patch per row
    e = F.linear(P, w.reshape(D, C·p·q), b)                      # (B, L, D)
    t = e.transpose(1, 2)                                       # (B, D, L): users that flatten
    y = t.reshape(B, D, h, w)                                   # the grid: any other user

Exact up to the rounding of a matmul against the convolution's. Only convolutions that
feed some attention's q/k/v and take no tensor with a dim of size S (the sequence arises
at or after them), with static sizes divisible by the kernel, are opened, and only when no
input carries the sequence and S is static (what :mod:`..analyze.seq_origins` then needs).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..analyze.seq_origins import needs_origins, qkv_feeds
from ..context import RewriteContext, log
from ..fx_utils import fake_value, global_shape, source_line
from ..op_vocab import FLATTENS, RESHAPES, arguments
from .fake_emit import FakeEmitter

_CONVS = {torch.conv1d: 1, torch.conv2d: 2, torch.conv3d: 3}
_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}


def open_patch_convs(gm: fx.GraphModule, ctx: RewriteContext) -> int:
    """Open every patch convolution that feeds attention's q/k/v when the sequence will be sharded
    where it arises (static S); return how many."""
    if not needs_origins(ctx) or ctx.seq_sym is not None:
        return 0
    feeds = qkv_feeds(gm, ctx)
    count = 0
    for node in list(gm.graph.nodes):
        if node in feeds and _is_patch_conv(node, ctx.seq_len):
            _open(gm.graph, node)
            log.info("cp_compile: patch convolution %s (%s) opened into patches + linear", node.name,
                     source_line(node))
            count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _conv_args(node: fx.Node) -> Optional[Dict[str, Any]]:
    """The convolution's arguments by name, defaults filled in; None if not a convolution."""
    if node.op != "call_function" or node.target not in _CONVS:
        return None
    a = dict(_DEFAULTS, **arguments(node, _ARGS))
    return a if set(a) == set(_ARGS) else None


def _tuple(v: Any, n: int) -> Optional[Tuple[int, ...]]:
    v = tuple(v) if isinstance(v, (tuple, list)) else (v,) * n
    return v if len(v) == n and all(type(i) is int for i in v) else None


def _is_patch_conv(node: fx.Node, seq_len: int) -> bool:
    """A batched, static convolution with stride == kernel, no padding, dilation 1, one group,
    whose input has no dim of size S and whose spatial sizes the kernel divides."""
    a = _conv_args(node)
    if a is None or not isinstance(a["input"], fx.Node) or not isinstance(a["weight"], fx.Node):
        return False
    n = _CONVS[node.target]
    if not all(type(d) is int for t in (a["input"], a["weight"]) for d in fake_value(t).shape):
        return False  # symbolic sizes: the reshapes below would bake them in
    x, w = global_shape(a["input"]), global_shape(a["weight"])
    kernel = tuple(w[2:]) if w is not None else None
    if x is None or len(x) != n + 2 or seq_len in x or kernel is None or a["groups"] != 1:
        return False
    if _tuple(a["stride"], n) != kernel or _tuple(a["dilation"], n) != (1,) * n:
        return False
    if a["padding"] != "valid" and _tuple(a["padding"], n) != (0,) * n:
        return False
    return all(size % k == 0 for size, k in zip(x[2:], kernel))


def _open(graph: fx.Graph, conv: fx.Node) -> None:
    """Replace ``conv`` by patchify + linear (see the module docstring)."""
    a = _conv_args(conv)
    (B, C, *spatial), (D, _, *kernel) = global_shape(a["input"]), global_shape(a["weight"])
    grid = [s // k for s, k in zip(spatial, kernel)]
    n, K, L = len(grid), C * math.prod(kernel), math.prod(grid)
    em = FakeEmitter(graph, conv, a["input"])
    split = [d for g, k in zip(grid, kernel) for d in (g, k)]  # (h, p, w, q, ...)
    v = em.method("reshape", a["input"], (B, C, *split))  # (B, C, h, p, w, q)
    v = em.method("permute", v, (0, *range(2, 2 + 2 * n, 2), 1, *range(3, 3 + 2 * n, 2)))  # (B, h, w, C, p, q)
    patches = em.method("reshape", v, (B, L, K))  # (B, L, K)
    e = em.fn(F.linear, patches, em.method("reshape", a["weight"], (D, K)), a["bias"])  # (B, L, D)
    flat = em.method("transpose", e, 1, 2)  # (B, D, L)
    users = list(conv.users)
    if not all(_flattens(u, (B, D, L)) for u in users):
        shaped = em.method("reshape", flat, (B, D, *grid))  # (B, D, h, w): the convolution's output
    for user in users:
        user.replace_input_with(conv, flat if _flattens(user, (B, D, L)) else shaped)
    graph.erase_node(conv)


def _flattens(user: fx.Node, flat: Sequence[int]) -> bool:
    """``user`` reshapes the grid to (B, D, L): it reads the flat value instead."""
    return user.op == "call_method" and user.target in RESHAPES | FLATTENS and global_shape(user) == tuple(flat)
