"""A product with a decay matrix ``exp(segsum(a))`` along a dim becomes one scan kernel call.

Before (Mamba2's chunked SSD, the paper's reference form, as Hugging Face's Mamba2 hybrids write it)::

    a = pad(A_last (B, H, n), (1, 0))                       # (B, H, n+1): 0, then each chunk's log decay
    W = exp(segsum(a)).transpose(1, 3)                      # (B, n+1, n+1, H): W[z, c] = exp(a_{z+1} + … + a_c), z ≤ c
    X = cat([h0 (B, 1, H, P, N), S (B, n, H, P, N)], 1)
    y = einsum("bzch,bzhpn->bchpn", W, X)                   # (B, n+1, H, P, N)
    ... y[:, :-1] (the state entering each chunk), y[:, -1] (the final state)

After::

    E, final = DecayScan(dim=1)(a=A_last aligned to S (B, n, H, 1, 1), x=S, initial_state=h0[:, 0])
    ... E, final

A contraction ``y_c = Σ_z W[c, z] x_z`` whose matrix is exactly ``exp(Σ_{z<k≤c} a_k)`` for z ≤ c and 0
above is the recurrence ``y_c = exp(a_c) y_{c-1} + x_c`` (:mod:`cp_compile.recurrence.decay_scan`). The
matrix is recognised by what it computes, not how: the ops between the decay vector ``a`` (the nearest
value W is a function of alone) and W are run on random decays and compared with the definition, over
every way W's dims can hold (…, c, z), so any spelling of segsum (masked cumsum, a difference of
cumsums) and any transpose of it is found. The reference form's prefix (a zero decay and the initial
state in front, the last entry read as the final state) becomes the kernel's initial state and final
state; without it the inclusive scan ``exp(a) ⊙ E + x`` replaces the product. The kernel carries its
own state-passing contract, so each rank scans only its chunks (the chunked layout: placements.py).
"""

from __future__ import annotations

import itertools
import math
import operator
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx

from ...recurrence.decay_scan import DecayScan
from ..context import RewriteContext, fake_value, log, source_line
from ..propagate.rules.einsum import parse_equation
from .chunk_views import nearest_ancestors, tokens_per_entry
from .fake_emit import FakeEmitter

_PADS = (torch._C._nn.pad, torch.nn.functional.pad)
_MAX_SLICE = 80  # ops between the decay vector and its matrix (segsum is about ten)


def fold_decay_scans(gm: fx.GraphModule, ctx: RewriteContext) -> int:
    """Replace every ``einsum`` with a decay matrix by a :class:`DecayScan` call; the count."""
    count = 0
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.einsum]:
        match = _match(node)
        if match is None:
            continue
        _replace(gm, node, *match)
        log.info("cp_compile: the decay-matrix product at %s is a linear scan along its dim %d", source_line(node),
                 match[2])
        count += 1
    if count:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return count


def _match(node: fx.Node) -> Optional[Tuple[fx.Node, List[Optional[int]], int, fx.Node]]:
    """(a, a's dim for each of x's dims (None: broadcast), the scan dim in x, x) when ``node`` is
    ``einsum(W, x)`` with W a decay matrix of ``a``, else None."""
    eq, ops = node.args[0], list(node.args[1:])
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = list(ops[0])
    if not isinstance(eq, str) or len(ops) != 2 or node.kwargs or not all(isinstance(o, fx.Node) for o in ops):
        return None
    parsed = parse_equation(eq, [fake_value(o).dim() for o in ops])
    if parsed is None:
        return None
    subs, out = parsed
    for w_i in (0, 1):
        found = _decay_product(ops[w_i], ops[1 - w_i], subs[w_i], subs[1 - w_i], out)
        if found is not None:
            return found
    return None


def _decay_product(w: fx.Node, x: fx.Node, ws: str, xs: str, out: str):
    """The match for ``einsum(ws, xs -> out)`` read as W·x, or None."""
    z = [c for c in ws if c in xs and c not in out]
    cs = [c for c in ws if c in out and c not in xs]
    if len(z) != 1 or len(cs) != 1 or len(set(ws)) != len(ws) or len(set(xs)) != len(xs):
        return None
    z, c = z[0], cs[0]
    if out != xs.replace(z, c) or any(ch not in xs and ch != c for ch in ws):
        return None
    for a in _candidates(w):
        letters = _decay_letters(w, a, ws, c, z)
        if letters is not None:
            return a, [letters.get(ch) for ch in xs], xs.index(z), x
    return None


