"""Generic helpers on FX nodes and graphs, shared by every pass (nothing here knows about CP).

* reading a node: :func:`source_line` (the model line that made it), :func:`fake_value`
  (Dynamo's fake value), :func:`global_shape` (its single-device shape, symbols at their hints);
* effects: :func:`writes_in_place`, :func:`mutates` (whether erasing it would drop an effect);
* erasing: :func:`erase_unused` (dead pure ops and then their inputs),
  :func:`drop_empty_vmap_regions` (the bookkeeping of an inlined ``torch.vmap`` left empty).

One module rather than :mod:`cp_compile.graph_ops`: that one holds the custom ops the rewritten
graphs call at run time, this one only compile-time helpers (importing it registers no op).
"""

from __future__ import annotations

import math
import operator
import os
import re
from typing import Any, Iterable, Optional, Tuple

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw as hint_int


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../cp_compile


def source_line(node: fx.Node) -> str:
    """``file:line: code`` of the model source that produced ``node`` (the innermost frame outside
    cp_compile: a registered kernel's call passes through cp_compile.recurrence.opaque), if known."""
    lines = [ln.rstrip() for ln in (node.meta.get("stack_trace") or "").splitlines() if ln.strip()]
    frame_idx = [i for i, ln in enumerate(lines) if ln.strip().startswith("File ")]
    if not frame_idx:
        return "<unknown source>"
    outside = [i for i in frame_idx if f'"{_PACKAGE}{os.sep}' not in lines[i]]
    i = (outside or frame_idx)[-1]
    m = re.match(r'\s*File "([^"]+)", line (\d+)', lines[i])
    where = f"{m.group(1)}:{m.group(2)}" if m else lines[i].strip()
    code = next((ln.strip() for ln in lines[i + 1:] if set(ln.strip()) - set("^~ ")), "")
    return f"{where}: {code}" if code else where


_LIKE = (torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like)


def reads_only_shape(node: fx.Node) -> bool:
    """Whether ``node`` reads only its first argument's shape, dtype and device (``zeros_like(x)``)."""
    return node.op == "call_function" and node.target in _LIKE and len(node.args) >= 1


def fake_value(node: fx.Node) -> Any:
    """Dynamo's fake value of ``node`` (``example_value``; ``val`` on graphs traced by other means)."""
    return node.meta.get("example_value", node.meta.get("val"))


def global_shape(node: fx.Node) -> Optional[Tuple[int, ...]]:
    """The global (single-device) shape of a tensor-valued node, from Dynamo's fake value.

    Symbolic sizes are replaced by their hints (the sizes of the example inputs): the
    layout decisions made from shapes are structural, and sizes that must stay
    symbolic are emitted from graph values (see seqindex.py).
    """
    val = fake_value(node)
    if not isinstance(val, torch.Tensor):
        return None
    return tuple(d if isinstance(d, int) else hint_int(d) for d in val.shape)


# operator functions that write to their first argument (``x += y``, ``x[i] = y``); ``operator.or_`` does not
IN_PLACE_OPERATORS = {operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul,
                      operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow, operator.iand,
                      operator.ior, operator.ixor, operator.ilshift, operator.irshift, operator.imatmul}


def writes_in_place(node: fx.Node) -> bool:
    """Whether ``node`` writes to its first argument: ``x.add_(..)``, ``torch.relu_(x)``, ``x[i] = ..``,
    ``x += ..`` (and not ``a | b``: ``operator.or_`` ends in ``_`` without being in place)."""
    if getattr(node.target, "__module__", None) == "_operator":
        return node.target in IN_PLACE_OPERATORS
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return name.endswith("_") and not name.endswith("__")


def mutates(node: fx.Node) -> bool:
    """In-place methods/functions (``x.add_``, ``torch.relu_``) and other impure calls (``operator.and_`` is pure)."""
    return writes_in_place(node) or node.is_impure()  # is_impure: False for every call_method


