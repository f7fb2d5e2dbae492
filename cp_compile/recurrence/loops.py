"""A recurrence written as a Python loop, folded back into one kernel that runs any number of steps.

Dynamo unrolls ``for t in range(S): h = step(h, x[:, t]); out[:, t] = y`` into S copies of the step.
:mod:`cp_compile.passes.normalize.fold_loops` recognises the copies and replaces them by one call of
a :class:`LoopKernel`, which holds the step once as an FX module and runs it over however many steps
its per-token arguments hold::

    kernel(x0=a (B, S, D), x1=x (B, S, D), c0=w, initial_state=h0 (B, D))
        for t in range(S):   h, y = step(h, a[:, t], x[:, t], w)      # the user's own step, op for op
        -> (stack(y_t, dim=1) (B, S, D), h (B, D))                     # outputs, then the final state

The kernel honours the state-passing contract of :mod:`.spec` (``initial_state`` in, the final state
out), so the rule for registered kernels (``passes/propagate/rules/recurrence.py``) runs it on each
rank's runs. How the runs combine depends on the step, read off its graph by :func:`homogeneous_step`:

* the new state is elementwise affine in the old, ``h' = a ⊙ h + b`` (``a``, ``b`` free of ``h``:
  Mamba's sequential scan, RG-LRU, a decayed running sum): ``transition="elementwise"``, and the
  kernel's ``homogeneous=True`` runs the step with every term free of ``h`` dropped from the state's
  path (``h' = a ⊙ h``), which gives a run's map ``M`` from ``h = 1``;
* the new state is a matrix on dim -2 of the old, ``h' = A @ h + b`` for a (..., K, V) state, built of
  products ``W @ h``, scalings by values constant along V (``h * g[..., None]``) and sums of such (the
  chunked delta rule: ``h * exp(g_last) + kᵀ @ (v - w @ h)``): ``transition="matrix"``; the
  homogeneous step then maps any (..., K, W) columns alike, so the run's map ``A`` (..., K, K) is the
  steps run from the identity, V columns at a time;
* anything else (a state squared, a max, a transposed state): ``"serial"``, the state
  handed rank to rank in global order (exact, memory 1/N, one run at a time; warned by the rule).

A loop may carry several tensors (RWKV's numerator, denominator and running max). The contract has
one state, so the kernel's ``initial_state`` and final state are then the states flattened and
concatenated, ``cat([h0.reshape(-1), h1.reshape(-1), ...])`` (:meth:`LoopKernel.pack`), and the
kernel unpacks them around the steps. Packing keeps elements apart, so an elementwise map of each
state is an elementwise map of the packed one.
"""

from __future__ import annotations

import inspect
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

Tensor = torch.Tensor


@dataclass(frozen=True)
class StepRead:
    """How a step reads one per-token tensor: ``x[index with the step's position at ``dim``]``, or,
    with ``chunk`` C, the step's chunk ``t*C:(t+1)*C`` there."""

    dim: int
    index: Tuple[Any, ...]  # the traced index, with the position's entry replaced by None
    chunk: Optional[int] = None

    def at(self, x: Tensor, t: int) -> Tensor:
        here = t if self.chunk is None else slice(t * self.chunk, (t + 1) * self.chunk)
        return x[tuple(here if i == self.dim else e for i, e in enumerate(self.index))]

    def steps(self, x: Tensor) -> int:
        return self.steps_of(x.shape[self.dim])

    def steps_of(self, size: int) -> int:
        """The steps ``size`` entries along the read's dim feed."""
        if self.chunk is None:
            return size
        if size % self.chunk:
            raise RuntimeError(f"cp_compile: a folded loop reads chunks of {self.chunk} tokens; it was given "
                               f"{size} (not a multiple)")
        return size // self.chunk


