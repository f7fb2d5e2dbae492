"""Overlap the gradient all-reduces with the rest of the backward.

AOTAutograd traces each parameter's gradient all-reduce (:mod:`cp_compile.graph_ops`)
where the autograd engine ran it: the ``_GradAllReduce`` nodes were created first in
the forward, so they run *last* in the backward, and every all-reduce sits at the end
of the backward graph followed at once by its ``wait_tensor``. Nothing overlaps.

Two ways to fix the order, same idea (issue early, wait late):

* with Inductor, :func:`inductor_overlap_config` is the ``torch._inductor.config``
  patch that turns on Inductor's own compute/communication reordering (works on CPU;
  pass it as ``config_patches=``, see there);
* for aot_eager (or as a backstop), :func:`schedule_collectives` is a pure FX pass::

    before                                  after
    mm_15 = mm(t_15, x)        # lm_head    mm_15 = mm(t_15, x)
    ... 350 nodes: layers' backward ...     ar_3 = all_reduce(mm_15, "sum", g)  # issued
    ar_3 = all_reduce(mm_15, "sum", g)      ... 350 nodes: layers' backward ...
    w_3 = wait_tensor(ar_3)                 w_3 = wait_tensor(ar_3)             # waited
    return (..., w_3)                       return (..., w_3)

Each collective is issued right after its last input (and after the collective before
it: collectives keep their relative order, as in Inductor, so every rank issues them
in the same order); each ``wait_tensor`` moves to just before the first node that reads
the collective's result. Compute keeps its order; nothing moves across an in-place op
(in-place collectives included).
"""

from __future__ import annotations

import operator
from collections import defaultdict, deque
from typing import Any, Dict, List, Set

import torch.fx as fx

__all__ = ["inductor_overlap_config", "schedule_collectives"]

_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "c10d_functional")


def inductor_overlap_config() -> Dict[str, Any]:
    """Inductor's compute/communication reordering, in a form that works on CPU (torch 2.13).

    The passes run on Inductor's scheduler nodes: ``reorder_communication_preserving_peak_memory``
    moves each collective earlier until a data dependency (or +20% peak memory) stops it,
    ``sink_waits_iterative`` moves each wait later the same way. Without
    ``config_comms.*_use_runtime_estimations`` (off by default) neither consults a runtime
    estimate, so every rank, holding the same graph, makes the same decisions. The
    legacy ``raise_comms`` / ``sink_waits`` / ``reorder_compute_for_overlap`` also run on
    CPU but chain each collective after the previous wait (one all-reduce in flight);
    ``aten_distributed_optimizations.enable_overlap_scheduling`` needs a GPU.

    Pass it as ``compile_fx(gm, inputs, config_patches=...)``: a ``config.patch``
    context around the call misses the backward, which is compiled lazily later.
    """
    return {
        "reorder_for_compute_comm_overlap": True,
        "reorder_for_compute_comm_overlap_passes": [
            "reorder_communication_preserving_peak_memory",
            "sink_waits_iterative",
            "reorder_communication_preserving_peak_memory",
        ],
    }


def _namespace(node: fx.Node) -> str:
    return getattr(node.target, "namespace", "") if node.op == "call_function" else ""


def _is_wait(node: fx.Node) -> bool:
    return _namespace(node) in _NAMESPACES and node.target.__name__.startswith("wait_tensor")


def _is_collective(node: fx.Node) -> bool:
    return _namespace(node) in _NAMESPACES and not _is_wait(node)


def _mutates(node: fx.Node) -> bool:
    """In-place/out= ops (in-place collectives included): nothing moves across them."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return schema is not None and schema.is_mutable


def _raise_collectives(nodes: List[fx.Node]) -> List[fx.Node]:
    """Emit each out-of-place collective (with its getitems) once its inputs, the last placeholder
    and the previous collective or mutating op are out; everything else keeps its order."""
    deps: Dict[fx.Node, Set[fx.Node]] = {}
    barrier = [n for n in nodes if n.op == "placeholder"][-1:]
    for n in nodes:
        if _is_collective(n) and not _mutates(n):
            deps[n] = set(n.all_input_nodes) | set(barrier)
        if _is_collective(n) or _mutates(n):
            barrier = [n]
    queue = deque(n for n in nodes if n in deps)
    out: List[fx.Node] = []
    done: Set[fx.Node] = set()

    def emit(n: fx.Node) -> None:
        out.append(n)
        done.add(n)
        while queue and deps[queue[0]] <= done:
            issue = queue.popleft()
            getitems = [u for u in issue.users if u.op == "call_function" and u.target is operator.getitem]
            out.extend([issue, *getitems])
            done.update([issue, *getitems])

    for n in nodes:
        if n not in done:
            emit(n)
    return out


def _sink_waits(nodes: List[fx.Node]) -> List[fx.Node]:
    """Move each wait of an out-of-place collective to just before the first reader of its result."""
    index = {n: i for i, n in enumerate(nodes)}
    before: Dict[fx.Node, List[fx.Node]] = defaultdict(list)
    sunk: Set[fx.Node] = set()
    for w in nodes:
        src = w.args[0] if _is_wait(w) else None
        issue = src.args[0] if isinstance(src, fx.Node) and src.target is operator.getitem else src
        if not (isinstance(issue, fx.Node) and _is_collective(issue) and not _mutates(issue)):
            continue
        readers = set(w.users) | {u for u in src.users if u is not w}
        before[min(readers, key=index.__getitem__) if readers else nodes[-1]].append(w)
        sunk.add(w)
    out: List[fx.Node] = []

    def emit(n: fx.Node) -> None:
        for w in before.pop(n, ()):
            emit(w)
        out.append(n)

    for n in nodes:
        if n not in sunk:
            emit(n)
    return out


def schedule_collectives(gm: fx.GraphModule) -> fx.GraphModule:
    """Reorder ``gm`` in place: issue functional collectives early, wait late; returns ``gm``."""
    nodes = list(gm.graph.nodes)
    if not any(_is_collective(n) for n in nodes):
        return gm
    order = _sink_waits(_raise_collectives(nodes))
    assert len(order) == len(nodes) and order[-1].op == "output", "cp_compile: schedule_collectives lost nodes"
    for prev, node in zip(order, order[1:]):
        if prev.next is not node:
            prev.append(node)
    gm.graph.lint()
    gm.recompile()
    return gm
