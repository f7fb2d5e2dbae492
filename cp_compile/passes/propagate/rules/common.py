"""Helpers the layout rules share: the table key of a node, dims, layouts (arguments: op_vocab.arguments)."""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch.fx as fx

from ...context import global_shape
from ..emitter import Emitter
from ..placements import Sharded

Rule = Callable[[Emitter, fx.Node], Tuple[Any, Any]]


def _key(node: fx.Node) -> Any:
    return ("method", node.target) if node.op == "call_method" else node.target


def _ndim(node: Any) -> int:
    return len(global_shape(node)) if isinstance(node, fx.Node) and global_shape(node) is not None else 0


def _norm(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


def _sharded(em: Emitter, arg: Any) -> Optional[Sharded]:
    lay = em.layout(arg)
    return lay if isinstance(lay, Sharded) else None


def _no_runs(em: Emitter) -> Optional[str]:
    """Why this layout gives no fixed runs of tokens for a rule that follows the global order across
    them (a recurrence, an associative scan), or None."""
    chunks = em.index.chunks()
    if chunks is None:
        return (f"load_balance={em.ctx.options.load_balance!r} on {em.ctx.world} ranks holds no contiguous runs of "
                "tokens (fix: load_balance='zigzag' or 'contiguous')")
    if not isinstance(chunks[1], int):
        return "the sequence length is symbolic (fix: dynamic=False, or pad to a fixed length)"
    return None


def _flat_args(node: fx.Node) -> list:
    from torch.utils._pytree import tree_flatten

    return tree_flatten((node.args, node.kwargs))[0]


def _map(em: Emitter, node: fx.Node, converted: Dict[fx.Node, Any]):
    return fx.node.map_aggregate(
        (node.args, node.kwargs), lambda a: converted.get(a, em.env[a]) if isinstance(a, fx.Node) else a
    )


def _name(node: fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))