@dataclass(frozen=True)
class StepOutput:
    """How the loop collected one per-step value: ``torch.stack`` / ``torch.cat`` of the list (with the
    collector's own dim), or the writes ``buf[..., t, ...] = y`` into a buffer of ``dtype`` (a stack
    along ``dim``; chunk writes ``buf[..., t*C:(t+1)*C, ...] = y``: a cat)."""

    kind: str  # "stack" | "cat" | "setitem"
    dim: int
    dtype: Optional[torch.dtype] = None
    chunk: Optional[int] = None  # the setitem writes chunks

    def collect(self, ys: List[Tensor]) -> Tensor:
        if self.kind == "cat" or self.chunk is not None:
            out = torch.cat(ys, self.dim)
        else:
            out = torch.stack(ys, self.dim)
        return out if self.dtype is None else out.to(self.dtype)


class LoopKernel:
    """One folded loop (module docstring): call it with keywords ``x0..`` (per-token tensors),
    ``c0..`` (whatever else the step reads), ``initial_state`` and ``homogeneous``."""

    def __init__(self, step: fx.GraphModule, homogeneous: Optional[fx.GraphModule], reads: Sequence[StepRead],
                 outputs: Sequence[StepOutput], others: int, where: str,
                 states: Optional[Sequence[Tuple[int, ...]]] = None) -> None:
        self.step, self.hom = step, homogeneous
        self.states = None if states is None or len(states) < 2 else tuple(tuple(s) for s in states)
        self.reads, self.outputs, self.others = tuple(reads), tuple(outputs), others
        self.where = where
        self.serial_reason: Optional[str] = None  # why the step is not elementwise affine (loop_kernel sets it)
        self.tokens_per_step = 1  # the tokens each step reads (C for a loop over chunks; fold_loops sets it)
        self.width: Optional[int] = None  # a matrix transition: the state's traced last dim V (loop_kernel sets it)
        self.__name__ = self.__qualname__ = f"loop_at_{_slug(where)}"
        self.__module__ = __name__
        params = [inspect.Parameter(f"x{i}", inspect.Parameter.KEYWORD_ONLY) for i in range(len(self.reads))]
        params += [inspect.Parameter(f"c{i}", inspect.Parameter.KEYWORD_ONLY) for i in range(others)]
        params += [inspect.Parameter("initial_state", inspect.Parameter.KEYWORD_ONLY),
                   inspect.Parameter("homogeneous", inspect.Parameter.KEYWORD_ONLY, default=False)]
        self.__signature__ = inspect.Signature(params)

    @property
    def transition(self) -> str:
        if self.hom is None:
            return "serial"
        return "matrix" if self.width is not None else "elementwise"

    def __call__(self, *, initial_state: Tensor, homogeneous: bool = False, **kw: Tensor) -> Tuple[Any, ...]:
        xs = [kw[f"x{i}"] for i in range(len(self.reads))]
        others = [kw[f"c{i}"] for i in range(self.others)]
        steps = self.reads[0].steps(xs[0])
        k = 1 if self.states is None else len(self.states)
        hs = self.unpack(initial_state)
        if homogeneous:
            if self.hom is None:
                raise RuntimeError(f"cp_compile: the loop at {self.where} is not affine in its state")
            if self.width is not None:
                return (*[None] * len(self.outputs), self._matrix_map(hs[0], xs, others, steps))
            for t in range(steps):
                got = self.hom(*hs, *[r.at(x, t) for r, x in zip(self.reads, xs)], *others)
                hs = list(got) if k > 1 else [got]
            return (*[None] * len(self.outputs), self.pack(*hs))
        ys: List[List[Tensor]] = [[] for _ in self.outputs]
        for t in range(steps):
            got = self.step(*hs, *[r.at(x, t) for r, x in zip(self.reads, xs)], *others)
            hs = list(got[:k])
            for acc, y in zip(ys, got[k:]):
                acc.append(y)
        return (*[o.collect(y) for o, y in zip(self.outputs, ys)], self.pack(*hs))

    def _matrix_map(self, h: Tensor, xs: List[Tensor], others: List[Tensor], steps: int) -> Tensor:
        """The homogeneous steps on ``h`` (..., K, W), any W: they act on every column alike, so the
        columns go through V at a time (the width the step was traced at), the last block zero-padded."""
        v, blocks = self.width, []
        for c in range(0, h.shape[-1], v):
            block = h[..., c:c + v]  # (..., K, w), w <= V
            w = block.shape[-1]
            block = torch.nn.functional.pad(block, (0, v - w)) if w < v else block
            for t in range(steps):
                block = self.hom(block, *[r.at(x, t) for r, x in zip(self.reads, xs)], *others)
            blocks.append(block[..., :w])
        return torch.cat(blocks, -1)  # (..., K, W)

    def tokens(self, name: str, size: int) -> int:
        """The tokens of the sequence that per-token argument ``name`` (``x<i>``) holds with ``size``
        entries along its sequence dim: as many steps as it feeds, times the tokens per step."""
        return self.reads[int(name[1:])].steps_of(size) * self.tokens_per_step

    def entries(self, name: str, tokens: int) -> int:
        """The entries along its sequence dim that argument ``name`` holds for ``tokens`` tokens."""
        return tokens // self.tokens_per_step * (self.reads[int(name[1:])].chunk or 1)

    def pack(self, *states: Tensor) -> Tensor:
        """The one state of the contract: the state itself, or several flattened and concatenated."""
        if self.states is None:
            return states[0]
        return torch.cat([s.reshape(-1) for s in states])

    def unpack(self, state: Tensor) -> List[Tensor]:
        """The loop's own states from the contract's one (:meth:`pack` undone)."""
        if self.states is None:
            return [state]
        sizes = [math.prod(s) for s in self.states]
        return [p.view(s) for p, s in zip(torch.split(state, sizes), self.states)]


