"""What "exact" means for a ring_cp model against the same model run in one process.

One set of rules for the tests (``tests/checks.py`` re-exports them; the examples cannot import
tests/), ``examples/zoo/measure.py`` and ``examples/hf_sweep.py``. Two checks, since a graph
compiled unchanged is exact too:

* :func:`grad_errors`: every parameter gradient is held to its own norm,
  ``||g_cp - g_ref|| / ||g_ref||``, except the ones named as zero in exact arithmetic
  (``Member.zero_grads``, ``hf_models.ZERO_GRADS``), such as a key projection's bias where
  nothing rotates the keys: softmax ignores a constant shift of a row of scores, so that
  gradient is rounding noise in both runs, and its error is taken relative to ``ZERO_FLOOR``
  of the norm of the whole reference gradient (every parameter's together) instead.
* :func:`ring_mismatches`: every attention of the model, counted in the eager run without
  cp_compile (:class:`AttentionCount`), became ring attention.

And :func:`cp_compile_warnings` collects what cp_compile said (a gather or no CP must be warned).
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import math
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

TOL = 1e-5  # fp32: every gradient within this of the one-process run (relative)
ZERO_FLOOR = 1e-4  # a zero-in-exact-arithmetic gradient's error: relative to this fraction of the whole
ZERO_CEILING = 1e-6  # and its reference norm must be below this fraction (fp32 noise: ~1e-10)


def rel(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-30) -> float:
    """||a - b|| / ||b|| in float64, with ||b|| taken as at least ``floor``."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(floor)).item()


def grad_errors(cp_model: torch.nn.Module, ref_model: torch.nn.Module, zero: Sequence[str] = (),
                truth: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, float]:
    """Parameter name -> relative error of ``cp_model``'s gradient against ``ref_model``'s.

    ``zero``: the gradients that are zero in exact arithmetic, each a dotted suffix of a
    parameter name (``"k_proj.bias"``) or an fnmatch pattern of the whole name; each must name a
    parameter whose reference gradient is below ``ZERO_CEILING`` of the whole (AssertionError
    otherwise). A gradient on one side only is an error of ``inf``, unless the other side is all
    zeros (a parameter whose output the loss ignores, a BERT pooler under a causal-LM head: eager
    autograd leaves it None, a compiled graph, with or without ring_cp, gives it zeros); none on
    both is left out.

    ``truth``: the same model's gradients in float64 (name -> tensor), when the caller has them.
    The one-process float32 run is itself rounded, and for a gradient of cancelling terms (one
    that is zero in exact arithmetic, or ill-conditioned) its own error can exceed ``TOL``; such a
    gradient is judged against the truth instead: its error is reported as
    ``TOL · ||cp - truth|| / (2 ||ref - truth||)``, at most ``TOL`` exactly when ring_cp is no
    further from the float64 truth than twice the one-process float32 run (the rule the design
    applies to low precision).
    """
    refs = {n: p.grad for n, p in ref_model.named_parameters() if p.grad is not None}
    cps = {n: p.grad for n, p in cp_model.named_parameters()}
    whole = math.sqrt(sum(g.double().square().sum().item() for g in refs.values()))
    listed = {n for n in refs if any(_names(pattern, n) for pattern in zero)}
    unknown = [pattern for pattern in zero if not any(_names(pattern, n) for n in refs)]
    assert not unknown, f"zero-gradient pattern(s) naming no parameter with a gradient: {unknown}"
    loud = {n: refs[n].double().norm().item() / whole for n in sorted(listed)
            if refs[n].double().norm().item() > ZERO_CEILING * whole}
    assert not loud, f"listed as zero in exact arithmetic, but ||g|| / ||all of g|| is {loud}"
    errors = {}
    for name in sorted(set(refs) | {n for n, g in cps.items() if g is not None}):
        got, want = cps.get(name), refs.get(name)
        if got is None or want is None:
            errors[name] = 0.0 if _all_zero(got if want is None else want) else math.inf
        else:
            errors[name] = rel(got, want, ZERO_FLOOR * whole if name in listed else 1e-30)
            if truth is not None and errors[name] > TOL and name in truth:
                errors[name] = min(errors[name], _against_truth(got, want, truth[name]))
    return errors


