"""Attention-mask terms read from module buffers: classified from their values, once, at compile time.

nanoGPT keeps its causal mask in a registered buffer and slices it to the sequence::

    self.register_buffer("bias", torch.tril(torch.ones(L, L)).view(1, 1, L, L))      # (1, 1, L, L)
    att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))

Dynamo inlines the module, so the buffer is a graph input (placeholder ``l_self_buffers_bias_``,
source ``L['self']._buffers['bias']``), and :mod:`.fuse_attention` makes the chain
``sdpa(q, k, v, attn_mask=~(bias[:, :, :T, :T] == 0))``. :mod:`.masks` reads positions off
arange comparisons, never off data, so this term used to be explicit: every rank built c x S
rows of it (O(S^2 / N) memory). The rule here, used by :mod:`.masks` for any term it cannot
follow abstractly:

* a term that depends only on constants and on *state* tensors that need no gradient (module
  buffers, frozen parameters, tensors Dynamo lifted as constants) is evaluated on the real
  tensors Dynamo traced with (each placeholder's ``grapharg`` holds the tensor the backend
  receives as its example input). Not evaluated: a term reading a forward() argument or an
  activation, a parameter that requires grad (a learned bias: a rule of :mod:`.lift` or refused), a
  random op, state that the graph writes to, an in-place op on a value anything else reads
  or shares memory with (PyTorch's ``zeros_like(m, dtype=float).masked_fill_(m, -inf)`` in
  nn.MultiheadAttention writes to a fresh tensor: evaluated), or intermediates larger than
  both the state they read and ``MAX_ELEMENTS``;
* its (S, S) pattern (boolean; a float term whose entries are all 0 or -inf / finfo.min is
  ``term == 0``), the same for every batch and head, is compared with the band
  ``lo <= kv - q <= hi`` that its last row and first row imply::

    bias[:, :, :16, :16] == 1          lower triangle     Band(hi=0): causal, no attn_mask
    tril(ones(L, L)).triu(-3) > 0      0 <= q - kv < 4    Band(-3, 0): causal window 4
    ones(1, 1, L, L).bool()            all True           Band(): no mask
    a random bool buffer                no band            explicit, as before

  The band then composes with the other terms like an arange-built one (:func:`.masks._split`).

Dynamic shapes (T symbolic): ``x[..., :T, :T]`` (start 0, one T for both dims) of a state
tensor, followed only by elementwise ops with constants, is classified on the whole top-left
square of x: the top-left T x T corner of a band is the same band for every T (and Dynamo
guards T <= L, since the slice has to match the scores). Any other symbolic dependency keeps
the term explicit.

Assumption: the values are read once, when the graph is compiled. Dynamo guards a buffer's
shape, dtype and device, not its values, so a model that later writes new values into its
mask buffer (in place, or by assigning a new tensor of the same shape) keeps the mask it was
compiled with: call ``torch._dynamo.reset()`` after changing it. Each evaluated term is logged
at INFO saying so.
"""

from __future__ import annotations

import contextvars
import operator
import re
from dataclasses import dataclass
from functools import reduce
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw, statically_known_true

from ...context import fake_value, log, source_line
from ..graph_inputs import is_parameter_like, user_name
from ...op_vocab import ALIASING, IN_PLACE_OPERATORS, writes_in_place
from .rows import is_elementwise

MAX_ELEMENTS = 1 << 24  # an intermediate may be this large even when the state it reads is smaller

_RANDOM = re.compile(r"rand|normal|bernoulli|multinomial|poisson|dropout|empty|uniform|exponential|geometric|cauchy")


# beyond rows.is_elementwise: ops whose value on x[:T, :T] is their value on x, cut to [:T, :T]
_CORNER_SAFE = {"zeros_like", "ones_like", "full_like", "clone", "masked_fill_"}


# real_values(learned=True): parameters that require grad are read too (their current values, detached),
# to check a lifted rule of a learned bias against its term; never to classify a term by its values
_LEARNED: contextvars.ContextVar = contextvars.ContextVar("cp_compile_masks_learned", default=False)


class NotConstant(Exception):
    """The term depends on something other than constants and gradient-free state."""


@dataclass
class _Value:
    """A real value of the old graph; ``prefix``: the whole top-left square of a ``[..., :T, :T]``
    slice with T symbolic, standing for its T x T corner."""

    value: Any
    prefix: bool = False


Bounds = Tuple[Optional[int], Optional[int]]  # (lo, hi) of lo <= kv - q <= hi; None: unbounded