def _slug(where: str) -> str:
    tail = where.rsplit("/", 1)[-1].split(":", 2)
    return "_".join(p for p in tail[:2] if p).replace(".", "_").replace(" ", "_") or "graph"


# --- is the step elementwise affine in its state? -----------------------------------------------

_MUL = {operator.mul, torch.mul, "mul"}
_DIV = {operator.truediv, torch.div, "div"}
_ADD = {operator.add, torch.add, "add"}
_SUB = {operator.sub, torch.sub, "sub"}
_NEG = {operator.neg, torch.neg, "neg"}
_MATMUL = {operator.matmul, torch.matmul, "matmul", torch.bmm, "bmm"}
_SAME = {"type", "to", "float", "double", "half", "bfloat16", "contiguous", "clone", torch.clone}


def _kind(node: fx.Node) -> Any:
    return node.target if node.op in ("call_function", "call_method") else None


def homogeneous_step(step: fx.GraphModule, states: int = 1) -> Optional[fx.GraphModule]:
    """The step's state path with every term free of the state dropped, ``(h, *rest) -> a ⊙ h``, when the
    new state (the step's first output) is elementwise affine in ``h`` (its first input); else None.
    With ``states`` k > 1 the first k inputs and outputs are the states, and each new state must be
    elementwise affine in its own old state alone (``h0' = a ⊙ h0 + b ⊙ h1`` is linear but mixes
    states: not elementwise); the module then returns the k homogeneous parts.

    Allowed on the state's path: ``*`` and ``/`` by values free of ``h``, ``+``/``-`` (of two such
    paths or one and a free value), negation, casts and copies; anything else (``h * h``, ``max``,
    ``matmul(w, h)``, a view that moves entries) is not elementwise affine."""
    got = _state_path(step, states)
    return got if isinstance(got, fx.GraphModule) else None


def not_elementwise(step: fx.GraphModule, states: int = 1) -> Optional[str]:
    """Why :func:`homogeneous_step` finds no homogeneous part (the op and its source line), or None."""
    got = _state_path(step, states)
    return None if isinstance(got, fx.GraphModule) else got


