"""Emitting new nodes into a Dynamo graph *before* the rewrite, with fake values.

The passes that turn other forms of attention into SDPA (:mod:`.expand_mha`,
:mod:`.fuse_attention`) insert plain torch ops into Dynamo's graph. Later passes read
shapes from ``meta["example_value"]``, and error messages read source lines from
``meta["stack_trace"]``, so every new node gets both: a fake value computed under the
inputs' own fake mode (another mode fails with "Mixing fake modes", cf.
:mod:`.repropagate`) and the stack trace of the node it replaces (``anchor``).
"""

from __future__ import annotations

import contextlib
from typing import Any, List

import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher

from ..context import fake_value, log

_COPIED_META = ("stack_trace", "nn_module_stack", "source_fn_stack")


class FakeEmitter:
    """Creates nodes before ``anchor``, each with the anchor's stack trace and a fake value
    computed in the fake mode of ``like``'s value; :meth:`undo` removes them again."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node, like: fx.Node) -> None:
        self.graph, self.anchor = graph, anchor
        self.created: List[fx.Node] = []
        self.mode = getattr(fake_value(like), "fake_mode", None)

    def fn(self, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        return self._node("call_function", target, args, kwargs)

    def method(self, name: str, *args: Any, **kwargs: Any) -> fx.Node:
        return self._node("call_method", name, args, kwargs)

    def size(self, x: fx.Node, dim: int) -> Any:
        """``x.shape[dim]``: an int, or a ``size`` node when it is symbolic."""
        d = fake_value(x).shape[dim]
        return d if isinstance(d, int) else self.method("size", x, dim)

    def undo(self) -> None:
        """Erase every node this emitter created (newest first)."""
        for node in reversed(self.created):
            self.graph.erase_node(node)
        self.created.clear()

    def _node(self, op: str, target: Any, args: tuple, kwargs: dict) -> fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.create_node(op, target, args, kwargs)
        self.created.append(node)
        for key in _COPIED_META:
            if key in self.anchor.meta:
                node.meta[key] = self.anchor.meta[key]
        fargs, fkwargs = fx.node.map_arg((args, kwargs), fake_value)
        with self.mode or contextlib.nullcontext(), enable_python_dispatcher():
            node.meta["example_value"] = (target(*fargs, **fkwargs) if op == "call_function"
                                          else getattr(fargs[0], target)(*fargs[1:], **fkwargs))
        return node


def finish_expansion(gm: fx.GraphModule, count: int, what: str) -> int:
    """After a pass replaced ``count`` nodes by their ops: check and recompile ``gm``, log it."""
    if count:
        gm.graph.lint()
        gm.recompile()
        log.info("cp_compile: expanded %d %s into scaled_dot_product_attention", count, what)
    return count
