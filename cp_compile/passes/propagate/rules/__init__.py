"""The layout rules: one table from op to rule (:mod:`.table`), for ops with a Sharded input.

The rules, by op class: :mod:`.pointwise` (broadcasting and per-token ops, matmul),
:mod:`.views` (views, permutes, split/join), :mod:`.getitem` (basic indexing),
:mod:`.reductions` (sums/means over the sequence, sizes), :mod:`.attention` (attention
and losses), :mod:`.einsum`, :mod:`.complex`. Ops without a rule go to the rule oracle
(:mod:`cp_compile.passes.propagate.oracle`) before the gather fallback.
"""

from .table import RULES, apply_rule

__all__ = ["RULES", "apply_rule"]