def matrix_width(step: fx.GraphModule, hom: fx.GraphModule) -> Optional[int]:
    """V when the homogeneous step ``hom`` of a (..., K, V) state is a matrix on dim -2 (a product
    ``W @ h`` on its path: :func:`_not_a_matrix` checked the rest), else None (elementwise)."""
    return int(_state_value(step).shape[-1]) if _has_product(hom.graph) else None


def _has_product(graph: fx.Graph) -> bool:
    """Whether a homogeneous part holds a product ``W @ h`` (the only matmul :func:`_homogeneous` emits)."""
    return any(n.op == "call_function" and n.target is operator.matmul for n in graph.nodes)


def _state_value(step: fx.GraphModule) -> Any:
    """The example value of the step's (first) state input."""
    return next(n for n in step.graph.nodes if n.op == "placeholder").meta.get("example_value")


def _state_path(step: fx.GraphModule, states: int) -> Any:
    """:func:`homogeneous_step`'s module, or the reason there is none (a string)."""
    graph, env = fx.Graph(), {}
    dep: Dict[fx.Node, fx.Node] = {}  # node on a state's path -> its homogeneous part in `graph`
    owner: Dict[fx.Node, int] = {}  # node on a state's path -> the state it reads
    outs = list(step.graph.output_node().args[0][:states])
    needed = set().union(*[_ancestors(o) for o in outs])  # the per-step outputs' own ops are not the state's
    for n in step.graph.nodes:
        if n.op == "placeholder":
            env[n] = graph.placeholder(n.name)
            if len(env) <= states:
                dep[n], owner[n] = env[n], len(env) - 1
            continue
        if n.op == "output" or n not in needed:
            continue
        env[n] = graph.node_copy(n, lambda a: env[a])
        reads = {owner[a] for a in n.all_input_nodes if a in dep}
        if len(reads) > 1:
            return f"{_op_name(n)} mixes two of its states{_line(n)}"
        if reads:
            hom = _homogeneous(graph, n, env, dep)
            if hom is None:
                return f"{_op_name(n)} reads it{_line(n)}"
            dep[n], owner[n] = hom, reads.pop()
    if any(o not in dep or owner[o] != i for i, o in enumerate(outs)):
        return "a new state does not read its own old value"
    graph.output(dep[outs[0]] if states == 1 else tuple(dep[o] for o in outs))
    graph.eliminate_dead_code()
    return _not_a_matrix(step, graph, states) or fx.GraphModule(torch.nn.Module(), graph)


def _not_a_matrix(step: fx.GraphModule, graph: fx.Graph, states: int) -> Optional[str]:
    """Why a homogeneous part with a product ``W @ h`` is not a matrix on dim -2 of one (..., K, V)
    state (a scaling that varies along V, several states, a state of one dim), or None."""
    if not _has_product(graph):
        return None
    state = _state_value(step)
    if states > 1 or not isinstance(state, Tensor) or state.dim() < 2:
        return "`matmul` reads it, and it is not one state of at least two dims"
    if any(n.meta.get("along_last") for n in graph.nodes):
        return "`matmul` reads it, and a scaling of it varies along its last dim"
    return None


def _op_name(n: fx.Node) -> str:
    target = n.target
    return f"`{getattr(target, '__name__', target)}`"


def _line(n: fx.Node) -> str:
    from ..passes.fx_utils import source_line  # compile-time helpers only (no cycle at import)

    where = source_line(n)
    return f" at {where}" if where != "<unknown source>" else ""


def _ancestors(node: fx.Node) -> set:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen


