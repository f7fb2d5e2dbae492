"""What every pass of one rewrite shares: the CP group, the options, the sequence length."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx

from ..errors import CPRewriteError  # noqa: F401 (raised by every pass; imported from here)
from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw as hint_int

from ..group import CPGroup
from ..sequence import rank_positions, split_multiple

log = logging.getLogger("cp_compile")


def source_line(node: fx.Node) -> str:
    """``file:line: code`` of the model source that produced ``node`` (innermost frame), if known."""
    lines = [ln.rstrip() for ln in (node.meta.get("stack_trace") or "").splitlines() if ln.strip()]
    frame_idx = [i for i, ln in enumerate(lines) if ln.strip().startswith("File ")]
    if not frame_idx:
        return "<unknown source>"
    i = frame_idx[-1]
    m = re.match(r'\s*File "([^"]+)", line (\d+)', lines[i])
    where = f"{m.group(1)}:{m.group(2)}" if m else lines[i].strip()
    code = next((ln.strip() for ln in lines[i + 1:] if set(ln.strip()) - set("^~ ")), "")
    return f"{where}: {code}" if code else where


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


@dataclass
class RewriteContext:
    """Inputs and findings of one graph rewrite (filled in as the passes run)."""

    group: CPGroup
    load_balance: str = "zigzag"
    rotate: str = "p2p"
    kernel: str = "auto"
    seq_inputs: Any = "auto"
    inputs: str = "full"  # "local": sequence inputs arrive already sharded (cp_compile.shard)
    outputs: str = "full"
    grad_sync: str = "allreduce"
    strict: bool = False
    seq_len: int = 0  # S, the attention sequence length (find_attention); its hint if symbolic
    seq_sym: Any = None  # the SymInt S under dynamic shapes, else None
    attention: List[fx.Node] = field(default_factory=list)
    masks: Dict[fx.Node, Any] = field(default_factory=dict)  # attention with a graph-built mask -> masks.MaskKind
    mask_views: Dict[fx.Node, fx.Node] = field(default_factory=dict)  # mask -> its dim insertions moved onto its terms
    shard_inputs: Dict[str, int] = field(default_factory=dict)  # placeholder name -> seq dim
    shard_nodes: Dict[str, int] = field(default_factory=dict)  # where the sequence arises (seq_origins) -> dim
    shard_candidates: Dict[str, List[int]] = field(default_factory=dict)  # before resolve_candidates
    fallbacks: List[str] = field(default_factory=list)
    unsplit: List[str] = field(default_factory=list)  # attention ring_cp cannot split (passes/unsplit.py)
    record: Any = None  # the graph's cp_compile.backend.record.GraphRecord, once rewrite_for_cp is done
    regions: List[Any] = field(default_factory=list)  # subgraph regions opened by passes/regions.py (Region)
    local_outputs: List[int] = field(default_factory=list)  # outputs="local": flat positions of shard outputs

    @property
    def world(self) -> int:
        return self.group.size

    @property
    def padded_len(self) -> int:
        """S rounded up to what the layout splits evenly; positions >= S are padding."""
        m = split_multiple(self.world, self.load_balance)
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
        return rank_positions(self.padded_len, self.world, self.group.rank, self.load_balance)

    def order(self) -> torch.Tensor:
        """Positions of ranks 0..N-1 concatenated: the rank-major order of an all-gather (S_pad,)."""
        return torch.cat([rank_positions(self.padded_len, self.world, r, self.load_balance) for r in range(self.world)])

    def fallback(self, node: fx.Node, what: str) -> None:
        """Record (and warn about, or refuse under strict) a gather to Global."""
        msg = f"cp_compile: {what} (node {node.name}) at {source_line(node)}"
        if self.strict:
            raise CPRewriteError(
                msg + ". strict=True refuses gathering the sequence. Fix: rewrite the op so it does not mix "
                "tokens (e.g. shift labels before the model instead of slicing logits), or pass strict=False."
            )
        self.fallbacks.append(msg)
        log.warning("%s; gathering the full sequence on every rank (correct, not memory-scalable)", msg)