def erase_unused(graph: fx.Graph, nodes: Iterable[Any]) -> None:
    """Erase each of ``nodes`` once nothing reads it, then its inputs alike: only pure ops
    (:func:`mutates` is False) go, so nothing with an effect is dropped. A call Dynamo traced as
    returning nothing is kept too: it is called for its effect (``_vmap_increment_nesting`` of an
    inlined ``torch.vmap``, which FX does not list as side-effecting)."""
    todo, erased = [n for n in nodes if isinstance(n, fx.Node)], set()
    while todo:
        node = todo.pop()
        if node in erased or node.users or node.op not in ("call_function", "call_method") \
                or (mutates(node) and not _dead_private_write(node)) or _returns_nothing(node):
            continue
        erased.add(node)
        inputs = node.all_input_nodes
        graph.erase_node(node)
        todo.extend(inputs)


def _dead_private_write(node: fx.Node) -> bool:
    """``x += y`` (an in-place operator) whose result nothing reads, on an x that only this op reads and
    that a pure op made fresh (no view, no input): the write is seen by nobody (T5's
    ``relative_buckets += where(...)`` once the ring replaced the bias it built)."""
    x = node.args[0] if node.args else None
    if node.target not in IN_PLACE_OPERATORS or node.target in (operator.setitem, operator.delitem) \
            or not isinstance(x, fx.Node) or set(x.users) != {node} or x.op not in ("call_function", "call_method") \
            or mutates(x):
        return False
    val = fake_value(x)
    return isinstance(val, torch.Tensor) and not val._is_view()


FUNCTORCH_BOOKKEEPING = ("_vmap_increment_nesting", "_vmap_decrement_nesting", "lazy_load_decompositions")


def _returns_nothing(node: fx.Node) -> bool:
    """Whether ``node`` is called for an effect: Dynamo traced it with no value (``example_value=None``),
    or it is one of functorch's level bookkeeping calls of an inlined vmap, which carry no meta
    (:func:`drop_empty_vmap_regions` removes those around a region left empty)."""
    if ("example_value" in node.meta or "val" in node.meta) and fake_value(node) is None:
        return True
    return str(getattr(node.target, "__module__", "")).startswith("torch._functorch") \
        and getattr(node.target, "__name__", "") in FUNCTORCH_BOOKKEEPING


def drop_empty_vmap_regions(graph: fx.Graph) -> None:
    """Erase the bookkeeping of a vmap region whose body is gone (create_block_mask's vmapped
    mask_mod once the ring replaced the BlockMask): ``lazy_load_decompositions();
    _vmap_increment_nesting(..); _vmap_decrement_nesting()`` with nothing in between."""
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    names = [getattr(n.target, "__name__", "") for n in nodes]
    for i, name in enumerate(names[:-1]):
        if name == "_vmap_increment_nesting" and names[i + 1] == "_vmap_decrement_nesting" \
                and nodes[i + 1].next is not None and nodes[i].next is nodes[i + 1]:
            dead = [nodes[i + 1], nodes[i]] + ([nodes[i - 1]] if i and names[i - 1] == "lazy_load_decompositions"
                                               and nodes[i - 1].next is nodes[i] else [])
            for n in dead:
                if not n.users:
                    graph.erase_node(n)


def to_int(d: Any) -> Any:
    """``d`` as an int (a SymInt's hint), or its text when it has none.

    A SymInt is read through its hint, never ``int()``: the backend builds the graph record
    (cp_compile/backend/record.py) while Dynamo's guards are still open, and ``int()`` would
    specialise the symbolic length (a recompile for every new sequence length)."""
    if isinstance(d, torch.SymInt):
        hint = d.node.hint
        return int(hint) if hint is not None else str(d)
    try:
        return int(d)
    except Exception:
        return str(d)


def stored_bytes(val: Any) -> int:
    """Bytes a (fake) tensor holds: dims of stride 0 (broadcast by ``expand``) count once."""
    if not isinstance(val, torch.Tensor):
        return 0
    sizes = [to_int(s) for s, st in zip(val.shape, val.stride()) if to_int(st) != 0]
    return math.prod(sizes) * val.element_size() if all(isinstance(s, int) for s in sizes) else 0


def rows_per_query(val: Any) -> bool:
    """Whether a (..., rows, S) mask value has a row per query: its row dim neither 1 nor broadcast
    (stride 0), read through :func:`to_int` (no guard on a symbolic size)."""
    return (isinstance(val, torch.Tensor) and val.dim() >= 2 and to_int(val.shape[-2]) != 1
            and to_int(val.stride(-2)) != 0)