def _homogeneous(graph: fx.Graph, n: fx.Node, env: Dict[fx.Node, fx.Node],
                 dep: Dict[fx.Node, fx.Node]) -> Optional[fx.Node]:
    """``n``'s homogeneous part (it reads the state's path), or None when ``n`` is not affine there."""
    kind, args = _kind(n), n.args
    on = [isinstance(a, fx.Node) and a in dep for a in args]
    if n.kwargs and kind not in _SAME:
        return None
    if kind in _SAME and on[0] and not any(on[1:]):
        return graph.node_copy(n, lambda a: dep[a] if a in dep else env[a])
    if kind in _NEG and len(args) == 1:
        return graph.call_function(operator.neg, (dep[args[0]],))
    if len(args) != 2:
        return None
    if kind in _ADD | _SUB:
        return _summed(graph, kind, args, on, dep)
    x, y = args
    if kind in _MATMUL and on == [False, True]:  # W @ h: a matrix on dim -2 of the state
        return graph.call_function(operator.matmul, (env[x], dep[y])) if _matrices(n, x) else None
    if kind in _MUL and on.count(True) == 1:
        args = (dep[x], _value(env, y)) if on[0] else (_value(env, x), dep[y])
        return _scaled(graph, operator.mul, args, y if on[0] else x)
    if kind in _DIV and on == [True, False]:
        return _scaled(graph, operator.truediv, (dep[x], _value(env, y)), y)
    return None


def _summed(graph: fx.Graph, kind: Any, args: Tuple[Any, Any], on: List[bool],
            dep: Dict[fx.Node, fx.Node]) -> fx.Node:
    """The homogeneous part of ``x ± y``: of both paths, or of the one path (the free term dropped)."""
    x, y = args
    if on == [True, True]:
        return graph.call_function(operator.add if kind in _ADD else operator.sub, (dep[x], dep[y]))
    if on[0]:
        return dep[x]
    return dep[y] if kind in _ADD else graph.call_function(operator.neg, (dep[y],))


def _matrices(n: fx.Node, w: Any) -> bool:
    """Whether ``w @ h`` multiplies matrices (both at least 2-D), so it acts on dim -2 of h."""
    out, left = n.meta.get("example_value"), _example(w)
    return isinstance(out, Tensor) and isinstance(left, Tensor) and out.dim() >= 2 and left.dim() >= 2


def _scaled(graph: fx.Graph, op: Callable, args: Tuple[Any, Any], free: Any) -> fx.Node:
    """The homogeneous part of a scaling ``h * a`` / ``h / a``; marked ``along_last`` when ``a`` may vary
    along the state's last dim (fine for an elementwise step, not for a matrix on dim -2)."""
    node = graph.call_function(op, args)
    value = _example(free)
    node.meta["along_last"] = isinstance(free, fx.Node) and not (
        isinstance(value, Tensor) and (value.dim() == 0 or value.shape[-1] == 1))
    return node


def _example(a: Any) -> Any:
    return a.meta.get("example_value") if isinstance(a, fx.Node) else a


def _value(env: Dict[fx.Node, fx.Node], a: Any) -> Any:
    return env[a] if isinstance(a, fx.Node) else a


def loop_kernel(step: fx.GraphModule, reads: Sequence[StepRead], outputs: Sequence[StepOutput], others: int,
                where: str, states: Optional[Sequence[Tuple[int, ...]]] = None) -> LoopKernel:
    """The kernel of a folded loop, its transition read off the step (module docstring). ``states``:
    the shapes of the loop's states when it carries more than one (they are packed into one)."""
    k = 1 if states is None else len(states)
    got = _state_path(step, k)
    kernel = LoopKernel(step, got if isinstance(got, fx.GraphModule) else None, reads, outputs, others, where, states)
    kernel.serial_reason = None if isinstance(got, fx.GraphModule) else got
    kernel.width = matrix_width(step, got) if isinstance(got, fx.GraphModule) else None
    return kernel


def is_loop_kernel(target: Callable) -> bool:
    return isinstance(target, LoopKernel)


__all__ = ["LoopKernel", "StepOutput", "StepRead", "homogeneous_step", "is_loop_kernel", "loop_kernel",
           "matrix_width", "not_elementwise"]