def _all_zero(grad: torch.Tensor) -> bool:
    return not bool(grad.count_nonzero())


def _against_truth(got: torch.Tensor, want: torch.Tensor, true: torch.Tensor) -> float:
    """``TOL · ||got - true|| / (2 ||want - true||)``: at most TOL when ``got`` is no further from the
    float64 ``true`` than twice the float32 reference ``want`` is."""
    ref_err = (want.double() - true.double()).norm().item()
    if ref_err == 0.0:
        return math.inf
    return TOL * (got.double() - true.double()).norm().item() / (2.0 * ref_err)


def _names(pattern: str, name: str) -> bool:
    """Whether ``pattern`` names parameter ``name``: a dotted suffix of it, or fnmatch of the whole."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)


_FUSED_ATTENTION = ("scaled_dot_product", "_native_multi_head_attention", "_transformer_encoder_layer_fwd")
_SOFTMAX = ("_softmax", "_safe_softmax")


class AttentionCount(TorchDispatchMode):
    """Counts the attention calls of an eager run by the ATen ops it runs, without cp_compile:
    a fused attention kernel (SDPA's, nn.MultiheadAttention's fast path) or a softmax over a
    square (query x key) score tensor (attention written by hand, or SDPA's math path). Run the
    reference forward inside ``with AttentionCount() as count:``; ``count.calls`` is then what
    :func:`ring_mismatches` expects. (Not for flex_attention, which compiles itself eagerly; a
    higher-order op such as ``associative_scan`` runs outside the count: its body has no attention.)"""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if isinstance(func, torch._ops.HigherOrderOperator):  # run under no mode (its handler's state)
            return func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if "backward" not in name and (any(k in name for k in _FUSED_ATTENTION) or
                                       (name in _SOFTMAX and _square_over(args[0], args[1]))):
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _square_over(scores: torch.Tensor, dim: int) -> bool:
    """Whether the softmax over ``dim`` of ``scores`` normalises attention scores: its length is
    also that of another dim (self-attention scores are (..., S, S); a router's are (tokens, E))."""
    sizes = list(scores.shape)
    length = sizes.pop(dim % scores.dim())
    return length > 1 and length in sizes


def ring_mismatches(backend: Any, attentions: int, compiles: int = 1) -> List[str]:
    """What shows that not every attention of the model became ring attention; [] when all did.

    ``backend``: the ``cp_compile.RingCP`` that compiled the model (or anything with its
    ``graphs`` and ``records``, such as a slice of them); ``attentions``: the model's attention
    calls in one forward, counted independently of the backend (:class:`AttentionCount` on the
    eager reference run, or the model's attention layers); ``compiles``: how many times Dynamo
    compiled that forward (a graph per length under static shapes). Required: exactly
    ``attentions * compiles`` ring ops in the backend's rewritten graphs, and no attention
    recorded as one ring_cp could not split. (A graph compiled unchanged is exact and has no
    fallbacks: only this tells it from a rewrite.)
    """
    import cp_compile  # noqa: F401 (registers torch.ops.cp_compile)

    fwd = torch.ops.cp_compile.ring_attention_fwd.default
    rings = sum(n.target is fwd for gm in backend.graphs for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
                for n in m.graph.nodes)  # a selective-AC region's body holds its ring ops
    problems = []
    if attentions < 1:
        problems.append(f"{attentions} attention calls counted in the model: the count is wrong")
    if rings != attentions * compiles:
        problems.append(f"{rings} ring op(s) in the rewritten graphs for {attentions} attention call(s) x "
                        f"{compiles} compile(s)")
    unsplit = [u for r in backend.records for u in r.unsplit]
    if unsplit:
        problems.append(f"attention ring_cp could not split: {unsplit}")
    return problems


@contextlib.contextmanager
def cp_compile_warnings() -> Iterator[List[str]]:
    """Within: the message of every WARNING the ``cp_compile`` logger (or a child) emits, in
    order (also on a rank worker, where pytest's caplog does not reach)."""
    messages: List[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("cp_compile")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
