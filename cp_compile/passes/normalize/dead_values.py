"""Values the graph computes and never reads, when computing them has no effect of its own.

    scores = q @ k.transpose(-1, -2) / 8 ** 0.5
    keep = scores.clone()                         # never read: a dead branch of `scores`
    out = softmax(scores.masked_fill(~mask, -inf), -1) @ v

The attention matcher (:mod:`.attention_match`) asks whether the scores and weights have other
readers than the chain to the output; a dead branch is not one (:func:`live_users`), and
:mod:`.fuse_attention` erases it with the chain (:func:`dead_branch`). Only copies, views, casts and
deterministic arithmetic count as dead (:data:`DROPPABLE`): nothing that writes in place (``x += y``:
its result may be unread while ``x`` is), draws random numbers (a dead dropout still advances the
generator the single-device run uses), communicates or calls user code. No pass drops dead values
graph-wide: Dynamo's unrolled loops hold the last step's values for a next step, which the loop
matcher reads.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch.fx as fx

from ..fx_utils import IN_PLACE_OPERATORS, writes_in_place
from ..op_vocab import (ADD, CASTS, DIV, EINSUM, FLATTENS, MASKED_FILL, MATMUL, MUL, PERMUTES, SHAPE_VIEWS, SOFTMAX,
                        SQUEEZES, SUB, VALUE_VIEWS, VIEWS, WHERE, is_)

DROPPABLE = (CASTS | VIEWS | FLATTENS | SQUEEZES | PERMUTES | SHAPE_VIEWS | VALUE_VIEWS | MATMUL | EINSUM | MUL | DIV
             | ADD | SUB | MASKED_FILL | WHERE | SOFTMAX | {"detach"}) - IN_PLACE_OPERATORS


def is_dead(node: fx.Node, memo: Optional[Dict[fx.Node, bool]] = None) -> bool:
    """Whether ``node`` is droppable and every reader of it is dead too (none at all: dead). ``memo``
    keeps the answers of one question, so a shared reader is asked once."""
    memo = {} if memo is None else memo
    if node not in memo:
        memo[node] = is_(node, DROPPABLE) and not writes_in_place(node) and all(is_dead(u, memo) for u in node.users)
    return memo[node]


def live_users(node: fx.Node) -> List[fx.Node]:
    """``node``'s users that are not dead branches."""
    memo: Dict[fx.Node, bool] = {}
    return [u for u in node.users if not is_dead(u, memo)]


def dead_branch(node: fx.Node) -> List[fx.Node]:
    """The dead nodes hanging off ``node``, readers before what they read (the order to erase them)."""
    out: List[fx.Node] = []

    def visit(n: fx.Node) -> None:
        for u in n.users:
            if u not in out:
                visit(u)
                out.append(u)

    memo: Dict[fx.Node, bool] = {}
    for u in node.users:
        if is_dead(u, memo) and u not in out:
            visit(u)
            out.append(u)
    return out


__all__ = ["DROPPABLE", "dead_branch", "is_dead", "live_users"]