def _candidates(w: fx.Node) -> List[fx.Node]:
    """Values W might be a function of alone, nearest first: each tensor ancestor whose removal cuts W
    off every graph input (the constants between them are factories: ``ones``, ``tril``)."""
    ndim = fake_value(w).dim() - 1
    return [a for a in nearest_ancestors(w, _MAX_SLICE) if isinstance(fake_value(a), torch.Tensor)
            and fake_value(a).dim() == ndim and fake_value(a).is_floating_point() and _cuts(w, a)]


def _cuts(w: fx.Node, a: fx.Node) -> bool:
    """Whether every path from W back to a graph input passes through ``a`` (within the slice bound)."""
    seen, stack = {w, a}, [w]
    while stack:
        n = stack.pop()
        if n.op == "placeholder" or len(seen) > _MAX_SLICE:
            return False
        for p in n.all_input_nodes:
            if p not in seen:
                seen.add(p)
                stack.append(p)
    return True


def _decay_letters(w: fx.Node, a: fx.Node, ws: str, c: str, z: str) -> Optional[Dict[str, int]]:
    """{W's letter: a's dim} (z: a's scan dim) when W == exp(segsum(a)) with W's c the row (later
    position) and z the column, checked on random decays; else None."""
    shape = tuple(fake_value(a).shape)
    if any(not isinstance(s, int) for s in shape) or math.prod(shape) > 1 << 16:
        return None
    rng = torch.Generator().manual_seed(0)  # (its own: compiling must not move the user's random stream)
    decays = -torch.rand(shape, generator=rng, dtype=torch.float64) - 0.05  # (…, m) log decays in (-1.05, -0.05)
    got = _run_slice(w, a, decays.to(fake_value(a).dtype))
    if got is None:
        return None
    for d in range(len(shape)):
        want = _segsum_exp(decays, d)  # (a's dims without d…, row i, column j)
        rest = [e for e in range(len(shape)) if e != d]
        for perm in itertools.permutations(range(want.dim())):
            if tuple(want.shape[p] for p in perm) != tuple(got.shape):
                continue
            letters = {ws[k]: (rest[p] if p < len(rest) else ("row" if p == len(rest) else d))
                       for k, p in enumerate(perm)}
            if letters.get(c) != "row" or letters.get(z) != d:
                continue
            if torch.allclose(got.double(), want.permute(perm), rtol=1e-4, atol=1e-6):
                letters.pop(c)
                return letters
    return None


def _segsum_exp(a: torch.Tensor, d: int) -> torch.Tensor:
    """exp(Σ_{j<k≤i} a_k) for j ≤ i, else 0: (a's dims without d, i, j)."""
    cs = torch.cumsum(a.movedim(d, -1), -1)
    diff = cs[..., :, None] - cs[..., None, :]
    m = a.shape[d]
    return torch.exp(diff).masked_fill(~torch.ones(m, m, dtype=torch.bool).tril(), 0.0)