def constant_band(term: fx.Node, seq_len: int) -> Optional[Bounds]:
    """The band of the boolean mask ``term`` when it is computed from constants and state alone
    (see the module docstring), else None (the term stays explicit).

    ``bias[:, :, :16, :16].bool()`` of a lower-triangular buffer -> ``(None, 0)``."""
    if not isinstance(fake_value(term), torch.Tensor):
        return None
    leaves: List[fx.Node] = []
    try:
        with torch.no_grad(), unset_fake_temporarily():
            out = _evaluate(term, {}, leaves)
            keep = _keep(out.value)
            n = keep.shape[-1] if out.prefix and keep is not None else seq_len
            bounds = _band(keep, n) if keep is not None else None
    except NotConstant as e:
        log.debug("cp_compile: mask term %s is not evaluated at compile time: %s", term.name, e)
        return None
    except Exception as e:  # an op that does not run on the real values: keep the term as it is
        log.debug("cp_compile: mask term %s could not be evaluated: %s: %s", term.name, type(e).__name__, e)
        return None
    _log(term, leaves, bounds, out.prefix)
    return bounds


def _evaluate(node: fx.Node, memo: Dict[fx.Node, _Value], leaves: List[fx.Node]) -> _Value:
    """The real value of ``node`` from its state inputs (NotConstant when it has others)."""
    if node in memo:
        return memo[node]
    if node.op in ("placeholder", "get_attr"):
        val = _Value(_state(node))
        leaves.append(node)
    elif node.op not in ("call_function", "call_method"):
        raise NotConstant(f"{node.name} is a {node.op}")
    elif _impure(node) and not (writes_in_place(node) and _private_write(node)):
        raise NotConstant(f"{node.name} ({_name(node)}) is random, in place on a shared value, or has effects")
    elif _symbolic_slice(node):
        val = _prefix(node, memo, leaves)
    else:
        val = _call(node, memo, leaves)
    memo[node] = val
    return val


def _state(node: fx.Node) -> torch.Tensor:
    """The real tensor behind a placeholder or get_attr that is gradient-free, unmutated state."""

    if node.op == "get_attr":
        tensor = reduce(getattr, node.target.split("."), node.graph.owning_module)
    else:
        grapharg = node.meta.get("grapharg")  # Dynamo's record of the input; none on split graphs
        try:
            tensor = grapharg.example if grapharg is not None else None
        except AssertionError:  # its weak reference expired
            tensor = None
        if not isinstance(tensor, torch.Tensor) or not is_parameter_like(node, tensor):
            raise NotConstant(f"{node.name} is a model input, an activation or a size")
    if not isinstance(tensor, torch.Tensor) or is_fake(tensor) or tensor.device.type == "meta":
        raise NotConstant(f"{node.name} has no real value here")
    if tensor.requires_grad and not _LEARNED.get():
        raise NotConstant(f"{node.name} requires grad (a learned bias)")
    if _mutated(node):
        raise NotConstant(f"{node.name} is modified in place by the graph")
    return tensor


def _call(node: fx.Node, memo: Dict[fx.Node, _Value], leaves: List[fx.Node]) -> _Value:
    """Run ``node`` on the real values of its inputs."""
    vals: Dict[fx.Node, _Value] = {}

    def real(a: fx.Node) -> Any:
        vals[a] = _evaluate(a, memo, leaves)
        return vals[a].value

    args, kwargs = fx.node.map_aggregate((node.args, node.kwargs), lambda a: real(a) if isinstance(a, fx.Node) else a)
    prefix = [v for v in vals.values() if v.prefix]
    if prefix and not ((is_elementwise(node) or _name(node) in _CORNER_SAFE) and len(prefix) == len(vals)
                       and len({tuple(v.value.shape) for v in prefix}) == 1):
        raise NotConstant(f"{node.name} ({_name(node)}) combines a slice of symbolic length with other values")
    if writes_in_place(node) and not _unshared(node.args[0], memo):
        raise NotConstant(f"{node.name} ({_name(node)}) writes to memory another value shares")
    if not prefix:
        _check_size(node, leaves)
    if node.op == "call_method":
        return _Value(getattr(args[0], node.target)(*args[1:], **kwargs), bool(prefix))
    return _Value(node.target(*args, **kwargs), bool(prefix))


def _symbolic_slice(node: fx.Node) -> bool:
    """``x[..., :T, ...]`` with T (or any slice bound) a graph value: a symbolic size."""
    if node.target is not operator.getitem or not isinstance(node.args[1], tuple):
        return False
    return any(isinstance(i, slice) and any(isinstance(b, fx.Node) for b in (i.start, i.stop, i.step))
               for i in node.args[1])


