"""How many tokens one entry of a dim holds: C when the sequence was viewed in chunks of C before it.

    x = h.view(B, S // C, C, D)        # the sequence cut into chunks
    tokens_per_entry(x, S // C) -> C   # one entry of dim 1 is C tokens
    tokens_per_entry(h, S)      -> 1

The normalize passes that fold a scan or a loop over chunks (:mod:`.decay_scans`, :mod:`.fold_loops`)
measure its length in tokens with it, so it can be compared with the attention's sequence length.
"""

from __future__ import annotations

from typing import List

import torch.fx as fx

from ..context import fake_value
from ..op_vocab import RESHAPES, is_

SEARCH = 320  # ancestors searched for the view that made the chunks


def nearest_ancestors(node: fx.Node, limit: int) -> List[fx.Node]:
    """Up to ``limit`` ancestors of ``node``, nearest first (breadth first)."""
    seen, frontier, order = {node}, [node], []
    while frontier and len(order) < limit:
        nxt = []
        for n in frontier:
            for p in n.all_input_nodes:
                if p not in seen:
                    seen.add(p)
                    order.append(p)
                    nxt.append(p)
        frontier = nxt
    return order


def tokens_per_entry(x: fx.Node, n: int, limit: int = SEARCH) -> int:
    """The tokens per entry of a dim of ``n`` entries of ``x``: C when the nearest view among x's
    ancestors (or x itself) that splits a dim into (n, C) made them (the sequence cut into chunks), else 1."""
    for node in [x, *nearest_ancestors(x, limit)]:
        if is_(node, RESHAPES):
            shape, src = tuple(fake_value(node).shape), tuple(fake_value(node.args[0]).shape)
            for k in range(len(shape) - 1):
                if shape[k] == n and shape[k + 1] > 1 and shape[:k] == src[:k] and len(src) > k \
                        and src[k] == n * shape[k + 1]:  # dim k split into (n, C), the dims before it kept
                    return int(shape[k + 1])
    return 1


__all__ = ["nearest_ancestors", "tokens_per_entry"]
