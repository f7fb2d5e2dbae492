"""The passes of the ``ring_cp`` rewrite, in order, as data; and the one runner of them.

:data:`PASSES` is the order (``docs/design.md`` section 5 lists it, and a test checks that the
two agree). :func:`run_pipeline` runs it on one Dynamo graph; it is what
:func:`cp_compile.backend.compiler.rewrite_for_cp` calls, so the backend and ``cp-compile
explain`` run the same list. Each :class:`Pass` is ``fn(gm, ctx)``:

* it changes ``gm`` in place (FX's own way: every pass but one) and returns anything but a
  GraphModule (None, or a count the tests read), or
* it returns a new :class:`torch.fx.GraphModule`, which the passes after it get instead (only
  ``rewrite_graph``, which builds the per-rank graph beside the old one).

One signature, so a pass is one line of the table and the runner needs no case per pass; the
passes whose entry takes other arguments (the example inputs) read them from ``ctx``.
The phase says what a pass does: ``normalize`` rewrites the graph into a form the analyses read
(or moves what the rewrite needs first), ``analyze`` records findings in ``ctx`` without changing
the graph, ``propagate`` emits the per-rank graph, ``finalize`` completes it. A pass with
``when=has_mixers`` runs only on a graph with attention or a registered recurrent kernel: on any
other graph the pipeline ends after ``find_unsplit_attention`` and the backend compiles the graph
unchanged.

``CP_COMPILE_DUMP=DIR`` writes the graph after every pass that ran (:mod:`.dump`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Literal, Optional, Tuple

import torch.fx as fx

from .analyze.find_attention import find_attention
from .analyze.find_recurrences import find_recurrences
from .analyze.seq_inputs import choose_seq_inputs, resolve_candidates
from .analyze.seq_origins import choose_seq_origins
from .analyze.unsplit import find_unsplit_attention
from .context import CPRewriteError, RewriteContext, log
from .dump import GraphDump
from .finalize.repropagate import repropagate
from .finalize.ring_timeout import set_ring_timeout
from .finalize.strategy import apply_strategy
from .normalize.assoc_scan import collapse_associative_scans
from .normalize.decay_scans import fold_decay_scans
from .normalize.fold_loops import fold_recurrence_loops
from .normalize.block_masks import drop_block_masks
from .normalize.documents_first import documents_first
from .normalize.expand_fastpath import expand_fastpath
from .normalize.expand_mha import expand_mha
from .normalize.fuse_attention import fuse_attention
from .normalize.loss_shift import move_loss_slices
from .normalize.mask_views import distribute_mask_views
from .normalize.neighbours import fold_neighbour_reads
from .normalize.nested import refuse_nested_tensors
from .normalize.patch_conv import open_patch_convs
from .normalize.regions import inline_regions
from .propagate.rewrite import rewrite_graph

Phase = Literal["normalize", "analyze", "propagate", "finalize"]
PassFn = Callable[[fx.GraphModule, RewriteContext], Any]  # a new GraphModule, or anything: changed in place


def always(ctx: RewriteContext) -> bool:
    """Every graph."""
    return True


def has_mixers(ctx: RewriteContext) -> bool:
    """A graph with a sequence mixer to split: attention the ring replaces (``find_attention``) or a
    registered recurrent kernel (``find_recurrences``)."""
    return bool(ctx.attention or ctx.recurrences)


@dataclass(frozen=True)
class Pass:
    """One step of the pipeline: its name (the dump's file names it), phase and entry."""

    name: str
    phase: Phase
    fn: PassFn
    when: Callable[[RewriteContext], bool] = always

    @property
    def summary(self) -> str:
        """The first line of the entry's docstring."""
        return (self.fn.__doc__ or "").strip().splitlines()[0] if self.fn.__doc__ else ""


# -- entries whose own signature takes something else than (gm, ctx) ----------------------------------
def _refuse_nested(gm: fx.GraphModule, ctx: RewriteContext) -> None:
    """Refuse a nested (jagged) tensor anywhere in the graph: Dynamo cannot trace attention on it."""
    refuse_nested_tensors(gm)


def _inline_regions(gm: fx.GraphModule, ctx: RewriteContext) -> None:
    """Copy checkpointed regions and nested compile regions into the graph, marking their nodes."""
    ctx.regions = inline_regions(gm)


def _choose_seq_inputs(gm: fx.GraphModule, ctx: RewriteContext) -> None:
    """Which graph inputs carry the sequence, and along which dim (or the candidates, under "auto")."""
    choose_seq_inputs(gm, ctx, ctx.examples)


def _resolve_candidates(gm: fx.GraphModule, ctx: RewriteContext) -> None:
    """Under ``seq_inputs="auto"``: one sequence dim per input, settled by trial rewrites if ambiguous."""
    if ctx.options.seq_inputs == "auto":
        resolve_candidates(ctx, lambda choice: _rewrites_cleanly(gm, ctx, choice), gm)


def _rewrites_cleanly(gm: fx.GraphModule, ctx: RewriteContext, choice: Dict[str, int]) -> bool:
    """Whether sharding ``choice`` lets the whole graph rewrite with no gather (a trial run, strict,
    on a copy of the context; the old graph is left as it was)."""
    trial = dataclasses.replace(ctx, options=dataclasses.replace(ctx.options, strict=True), shard_inputs=choice,
                                fallbacks=[])
    try:
        rewrite_graph(gm, trial, ctx.examples)
    except CPRewriteError:
        return False
    return True


def _rewrite(gm: fx.GraphModule, ctx: RewriteContext) -> fx.GraphModule:
    """Propagate the sequence layouts and emit the per-rank graph (a new GraphModule)."""
    log.debug("cp_compile: graph before the rewrite\n%s", gm.code)
    return rewrite_graph(gm, ctx, ctx.examples)


def _repropagate(gm: fx.GraphModule, ctx: RewriteContext) -> None:
    """Per-rank fake values on the rewritten graph (the global ones kept in the node facts)."""
    repropagate(gm, ctx.fake_inputs)


PASSES: Tuple[Pass, ...] = (
    Pass("refuse_nested_tensors", "normalize", _refuse_nested),
    Pass("inline_regions", "normalize", _inline_regions),
    Pass("collapse_associative_scans", "normalize", collapse_associative_scans),
    Pass("expand_mha", "normalize", expand_mha),
    Pass("expand_fastpath", "normalize", expand_fastpath),
    Pass("fuse_attention", "normalize", fuse_attention),
    Pass("distribute_mask_views", "normalize", distribute_mask_views),
    Pass("find_attention", "analyze", find_attention),
    Pass("fold_recurrence_loops", "normalize", fold_recurrence_loops),
    Pass("fold_decay_scans", "normalize", fold_decay_scans),
    Pass("find_recurrences", "analyze", find_recurrences),
    Pass("drop_block_masks", "normalize", drop_block_masks),
    Pass("find_unsplit_attention", "analyze", find_unsplit_attention),
    Pass("move_loss_slices", "normalize", move_loss_slices, has_mixers),
    Pass("fold_neighbour_reads", "normalize", fold_neighbour_reads, has_mixers),
    Pass("choose_seq_inputs", "analyze", _choose_seq_inputs, has_mixers),
    Pass("documents_first", "normalize", documents_first, has_mixers),
    Pass("resolve_candidates", "analyze", _resolve_candidates, has_mixers),
    Pass("open_patch_convs", "normalize", open_patch_convs, has_mixers),
    Pass("choose_seq_origins", "analyze", choose_seq_origins, has_mixers),
    Pass("rewrite_graph", "propagate", _rewrite, has_mixers),
    Pass("repropagate", "finalize", _repropagate, has_mixers),
    Pass("apply_strategy", "finalize", apply_strategy, has_mixers),
    Pass("set_ring_timeout", "finalize", set_ring_timeout, has_mixers),
)


def run_pipeline(gm: fx.GraphModule, example_inputs: List[Any], ctx: RewriteContext,
                 passes: Optional[Tuple[Pass, ...]] = None) -> fx.GraphModule:
    """Run ``passes`` (default :data:`PASSES`) in order on ``gm``; return the last graph (``gm``
    itself, changed in place, when no pass built a new one: a graph without attention).

    ``ctx.examples`` (placeholder name -> example input) and ``ctx.fake_inputs`` (the
    placeholders' fake values) are filled first, for the passes that read them."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    ctx.examples = {n.name: t for n, t in zip(placeholders, example_inputs)}
    ctx.fake_inputs = [n.meta.get("example_value") for n in placeholders]
    dump = GraphDump(ctx)
    dump.write(0, "input", gm)
    for index, step in enumerate(PASSES if passes is None else passes, start=1):
        if not step.when(ctx):
            continue
        out = step.fn(gm, ctx)
        if isinstance(out, fx.GraphModule):
            gm = out
        dump.write(index, f"{step.phase}_{step.name}", gm)
    return gm