def _prefix(node: fx.Node, memo: Dict[fx.Node, _Value], leaves: List[fx.Node]) -> _Value:
    """``x[lead, :T, :T]`` (T symbolic) -> x[lead] over the top-left m x m square, m the shorter
    of x's last two dims (1, 1, L, L) -> (1, 1, L, L), marked ``prefix``."""
    base, index = _evaluate(node.args[0], memo, leaves), node.args[1]
    x = base.value
    if base.prefix or not isinstance(x, torch.Tensor) or x.dim() < 2 or len(index) < 2:
        raise NotConstant(f"{node.name} slices a value that is not a constant matrix")
    *lead, rows, cols = index
    corner = all(isinstance(i, slice) and i.start in (None, 0) and i.step in (None, 1) and isinstance(i.stop, fx.Node)
                 for i in (rows, cols))
    if not corner or not _same_size(node, rows.stop, cols.stop):
        raise NotConstant(f"{node.name} is not x[..., :T, :T] with one symbolic T")
    flat = [b for i in lead for b in ((i.start, i.stop, i.step) if isinstance(i, slice) else (i,))]
    used = sum(1 for i in lead if i is not None and i is not Ellipsis) + 2
    if any(isinstance(b, fx.Node) for b in flat) or (Ellipsis not in lead and used != x.dim()):
        raise NotConstant(f"{node.name}: the symbolic slices are not of the last two dims")
    m = min(x.shape[-2:])
    return _Value(x[(*lead, slice(None, m), slice(None, m))], True)


def _same_size(node: fx.Node, a: fx.Node, b: fx.Node) -> bool:
    """Whether the stops ``a``, ``b`` are one symbolic T and the slice really is T x T (not min(T, L))."""
    ta, tb, val = fake_value(a), fake_value(b), fake_value(node)
    if not all(isinstance(t, torch.SymInt) for t in (ta, tb)) or not isinstance(val, torch.Tensor):
        return False
    one_t = a is b or ta.node.expr == tb.node.expr
    return one_t and statically_known_true(val.shape[-1] == ta) and statically_known_true(val.shape[-2] == ta)


def _impure(node: fx.Node) -> bool:
    """Random, in place, writing to ``out=``, or otherwise side-effecting."""
    target, name = node.target, _name(node)
    if getattr(target, "__module__", None) == "_operator":
        return target in IN_PLACE_OPERATORS
    if _RANDOM.search(name) or writes_in_place(node) or "out" in node.kwargs:
        return True
    try:
        return node.op == "call_function" and node.is_impure(impure_random=True)
    except Exception:
        return True


def _private_write(node: fx.Node) -> bool:
    """An in-place op the evaluation may run: on a value that nothing else reads, and no random
    fill. PyTorch's ``_canonical_mask`` (nn.MultiheadAttention, nn.Transformer) writes::

        mask = zeros_like(causal, dtype=float32).masked_fill_(causal, -inf)     # zeros_like: one user

    Whether that value shares memory with another (a view of a buffer) is checked on the
    real tensors (:func:`_unshared`)."""
    x = node.args[0] if node.args else None
    return (isinstance(x, fx.Node) and len(x.users) == 1 and node.target not in IN_PLACE_OPERATORS
            and not _RANDOM.search(_name(node)) and "out" not in node.kwargs)


def _unshared(x: fx.Node, memo: Dict[fx.Node, _Value]) -> bool:
    """Whether the real value of ``x`` shares no memory with any other value evaluated so far
    (every input it could be a view of was evaluated before it, buffers included)."""
    ptr = memo[x].value.untyped_storage().data_ptr()
    return not any(isinstance(v.value, torch.Tensor) and v.value.untyped_storage().data_ptr() == ptr
                   for n, v in memo.items() if n is not x)


def _name(node: fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))


def _mutated(leaf: fx.Node) -> bool:
    """Whether an op of the graph writes to ``leaf`` or to a view of it (in place, ``out=``): the
    value at compile time would then not be the one the mask reads at run time."""
    aliases, todo = {leaf}, [leaf]
    while todo:
        for user in todo.pop().users:
            if user.op not in ("call_function", "call_method"):
                continue
            first = user.args[0] if user.args and isinstance(user.args[0], fx.Node) else None
            out = user.kwargs.get("out")
            if (first in aliases and writes_in_place(user)) or (isinstance(out, fx.Node) and out in aliases):
                return True
            if first in aliases and _name(user) in ALIASING and user not in aliases:
                aliases.add(user)
                todo.append(user)
    return False


def _check_size(node: fx.Node, leaves: List[fx.Node]) -> None:
    """Refuse intermediates larger than the state read and than MAX_ELEMENTS (no O(S^2) surprise)."""
    val = fake_value(node)
    if not isinstance(val, torch.Tensor):
        return
    numel = 1
    for d in val.shape:
        numel *= d if isinstance(d, int) else guarding_hint_or_throw(d)
    state = max((_state_numel(leaf) for leaf in leaves), default=0)
    if numel > max(MAX_ELEMENTS, state):
        raise NotConstant(f"{node.name} has {numel} elements, more than the state it reads")


