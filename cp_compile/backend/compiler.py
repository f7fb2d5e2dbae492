"""The ``ring_cp`` torch.compile backend.

``torch.compile(model, backend="ring_cp", options={...})`` or
``torch.compile(model, backend=cp_compile.RingCP(...))``. Each graph Dynamo hands
over is rewritten for the CP group by :func:`rewrite_for_cp` (the passes are listed, in
order, in :mod:`cp_compile.passes.pipeline`) and passed to the inner compiler. With no
process group or a CP group of size 1 the graph goes to the inner compiler
unchanged; a graph without attention does too, except that under
``grad_sync="none"`` its parameter gradients become this rank's 1/N share
(:mod:`.passes.grad_share`).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
import torch.fx as fx

from ..group import resolve_group
from .aot_cache import aot_cache_config
from .batch_guard import guard_same_batch
from ..options import INNER, BackendOptions  # noqa: F401 (INNER: re-exported)
from .eager_guard import guard_eager_parameters
from .local_guard import guard_local_shards
from ..passes.context import RewriteContext
from ..passes.finalize.grad_share import share_parameter_grads
from ..passes.fx_utils import global_shape
from ..passes.normalize.regions import checkpoint_regions
from ..passes.analyze.seq_inputs import is_parameter_like, user_name
from ..passes.pipeline import run_pipeline
from .record import GraphRecord, record_graph, warn_no_attention, warn_whole_sequence
from .schedule import inductor_overlap_config, schedule_collectives

log = logging.getLogger("cp_compile")

def _inner_compiler(name: str) -> Callable:
    if name == "eager":
        return lambda gm, example_inputs: gm.forward
    from torch._dynamo import lookup_backend

    return lookup_backend(name)


class RingCP:
    """A torch.compile backend making the compiled model context-parallel.

    ``RingCP(mesh=..., load_balance=..., ...)``: the same options as
    ``options={...}`` with ``backend="ring_cp"`` (:class:`BackendOptions`).
    """

    def __init__(self, **options: Any) -> None:
        self.options = BackendOptions(**options)
        self.graphs: List[fx.GraphModule] = []  # rewritten graphs, for inspection
        self.fallbacks: List[str] = []  # every gather to the full sequence, with its source line
        self.no_attention: List[fx.GraphModule] = []  # graphs compiled without a rewrite (see grad_share)
        self.records: List[GraphRecord] = []  # per compiled graph: what CP it got (cp_compile.backend.record)
        self._seq_lens: Set[int] = set()  # sequence lengths of the graphs rewritten so far

    def __call__(
        self, gm: fx.GraphModule, example_inputs: List[torch.Tensor], mode: Optional[str] = None,
        options: Optional[Dict[str, Any]] = None,
    ) -> Callable:
        """Compile one Dynamo graph. ``mode`` (``torch.compile(mode=...)``) goes to the inner
        Inductor; ``options`` (``torch.compile(options=...)``) override this backend's options."""
        opts = _merge_options(self.options, options)
        inner = _with_mode(_inner_compiler(opts.inner), opts.inner, mode)
        group = resolve_group(opts.mesh)
        if group.size == 1:
            log.info("cp_compile: CP group of size 1 (or no process group): compiling the graph unchanged")
            return inner(gm, example_inputs)
        ctx = RewriteContext(group=group, options=opts.rewrite_options())
        new_gm = rewrite_for_cp(gm, example_inputs, ctx)
        # Recorded only once the inner compiler returns: Dynamo may abandon a compile and
        # restart it (e.g. TensorifyScalarRestartAnalysis under dynamic=True), calling us twice.
        if new_gm is None:
            checkpoint_regions(gm, ctx.regions)  # compiled unchanged, still checkpointed
            shared = share_parameter_grads(gm, example_inputs, ctx)
            if shared is None:
                log.info("cp_compile: no attention in this graph: compiling it unchanged")
            compiled = inner(shared if shared is not None else gm, example_inputs)
            if not ctx.unsplit and self._seq_lens:  # sequence-long activations after a split graph: say so
                warn_whole_sequence(gm, example_inputs, self._seq_lens, ctx.record)
            elif not ctx.unsplit:  # nothing split yet: this model (or its first piece) gets no CP
                warn_no_attention(gm, example_inputs)
            self.no_attention.append(gm)
            self.records.append(ctx.record)
        else:
            checkpoint_regions(new_gm, ctx.regions)  # recomputed in the backward, the ring's results saved
            compiled = _hand_off(opts.inner, inner, new_gm, example_inputs, same_on_every_rank=not ctx.shard_nodes)
            compiled = _guard_batch(compiled, gm, example_inputs, ctx, opts)
            self.graphs.append(new_gm)
            self.fallbacks.extend(ctx.fallbacks)
            self.records.append(ctx.record)
            self._seq_lens.add(ctx.seq_len)
        if opts.outputs == "local" and opts.inputs == "full":
            names = [user_name(n) for n in gm.graph.find_nodes(op="placeholder")]
            compiled = guard_local_shards(compiled, ctx.local_outputs, names)
        return _guard_shares(compiled, gm, example_inputs, opts, group.size)