def _run_slice(w: fx.Node, a: fx.Node, value: torch.Tensor) -> Optional[torch.Tensor]:
    """W computed from ``a = value`` by the graph's own ops between them (None if they do not run)."""
    env: Dict[fx.Node, Any] = {a: value}

    def ev(n: fx.Node) -> Any:
        if n not in env:
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), ev)
            if n.op == "call_function":
                env[n] = n.target(*args, **kwargs)
            elif n.op == "call_method":
                env[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
            else:
                raise ValueError(n.op)
        return env[n]

    try:
        out = ev(w)
    except Exception as e:  # noqa: BLE001  (ops we cannot replay: not a decay matrix we can prove)
        log.debug("cp_compile: the candidate decay matrix %s did not replay: %s", w.name, e)
        return None
    return out if isinstance(out, torch.Tensor) else None


def _replace(gm: fx.GraphModule, node: fx.Node, a: fx.Node, a_dims: List[Optional[int]], d: int,
             x: fx.Node) -> None:
    """The scan call in place of ``node`` (see the module docstring), its prefix taken as h0 / final."""
    em = FakeEmitter(gm.graph, node, x)
    prefix = _prefix(a, a_dims, d, x)
    if prefix is not None:
        a, x, h0 = prefix
        h0 = em.method("squeeze", h0, d)
    else:
        h0 = em.fn(torch.zeros_like, em.fn(operator.getitem, x, (slice(None),) * d + (0,)))
    aligned = _aligned(em, a, a_dims)
    kernel = DecayScan(d, tokens_per_entry=tokens_per_entry(x, fake_value(x).shape[d]))
    call = em.fn(kernel, aligned, x, h0)
    entering, final = em.fn(operator.getitem, call, 0), em.fn(operator.getitem, call, 1)
    if prefix is None:  # the inclusive scan: y = exp(a) ⊙ E + x
        node.replace_all_uses_with(em.fn(operator.add, em.fn(operator.mul, em.fn(torch.exp, aligned), entering), x))
        return
    whole = None
    for use in list(node.users):
        part = _part(use, d, fake_value(node).shape[d])
        if part is not None:
            use.replace_all_uses_with(entering if part == "entering" else final)
            continue
        if whole is None:  # y read any other way: [E, final] along d
            whole = em.fn(torch.cat, [entering, em.method("unsqueeze", final, d)], d)
        use.replace_input_with(node, whole)


def _prefix(a: fx.Node, a_dims: List[Optional[int]], d: int, x: fx.Node) -> Optional[Tuple[fx.Node, fx.Node, fx.Node]]:
    """(a without its leading zero, x without h0, h0) for the reference form
    ``a = pad(a0, (…, 1, 0, …))``, ``x = cat([h0, S], d)`` with h0 one entry long; else None."""
    ad = a_dims[d]
    if a.op != "call_function" or a.target not in _PADS or x.op != "call_function" or x.target is not torch.cat:
        return None
    a0, pad = a.args[0], a.args[1] if len(a.args) > 1 else a.kwargs.get("pad")
    nd = fake_value(a).dim()
    want = [0] * (2 * nd)
    want[2 * (nd - 1 - ad)] = 1
    value = a.args[3] if len(a.args) > 3 else a.kwargs.get("value")
    mode = a.args[2] if len(a.args) > 2 else a.kwargs.get("mode", "constant")
    if list(pad) + [0] * (2 * nd - len(pad)) != want or value not in (None, 0, 0.0) or mode != "constant":
        return None
    parts = x.args[0] if x.args else x.kwargs.get("tensors")
    dim = x.args[1] if len(x.args) > 1 else x.kwargs.get("dim", 0)
    if len(parts) != 2 or dim % fake_value(x).dim() != d or fake_value(parts[0]).shape[d] != 1:
        return None
    return a0, parts[1], parts[0]


def _aligned(em: FakeEmitter, a: fx.Node, a_dims: List[Optional[int]]) -> fx.Node:
    """``a`` with its dims in x's order and size-1 dims where x has dims a lacks."""
    present = [e for e in a_dims if e is not None]
    out = em.method("permute", a, *present) if present != sorted(present) else a
    for k, e in enumerate(a_dims):
        if e is None:
            out = em.method("unsqueeze", out, k)
    return out


def _part(use: fx.Node, d: int, size: int) -> Optional[str]:
    """"entering" for ``y[:, :-1]`` (all but the last along d), "final" for ``y[:, -1]``, else None."""
    if use.op != "call_function" or use.target is not operator.getitem:
        return None
    index = use.args[1] if isinstance(use.args[1], tuple) else (use.args[1],)
    if Ellipsis in index or len(index) <= d or any(i != slice(None) for i in index[:d]) \
            or any(i != slice(None) for i in index[d + 1:]):
        return None
    i = index[d]
    if isinstance(i, int) and i in (-1, size - 1):
        return "final"
    if isinstance(i, slice) and i.step in (None, 1) and i.start in (None, 0) and i.stop in (-1, size - 1):
        return "entering"
    return None


__all__ = ["fold_decay_scans"]
