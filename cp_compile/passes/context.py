"""What every pass of one rewrite shares: the CP group, the frozen options, what the analyses found.

``ctx.options`` (:class:`~cp_compile.options.RewriteOptions`) is what the rewrite was asked for
and never changes during it (a trial rewrite runs on ``dataclasses.replace`` of it); every other
field is filled in by the passes of :mod:`.pipeline` as they run. Per-node results live on the
nodes (:mod:`.node_facts`); generic FX helpers in :mod:`.fx_utils`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch
import torch.fx as fx

from ..errors import CPRewriteError  # noqa: F401 (raised by every pass; imported from here)
from ..group import CPGroup
from ..options import RewriteOptions
from ..sequence import rank_positions, split_multiple
from .fx_utils import fake_value, global_shape, source_line  # noqa: F401 (re-exported: ~45 modules import them here)

if TYPE_CHECKING:
    from ..backend.record import GraphRecord
    from ..recurrence.spec import StatePassed
    from .analyze.masks.classify import MaskKind
    from .normalize.regions import Region

log = logging.getLogger("cp_compile")


@dataclass
class RewriteContext:
    """The options and the findings of one graph rewrite (the findings filled in as the passes run)."""

    group: CPGroup
    options: RewriteOptions = field(default_factory=RewriteOptions)
    # -- found by the analyses ------------------------------------------------------------------
    seq_len: int = 0  # S, the attention sequence length (find_attention); its hint if symbolic
    seq_sym: Optional[torch.SymInt] = None  # the SymInt S under dynamic shapes, else None
    attention: List[fx.Node] = field(default_factory=list)
    recurrences: List[fx.Node] = field(default_factory=list)  # registered recurrent kernels (find_recurrences)
    masks: Dict[fx.Node, MaskKind] = field(default_factory=dict)  # attention with a graph-built mask -> its kind
    shard_inputs: Dict[str, int] = field(default_factory=dict)  # placeholder name -> seq dim
    shard_nodes: Dict[str, int] = field(default_factory=dict)  # where the sequence arises (seq_origins) -> dim
    shard_candidates: Dict[str, List[int]] = field(default_factory=dict)  # before resolve_candidates
    document_ids: Optional[fx.Node] = None  # load_balance="documents": the ids X every mask compares
    unsplit: List[str] = field(default_factory=list)  # attention ring_cp cannot split (passes/unsplit.py)
    regions: List[Region] = field(default_factory=list)  # subgraph regions opened by passes/regions.py
    # -- the run: its inputs, what it emitted, what it recorded -----------------------------------
    examples: Dict[str, Any] = field(default_factory=dict)  # placeholder name -> example input (pipeline)
    fake_inputs: List[Any] = field(default_factory=list)  # the placeholders' fake values, in order
    unrewritten: Optional[fx.GraphModule] = None  # the graph rewrite_graph read, once it ran
    fallbacks: List[str] = field(default_factory=list)
    state_passed: List[StatePassed] = field(default_factory=list)  # the recurrences as run (rules/recurrence.py)
    record: Optional[GraphRecord] = None  # the graph's record (the pass "record")
    local_outputs: List[int] = field(default_factory=list)  # outputs="local": flat positions of shard outputs

    @property
    def world(self) -> int:
        return self.group.size

    @property
    def padded_len(self) -> int:
        """S rounded up to what the layout splits evenly; positions >= S are padding."""
        m = split_multiple(self.world, self.options.load_balance)
        return -(-self.seq_len // m) * m

    @property
    def padded(self) -> bool:
        """Whether padding rows exist (always assumed under a symbolic S)."""
        return self.seq_sym is not None or self.padded_len != self.seq_len

    @property
    def local_len(self) -> int:
        return self.padded_len // self.world

    def positions(self) -> torch.Tensor:
        """Global positions of this rank's tokens (c,), padding (>= S) included."""
        return rank_positions(self.padded_len, self.world, self.group.rank, self.options.load_balance)

    def order(self) -> torch.Tensor:
        """Positions of ranks 0..N-1 concatenated: the rank-major order of an all-gather (S_pad,)."""
        lb = self.options.load_balance
        return torch.cat([rank_positions(self.padded_len, self.world, r, lb) for r in range(self.world)])

    def fallback(self, node: fx.Node, what: str) -> None:
        """Record (and warn about, or refuse under strict) a gather to Global."""
        msg = f"cp_compile: {what} (node {node.name}) at {source_line(node)}"
        if self.options.strict:
            raise CPRewriteError(
                msg + ". strict=True refuses gathering the sequence. Fix: rewrite the op so it does not mix "
                "tokens (e.g. shift labels before the model instead of slicing logits), or pass strict=False."
            )
        self.fallbacks.append(msg)
        log.warning("%s; gathering the full sequence on every rank (correct, not memory-scalable)", msg)
