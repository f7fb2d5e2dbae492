"""Every lifted rule of positions is checked against the tensor it replaces, at compile time.

A rule (:mod:`.lift`) stands in for a mask term the model builds as an (.., S, S) tensor; the
ring op evaluates it per rectangle at global positions. A rule that means something else than
its term is silently wrong numbers (HF MPT once trained with a per-key ALiBi bias read as a
boolean mask), so before a rule is used::

    term  = the term's real value, from the state Dynamo traced with        (buffers.real_values)
    rule  = the mods of the rule on the whole (S, S) grid, by the same
            code the ring runs per rectangle (ring.mods.Mods)
    boolean term:  rule == term                         (which keys each query sees)
    float term:    rule == term, -inf where -inf        (what is added to the scores)

A rule that disagrees is not used: the term stays an explicit mask (exact, O(S^2 / N) memory)
and a WARNING names it. Not checked (the rule is used as lifted, and DEBUG says so): a term
with more than ``CHECK_ELEMENTS`` values (the check computes the whole term once, at compile
time), or one whose values cannot be computed here.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx

from ...context import fake_value, log, source_line
from .buffers import real_values

CHECK_ELEMENTS = 1 << 22  # terms up to this many values (B·H·S·S) are checked: S up to 2k at one head


def agrees_with_term(rule: Any) -> bool:
    """Whether ``rule`` (a :class:`.lift.Rule`) computes its term; True when it cannot be checked."""
    val = fake_value(rule.term)
    if not isinstance(val, torch.Tensor) or not all(isinstance(d, int) for d in val.shape):
        return True
    read = [s for i, s in enumerate(rule.shapes) if not rule.read_whole(i)]
    width = max((s[0] for s in read), default=1) * max((s[1] for s in read), default=1)
    if val.numel() * width > CHECK_ELEMENTS:
        log.debug("cp_compile: lifted mask term %s not checked: %d values", rule.term.name, val.numel() * width)
        return True
    values = real_values([rule.term, *rule.leaves], learned=True)  # a learned table: its values now
    if values is None:
        log.debug("cp_compile: lifted mask term %s not checked: its values are not computable now", rule.term.name)
        return True
    term, *leaves = values
    term = term.reshape((1,) * max(0, 4 - term.dim()) + tuple(term.shape))  # (.., S|1, S|1) as SDPA broadcasts it
    got = _rule_grid(rule, [x.detach().reshape(s) for x, s in zip(leaves, rule.shapes)], term)
    term = term.detach()
    why = _difference(got, term)
    if why is not None:
        log.warning("cp_compile: the rule of positions lifted from the attention mask term %s at %s does not "
                    "compute that term (%s); the term is applied as an explicit mask instead (exact, "
                    "O(S^2 / N) memory per rank). Please report this with the model.",
                    rule.term.name, source_line(rule.term), why)
    return why is None


def _rule_grid(rule: Any, leaves: list, term: torch.Tensor) -> torch.Tensor:
    """The rule's values on the (B|1, H|1, S_q, S_kv) grid, as the ring op computes them."""
    from ....ring.mods import Mods
    from .lift import as_mod

    b, h = term.shape[0], term.shape[1]  # a table lookup reads heads no leaf has: the term's own
    q, kv = (torch.arange(n, device=term.device) for n in term.shape[-2:])
    if rule.additive:
        mods = Mods(score_mod=as_mod("score", (rule,), rule.term), score_buffers=tuple(leaves))
        zero = torch.zeros(b, h, len(q), len(kv), dtype=torch.float64 if term.dtype == torch.float64 else
                           torch.float32, device=term.device)
        return mods.scores(zero, q, kv)
    mods = Mods(mask_mod=as_mod("mask", (rule,), rule.term), mask_buffers=tuple(leaves))
    return mods.mask(b, h, q, kv)


def _difference(got: torch.Tensor, term: torch.Tensor) -> Optional[str]:
    """None when ``got`` equals ``term`` broadcast to a common (.., S_q, S_kv) shape, else how they differ."""
    try:
        a, b = torch.broadcast_tensors(got, term)
    except RuntimeError:
        return f"shapes {tuple(got.shape)} and {tuple(term.shape)} do not broadcast"
    if term.dtype is torch.bool:
        wrong = int((a.to(torch.bool) != b).sum())
        return None if wrong == 0 else f"{wrong} of {b.numel()} keep flags differ"
    a, b = a.double(), b.double()
    if not torch.equal(torch.isneginf(a), torch.isneginf(b)):
        return "it masks other pairs (-inf) than the term"
    finite = torch.isfinite(b)
    if not torch.equal(finite, torch.isfinite(a)):
        return "its finite entries are not the term's"
    err, scale = _max_abs(a[finite] - b[finite]), _max_abs(b[finite])
    return None if err <= 1e-6 * max(scale, 1.0) else f"max |rule - term| = {err:.3g} (|term| up to {scale:.3g})"


def _max_abs(x: torch.Tensor) -> float:
    return float(x.abs().max()) if x.numel() else 0.0


def learned_bias_lifts(bias: fx.Node) -> bool:
    """Whether every additive part of ``bias`` (a float bias added to hand-written scores) that requires
    grad is a rule of positions over whole learned tables that computes it (lifted and verified), so the
    ring op can apply it as a score rule and return its tables' gradient. A bias computed from
    activations is no such rule: the hand-written attention stays as written."""
    from .lift import _requires_grad, _shape, additive_parts, lift_term

    shape = _shape(bias)
    parts = additive_parts(bias, lambda target, args, like: None) if shape is not None and len(shape) >= 2 else None
    if parts is None:
        return False
    learned = [a for a in parts[1] if _requires_grad(a)]
    for a in learned:
        rule = lift_term(a, shape[-1]) if isinstance(a, fx.Node) else None
        if rule is None or not rule.learned or not agrees_with_term(rule):
            return False
    return bool(learned)


__all__ = ["agrees_with_term", "learned_bias_lifts"]