def _state_numel(leaf: fx.Node) -> int:
    val = fake_value(leaf)
    return val.numel() if isinstance(val, torch.Tensor) and all(isinstance(d, int) for d in val.shape) else 0


def _keep(value: Any) -> Optional[torch.Tensor]:
    """Where a mask keeps scores: a bool tensor as it is; a float one that only adds 0 (kept)
    or -inf / finfo.min (masked) as ``value == 0``; None for anything else."""
    if not isinstance(value, torch.Tensor):
        return None
    if value.dtype is torch.bool:
        return value
    if value.is_floating_point():
        masked = (value == float("-inf")) | (value == torch.finfo(value.dtype).min)
        if bool(((value == 0) | masked).all()):
            return value == 0
    return None


def _band(keep: torch.Tensor, n: int) -> Optional[Bounds]:
    """``(lo, hi)`` when ``keep`` (..., n|1, n|1), the same for every leading index, is
    ``lo <= kv - q <= hi`` over (n, n); bounds that cut nothing are None.

    tril(ones(4, 4)) -> (None, 0); tril(ones(4, 4)).triu(-1) -> (-1, 0); ones(4, 4) -> (None, None)."""
    keep = keep.reshape((1,) * max(0, 2 - keep.dim()) + tuple(keep.shape))
    if any(s not in (1, n) for s in keep.shape[-2:]):
        return None
    lead = keep.reshape(-1, *keep.shape[-2:])  # (prod(leading), n|1, n|1)
    if not bool((lead == lead[:1]).all()):
        return None  # differs by batch or head
    m = lead[0].expand(n, n)
    first, last = m[n - 1].nonzero(), m[0].nonzero()  # the last query's first key, the first query's last
    if not len(first) or not len(last):
        return None
    lo, hi = int(first[0]) - (n - 1), int(last[-1])
    if not torch.equal(m, torch.ones(n, n, dtype=torch.bool, device=m.device).tril(hi).triu(lo)):
        return None
    return (None if lo <= -(n - 1) else lo, None if hi >= n - 1 else hi)


def _log(term: fx.Node, leaves: List[fx.Node], bounds: Optional[Bounds], prefix: bool) -> None:
    """INFO for each term that read state: what it is, and that its values were read now."""

    state = [user_name(n) if n.op == "placeholder" else str(n.target) for n in leaves]
    what = _describe(bounds)
    if not state:
        log.debug("cp_compile: constant mask term %s at %s is %s", term.name, source_line(term), what)
        return
    corner = " ([:T, :T] corners of the whole buffer, for every T)" if prefix else ""
    log.info("cp_compile: attention mask term %s at %s reads %s; its values, read once at compile time, are %s%s. "
             "Dynamo does not guard on buffer values: a model that changes this buffer later must call "
             "torch._dynamo.reset().", term.name, source_line(term), ", ".join(dict.fromkeys(state)), what, corner)


def _describe(bounds: Optional[Bounds]) -> str:
    """(None, 0) -> "causal"; (-3, 0) -> "a causal sliding window of 4"; None -> not a band."""
    if bounds is None:
        return "not a band (kept as an explicit mask)"
    lo, hi = bounds
    if hi is None and lo is None:
        return "no mask (all True)"
    if hi == 0:
        return "causal" if lo is None else f"a causal sliding window of {1 - lo}"
    return f"the band {lo} <= kv - q <= {hi}"


def real_values(nodes: List[fx.Node], learned: bool = False) -> Optional[List[torch.Tensor]]:
    """The real values of ``nodes``, computed now from constants and gradient-free state as
    :func:`constant_band` computes a term (one evaluation, shared intermediates), or None when
    one of them reads anything else, is a symbolic-size slice, or does not run on real values.
    ``learned``: parameters that require grad count as state too (read now, under no_grad)."""
    memo: Dict[fx.Node, _Value] = {}
    leaves: List[fx.Node] = []
    token = _LEARNED.set(learned)
    try:
        with torch.no_grad(), unset_fake_temporarily():
            out = [_evaluate(n, memo, leaves) for n in nodes]
    except NotConstant as e:
        log.debug("cp_compile: %s not evaluated at compile time: %s", [n.name for n in nodes], e)
        return None
    except Exception as e:  # noqa: BLE001 - an op that does not run on the real values: not evaluated
        log.debug("cp_compile: %s could not be evaluated: %s: %s", [n.name for n in nodes], type(e).__name__, e)
        return None
    finally:
        _LEARNED.reset(token)
    if any(v.prefix or not isinstance(v.value, torch.Tensor) for v in out):
        return None
    return [v.value for v in out]