def _merge_options(base: BackendOptions, options: Optional[Dict[str, Any]]) -> BackendOptions:
    """``base`` with ``options`` (from ``torch.compile(backend=RingCP(...), options=...)``) applied."""
    if not options:
        return base
    unknown = sorted(set(options) - set(BackendOptions.__dataclass_fields__))
    if unknown:
        raise ValueError(
            f"cp_compile: unknown ring_cp options {unknown}. Fix: use "
            f"{', '.join(sorted(BackendOptions.__dataclass_fields__))}."
        )
    return replace(base, **options)


def _with_mode(inner: Callable, name: str, mode: Optional[str]) -> Callable:
    """Apply ``torch.compile(mode=...)`` to the inner compiler: Inductor's settings for that
    mode; the debugging compilers have none, so they ignore it (with a warning)."""
    if mode in (None, "default"):
        return inner
    if name != "inductor":
        log.warning("cp_compile: mode=%r is an Inductor setting; inner=%r ignores it", mode, name)
        return inner
    from torch._inductor import list_mode_options

    patches = dict(list_mode_options(mode))  # raises for an unknown mode, naming the valid ones

    def compile_with_mode(gm: fx.GraphModule, example_inputs: List[torch.Tensor], **kwargs: Any) -> Callable:
        kwargs["config_patches"] = {**patches, **kwargs.get("config_patches", {})}
        return inner(gm, example_inputs, **kwargs)

    return compile_with_mode


def _guard_shares(compiled: Callable, gm: fx.GraphModule, example_inputs: List[Any], opts: BackendOptions,
                  world: int) -> Callable:
    """Under grad_sync="none", ``compiled`` refusing parameters used eagerly before it (see
    :mod:`.eager_guard`; needs AOTAutograd's graphs, so not with inner="eager")."""
    if opts.grad_sync != "none" or opts.inner == "eager":
        return compiled
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    grad_inputs = [i for i, (n, ex) in enumerate(zip(placeholders, example_inputs))
                   if isinstance(ex, torch.Tensor) and ex.requires_grad and not is_parameter_like(n, ex)]
    return guard_eager_parameters(compiled, grad_inputs, world) if grad_inputs else compiled


def _guard_batch(compiled: Callable, gm: fx.GraphModule, example_inputs: List[Any], ctx: RewriteContext,
                 opts: BackendOptions) -> Callable:
    """Under ``inputs="full"`` and ``check_batch``: ``compiled`` that first checks that every CP rank
    was passed the same batch (:mod:`.batch_guard`). Dynamo calls the compiled graph with its flat
    inputs in placeholder order."""
    if not opts.check_batch or opts.inputs != "full" or ctx.group.size == 1:
        return compiled
    batch = batch_inputs(gm, example_inputs, ctx)
    return guard_same_batch(compiled, ctx.group, batch, opts.timeout) if batch else compiled


