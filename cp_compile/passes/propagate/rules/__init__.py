"""The layout rules, for ops with a Sharded input: each registered where it is defined
(``@register_rule`` of :mod:`.registry`), looked up by :func:`.table.apply_rule`.

The rules, by op class (docs/design.md §6): :mod:`.pointwise` (broadcasting and per-token ops,
matmul), :mod:`.views` (views, permutes, split/join), :mod:`.getitem` (basic indexing),
:mod:`.reductions` (sums/means over the sequence, sizes), :mod:`.attention`, :mod:`.losses`,
:mod:`.einsum`, :mod:`.complex`, :mod:`.flex`, :mod:`.fill`, :mod:`.routing`, :mod:`.autograd_fn`,
:mod:`.vmap`. Ops without a rule go to the rule oracle (:mod:`cp_compile.passes.propagate.oracle`)
before the gather fallback.
"""

from .registry import register_rule
from .table import RULES, apply_rule

__all__ = ["RULES", "apply_rule", "register_rule"]
