"""The rule registry: op -> layout rule, filled where each rule is defined.

    @register_rule(F.layer_norm, "softmax")        # functions, or method names as str
    def per_token(em, node): ...                    # RULES[F.layer_norm] and RULES[("method", "softmax")]

A rule is ``rule(em, node) -> (new value, layout)`` for a node with a Sharded input (:mod:`.table`
looks it up, and imports every module that registers rules). A target registered twice is an
error at import: two rules for one op would make the table depend on the order of the imports.
``None`` targets (ops this torch does not have) are skipped.

A rule that handles windowed Sharded inputs (``Sharded(..., window=(a, n))``, a slice of the sequence:
rules/getitem.py) says so with ``@window_aware`` (above ``@register_rule``): it then checks the
window of every Sharded operand, keeps it on its result, and masks the rows outside it wherever it
masks padding. The walk (:func:`.table.apply_rule`) gathers a windowed input of any other rule first.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Set

from ...op_vocab import rule_key
from .common import Rule

RULES: Dict[Any, Rule] = {}
WINDOW_AWARE: Set[Rule] = set()  # the rules that read windowed Sharded values correctly
CHUNK_AWARE: Set[Rule] = set()  # the rules that read Sharded values in chunks of tokens correctly


def register_rule(*targets: Any) -> Callable[[Rule], Rule]:
    """Decorator: ``rule`` handles each of ``targets`` (functions, or method names as str)."""

    def register(rule: Rule) -> Rule:
        for target in targets:
            if target is None:
                continue
            key = rule_key(target)
            if key in RULES:
                had = RULES[key]
                raise RuntimeError(
                    f"cp_compile: {key!r} has two layout rules, {had.__module__}.{had.__qualname__} and "
                    f"{rule.__module__}.{rule.__qualname__}. Fix: register it in one @register_rule only.")
            RULES[key] = rule
        return rule

    return register


def window_aware(rule: Rule) -> Rule:
    """Decorator: ``rule`` reads windowed Sharded inputs correctly (see the module docstring)."""
    WINDOW_AWARE.add(rule)
    return rule


def chunk_aware(rule: Rule) -> Rule:
    """Decorator: ``rule`` reads Sharded inputs in chunks of tokens (``Sharded.chunk`` > 1) correctly and
    keeps the chunking in what it returns (placements.py)."""
    CHUNK_AWARE.add(rule)
    return rule


__all__ = ["CHUNK_AWARE", "RULES", "WINDOW_AWARE", "chunk_aware", "register_rule", "window_aware"]