def batch_inputs(gm: fx.GraphModule, example_inputs: List[Any], ctx: RewriteContext) -> List[Tuple[int, str]]:
    """(position, forward() argument name) of the inputs each rank takes its share of: those the
    rewrite shards (``ctx.shard_inputs``) and the other per-token inputs, which stay whole and are
    indexed by this rank's positions where they meet sharded values (labels that do not reach
    attention, a padding mask): any tensor input, not a parameter or buffer, with a dim of size S."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    return [(i, user_name(n)) for i, (n, ex) in enumerate(zip(placeholders, example_inputs))
            if n.name in ctx.shard_inputs or (isinstance(ex, torch.Tensor) and not is_parameter_like(n, ex)
                                              and ctx.seq_len in (global_shape(n) or ()))]


def rewrite_for_cp(gm: fx.GraphModule, example_inputs: List[Any], ctx: RewriteContext) -> Optional[fx.GraphModule]:
    """Run the pipeline (:data:`cp_compile.passes.pipeline.PASSES`) on Dynamo's graph and record
    what it got (:func:`.record.record_graph`: what explain prints; warns when little is sharded).
    The rewritten graph, or None when the graph has no attention (the pipeline stopped after
    the analyses; ``gm`` is compiled unchanged). Shared by the backend and ``cp-compile explain``.
    """
    new_gm = run_pipeline(gm, example_inputs, ctx)
    if not (ctx.attention or ctx.recurrences):
        ctx.record = record_graph(gm, None, ctx)
        return None
    ctx.record = record_graph(gm, new_gm, ctx)
    return new_gm


def _hand_off(name: str, inner: Callable, gm: fx.GraphModule, example_inputs: List[torch.Tensor],
              same_on_every_rank: bool = True) -> Callable:
    """Compile the rewritten graph so gradient all-reduces overlap the rest of the backward.

    Inductor: its own comm/compute reordering, passed as config_patches (the backward
    is compiled later, at the first .backward(), so a config context would have
    closed by then), with the patch that lets AOTAutograd's cache serve the graph
    (:mod:`cp_compile.backend.aot_cache`). aot_eager: the FX pass :func:`schedule_collectives`
    on both graphs. ``same_on_every_rank=False`` (the sequence arises in the graph, and each
    rank takes its own rows of the pieces, :mod:`cp_compile.passes.propagate.row_select`): the ranks'
    graphs differ in shapes (a cls token's gradient is all zeros on the ranks that take none
    of it), so Inductor's reordering, which follows data dependencies and peak memory, could
    order the collectives differently per rank; it is left off there.
    """
    if name == "inductor":
        overlap = inductor_overlap_config() if same_on_every_rank else {}
        return inner(gm, example_inputs, config_patches={**overlap, **aot_cache_config()})
    if name == "aot_eager":
        from torch._dynamo.backends.debugging import aot_eager, boxed_nop

        def scheduled(g: fx.GraphModule, ex: List[torch.Tensor]) -> Callable:
            return boxed_nop(schedule_collectives(g), ex)

        return aot_eager(gm, example_inputs, fw_compiler=scheduled, bw_compiler=scheduled)
    return inner(gm, example_inputs)


def ring_cp(
    gm: fx.GraphModule,
    example_inputs: List[torch.Tensor],
    options: Optional[Dict[str, Any]] = None,
    mode: Optional[str] = None,
):
    """Entry point for ``backend="ring_cp"`` (found by Dynamo through the
    ``torch_dynamo_backends`` entry point; ``mode`` goes to the inner Inductor)."""
    return RingCP(**(options or {}))(gm, example_inputs, mode=mode)
