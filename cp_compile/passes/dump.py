"""``CP_COMPILE_DUMP=DIR``: the graph after every pass of the pipeline, one file each.

Like Inductor's graph-transform observer: set the environment variable and every graph the
pipeline (:mod:`.pipeline`) rewrites is written, pass by pass, as Python code followed by its
nodes as a table (in comments)::

    DIR/[rank<r>/]graph_<k>/00_input.py                       the graph as Dynamo handed it over
                           01_normalize_refuse_nested_tensors.py    after the first pass
                           ...
                           18_finalize_set_ring_timeout.py          after the last: the rewritten graph

``<k>`` counts the graphs this process has rewritten; ``rank<r>/`` is there when a process group
exists (each rank writes its own graph). Passes that did not run (after ``find_unsplit_attention``
on a graph without attention) write nothing. Unset, nothing is written and nothing is computed.
"""

from __future__ import annotations

import itertools
import logging
import os
from typing import Any, Optional

import torch.fx as fx

from .context import RewriteContext

log = logging.getLogger("cp_compile")

ENV = "CP_COMPILE_DUMP"
CODE_END = "# ---- nodes ----"  # ends the code part of a dump file (what follows is the table, in comments)
_graphs = itertools.count()
_announced = set()  # the directories already logged at INFO


class GraphDump:
    """Writes one graph's passes under ``DIR/[rank<r>/]graph_<k>/`` (a no-op when the variable is unset)."""

    def __init__(self, ctx: RewriteContext, root: Optional[str] = None) -> None:
        root = os.environ.get(ENV) if root is None else root
        self.dir: Optional[str] = None
        if not root:
            return
        rank = f"rank{ctx.group.rank}" if ctx.group.pg is not None else ""
        self.dir = os.path.join(root, rank, f"graph_{next(_graphs):03d}")
        os.makedirs(self.dir, exist_ok=True)
        if root not in _announced:
            _announced.add(root)
            log.info("cp_compile: %s=%s: writing the graph after every pass under %s", ENV, root, self.dir)

    def write(self, index: int, label: str, gm: fx.GraphModule) -> Optional[str]:
        """Write ``gm`` as ``<index>_<label>.py``; return the file's path (None when not dumping)."""
        if self.dir is None:
            return None
        path = os.path.join(self.dir, f"{index:02d}_{label}.py")
        with open(path, "w") as f:
            f.write(f"# cp_compile: {label} ({os.path.basename(self.dir)}, pass {index:02d})\n")
            f.write(graph_code(gm))
            f.write(f"\n{CODE_END}\n")
            f.write("".join(f"# {line}\n" for line in node_table(gm.graph)))
        return path


def graph_code(gm: fx.GraphModule) -> str:
    """The Python code of ``gm``'s graph as it is now (``gm.code`` once ``gm`` is recompiled)."""
    return gm.graph.python_code(root_module="self").src


def node_table(graph: fx.Graph) -> list:
    """One line per node: name, op, target, arguments (a cheap ``Graph.print_tabular``)."""
    rows = [("name", "op", "target", "args / kwargs")]
    rows += [(n.name, n.op, _target(n.target), _short((n.args, n.kwargs) if n.kwargs else n.args)) for n in graph.nodes]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return [" ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + " " + r[3] for r in rows]


def _target(target: Any) -> str:
    return target if isinstance(target, str) else getattr(target, "__name__", None) or str(target)


def _short(value: Any, limit: int = 160) -> str:
    text = str(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
