"""Each recurrence loop Dynamo unrolled becomes one kernel call the rewrite can run on each rank's runs.

Before (``for t in range(S): h = a[:, t] * h + x[:, t]; out[:, t] = h``, unrolled)::

    h = zeros(B, D); out = zeros_like(x)
    a_0 = a[:, 0]; h_1 = a_0 * h; x_0 = x[:, 0]; h_2 = h_1 + x_0; out[:, 0] = h_2
    a_1 = a[:, 1]; h_3 = a_1 * h_2; ...                                    # S copies of the step
    ... uses of out (and of the last h)

After::

    h = zeros(B, D)
    loop = LoopKernel(step)(x0=a, x1=x, initial_state=h)   # the step once, as an FX module
    out_ = loop[0]                                          # (B, S, D): the writes, a stack along dim 1
    h_ = loop[1]                                            # the last state
    ... uses of out_ (and of h_)

:mod:`.loop_steps` finds the loops; the kernel (:mod:`cp_compile.recurrence.loops`) carries its own
state-passing contract, so the rule for recurrent kernels splits it by runs (elementwise-affine steps
in parallel from O(state) summaries, any other step serially, warned). A loop that carries several
tensors gets them packed into the contract's one state (``cat`` of the flattened initial states before
the call, each last state a slice of the kernel's, viewed back). A loop is folded only when its states
are tensors of one dtype and fixed shapes, it reads its per-token tensors at its own position, and
the kernel reproduces the shapes and dtypes of every value it replaces on fake tensors; any other
loop is left as traced (its reads then gather, warned by the rewrite).
"""

from __future__ import annotations

import operator
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from ...recurrence.loops import LoopKernel, StepOutput, StepRead, loop_kernel
from ...recurrence.spec import RecurrenceSpec
from ..context import RewriteContext, fake_value, log, source_line
from .chunk_views import tokens_per_entry
from .loop_steps import Family, Loop, find_loops


def fold_recurrence_loops(gm: fx.GraphModule, ctx: RewriteContext) -> int:
    """Replace every foldable unrolled loop by one :class:`LoopKernel` call; the count."""
    count = 0
    for loop in find_loops(gm):
        why = _unfoldable(loop)
        tokens = _tokens_per_step(loop, ctx) if why is None else None
        if why is None and tokens is None:
            why = "its reads advance by different numbers of tokens per step"
        why = why or _not_the_sequence(loop, ctx, tokens)
        where = source_line(loop.template[0])
        if why is not None:
            log.debug("cp_compile: the loop at %s is left as traced: %s", where, why)
            continue
        kernel, outputs = _kernel(loop, where, tokens)
        if not _reproduces(kernel, loop, outputs):
            log.debug("cp_compile: the loop at %s is left as traced (its kernel did not check)", where)
            continue
        _replace(gm, loop, kernel, outputs)
        log.info("cp_compile: the loop at %s (%d steps, %s state) folded into one kernel", where, loop.steps,
                 kernel.transition)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _unfoldable(loop: Loop) -> Optional[str]:
    bad = [n for n in loop.reads if _at(loop, n) != 1]
    if bad:
        return f"a step reads {bad[0].name} at another position than its own"
    inits = [fake_value(loop.init[c]) for c in loop.carried]
    if not all(isinstance(v, torch.Tensor) for v in inits):
        return "an initial state is not a tensor"
    if len(inits) > 1 and (len({v.dtype for v in inits}) > 1
                           or not all(isinstance(s, int) for v in inits for s in v.shape)):
        return "its states differ in dtype or have symbolic shapes (several states are packed into one)"
    for _, c in loop.collected:
        if isinstance(c, Family) and _buffer_reads(loop, c) is None:
            return (f"after the loop, {c.base.name} is read across the {_span(c)} entries the loop wrote along dim "
                    f"{c.dim} (only those entries, or only the others, can be told apart)")
    return None


def _span(fam: Family) -> int:
    """How many entries of its buffer's dim a write family fills (from 0): all, or a prefix."""
    return fam.steps * (fam.chunk or 1)


def _buffer_reads(loop: Loop, fam: Family) -> Optional[Dict[fx.Node, bool]]:
    """The buffer's uses after its last write -> whether each reads the loop's entries (``states[:, :T]``,
    exactly them) rather than only the entries after them (``states[:, T]``, written after the loop:
    xLSTM's last chunk state); None when one reads or writes across the two, or is no indexing."""
    order = {n: i for i, n in enumerate(fam.base.graph.nodes)}
    end = max(order[n] for ns in fam.nodes.values() for n in ns)
    size, span, out = fake_value(fam.base).shape[fam.dim], _span(fam), {}
    for u in fam.base.users:
        if u in loop.claimed or order[u] < end:
            continue
        if span == size:
            out[u] = True
            continue
        picked = _picked(u, fam.dim, size)
        if picked is None or (picked != range(span) and (not picked or picked[0] < span)):
            return None
        out[u] = picked == range(span)
    return out


def _picked(node: fx.Node, dim: int, size: int) -> Optional[range]:
    """The entries of dim ``dim`` a getitem/setitem ``x[:, ..., e, ...]`` of its first argument touches
    (every entry before ``e`` a full slice), else None."""
    if node.target not in (operator.getitem, operator.setitem) or len(node.args) < 2:
        return None
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    if len(index) <= dim or any(e != slice(None) for e in index[:dim]):
        return None
    e = index[dim]
    if type(e) is int:
        return range(e % size, e % size + 1) if -size <= e < size else None
    if isinstance(e, slice) and all(v is None or type(v) is int for v in (e.start, e.stop, e.step)):
        return range(size)[e]
    return None


def _not_the_sequence(loop: Loop, ctx: RewriteContext, tokens: int) -> Optional[str]:
    """Why a loop is not a recurrence over the attention's sequence (a loop over heads or layers, left to
    the rules node by node), or None. With no attention in the graph its length is the sequence's."""
    held = [n.name for n in ctx.attention if n in loop.claimed]
    if held:
        return f"its steps hold attention ({held[0]}), each split by its own rule"
    length = loop.steps * tokens
    if ctx.attention and length != ctx.seq_len:
        return f"it runs along a dim of {length}, not the attention's sequence of {ctx.seq_len}"
    return None


def _tokens_per_step(loop: Loop, ctx: RewriteContext) -> Optional[int]:
    """How many tokens of the sequence each step reads, the same for every per-token tensor (None when
    they differ): one position of a tensor along the sequence (1), a chunk of C of them (C), or one
    entry of the sequence viewed in chunks of C (``q = x.view(B, S // C, C, D)``; ``q[:, i]``: C). A
    step may read one of each kind (xLSTM reads the keys' chunk ``k[:, :, i*C:(i+1)*C]`` and the
    chunk's gate total ``g[:, :, i]``). With no attention in the graph, the chunk views alone say so."""
    found = set()
    for fam in _families(loop):
        n = fake_value(fam.base).shape[fam.dim]
        entry = 1
        if not (ctx.attention and n == ctx.seq_len):
            c = tokens_per_entry(fam.base, n)
            entry = c if c > 1 and (not ctx.attention or n * c == ctx.seq_len) else 1
        found.add(entry * (fam.chunk or 1))
    return found.pop() if len(found) == 1 else None


def _shapes(loop: Loop) -> Optional[List[Tuple[int, ...]]]:
    """The states' shapes when the loop carries several (packed into one), else None."""
    if len(loop.carried) < 2:
        return None
    return [tuple(fake_value(loop.init[c]).shape) for c in loop.carried]


def _at(loop: Loop, read: fx.Node) -> int:
    fam = loop.reads[read]
    return next(t for t, ns in fam.nodes.items() if read in ns)


def _families(loop: Loop) -> List[Family]:
    return list(dict.fromkeys(loop.reads.values()))


def _kernel(loop: Loop, where: str, tokens: int) -> Tuple[LoopKernel, List[StepOutput]]:
    """The loop's kernel (its step as an FX module, its contract attached; ``tokens`` per step) and its
    outputs."""
    graph, env = fx.Graph(), {}
    for i, c in enumerate(loop.carried):
        env[c] = _placeholder(graph, f"state{i}" if len(loop.carried) > 1 else "state", loop.init[c])
    fams = _families(loop)
    first = {fam: read for read, fam in reversed(list(loop.reads.items()))}  # a read of each family (its value)
    slots = {f: _placeholder(graph, f"x{i}", first[f]) for i, f in enumerate(fams)}
    for read, fam in loop.reads.items():
        env[read] = slots[fam]
    for i, o in enumerate(loop.outers):
        env[o] = _placeholder(graph, f"c{i}", o)
    for d in loop.derived:  # the next step's first ops, which Dynamo's order put in the previous step
        env[d] = graph.node_copy(d, lambda a: env[a])
    writes = {n for n in loop.template if n.target is operator.setitem}
    for n in loop.template:
        if n not in writes:
            env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output((*[env[loop.roles[c]] for c in loop.carried], *[env[v] for v, _ in loop.collected]))
    graph.eliminate_dead_code()  # a carried value's next copy that the state's re-rooting made dead
    step = fx.GraphModule(torch.nn.Module(), graph)
    outputs = [_output(c) for _, c in loop.collected]
    kernel = loop_kernel(step, [StepRead(f.dim, f.index, f.chunk) for f in fams], outputs, len(loop.outers),
                         where, _shapes(loop))
    kernel.tokens_per_step = tokens
    kernel.recurrence_spec = _spec(kernel, fams, loop, outputs)
    return kernel, outputs


def _placeholder(graph: fx.Graph, name: str, like: Any) -> fx.Node:
    """A step input with the example value of the traced node it stands for (the step's analysis reads
    shapes: :func:`cp_compile.recurrence.loops.homogeneous_step`)."""
    node = graph.placeholder(name)
    if isinstance(like, fx.Node) and "example_value" in like.meta:
        node.meta["example_value"] = like.meta["example_value"]
    return node


def _output(collector: Any) -> StepOutput:
    if isinstance(collector, Family):
        return StepOutput("setitem", collector.dim, fake_value(collector.base).dtype, collector.chunk)
    dim = collector.kwargs.get("dim", collector.args[1] if len(collector.args) > 1 else 0)
    return StepOutput("stack" if collector.target is torch.stack else "cat", dim)


def _spec(kernel: LoopKernel, fams: List[Family], loop: Loop, outputs: List[StepOutput]) -> RecurrenceSpec:
    dims = {}
    for i, ((_, c), o) in enumerate(zip(loop.collected, outputs)):
        rank = fake_value(c.base if isinstance(c, Family) else c).dim()
        dims[i] = o.dim % rank
    parallel = kernel.transition != "serial"
    return RecurrenceSpec(target=kernel, seq_args={f"x{i}": f.dim for i, f in enumerate(fams)}, outputs=dims,
                          initial_state="initial_state", final_state=len(outputs), transition=kernel.transition,
                          homogeneous="homogeneous" if parallel else None, chunk=kernel.tokens_per_step)


def _kwargs(loop: Loop, initial_state: Any) -> Dict[str, Any]:
    kw: Dict[str, Any] = {f"x{i}": f.base for i, f in enumerate(_families(loop))}
    kw.update({f"c{i}": o for i, o in enumerate(loop.outers)})
    kw["initial_state"] = initial_state
    return kw


def _replaced(loop: Loop) -> List[Optional[fx.Node]]:
    """The nodes whose values the kernel's results replace: each collector (a write family's buffer),
    then the last state of each carried value (None when nothing reads it)."""
    out: List[Optional[fx.Node]] = [c.base if isinstance(c, Family) else c for _, c in loop.collected]
    return out + [loop.finals.get(c) for c in loop.carried]


def _reproduces(kernel: LoopKernel, loop: Loop, outputs: List[StepOutput]) -> bool:
    """Whether the kernel gives every replaced value its traced shape and dtype (fake tensors)."""
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            init = kernel.pack(*[_fresh(fake_value(loop.init[c])) for c in loop.carried])
            kw = {k: _fresh(fake_value(v)) for k, v in _kwargs(loop, None).items() if k != "initial_state"}
            got = kernel(initial_state=init, **kw)
            got = (*got[:-1], *kernel.unpack(got[-1]))
    except Exception as e:  # noqa: BLE001  (any failure: a kernel we cannot run; the loop stays)
        log.debug("cp_compile: the folded loop failed on fake tensors: %s", e)
        return False
    collectors = [c for _, c in loop.collected] + [None] * len(loop.carried)
    for value, node, c in zip(got, _replaced(loop), collectors):
        want = fake_value(node) if node is not None else None
        shape = None if want is None else list(want.shape)
        if isinstance(c, Family):  # (the entries the loop wrote)
            shape[c.dim] = _span(c)
        if want is not None and (list(value.shape) != shape or value.dtype != want.dtype):
            return False
    return True


def _fresh(v: Any) -> Any:
    if not isinstance(v, torch.Tensor):
        return v
    return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device=v.device)


def _replace(gm: fx.GraphModule, loop: Loop, kernel: LoopKernel, outputs: List[StepOutput]) -> None:
    """One kernel call after its last input; the loop's results read from it; the steps erased."""
    g = gm.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    meta = {k: v for k, v in loop.template[0].meta.items() if k != "example_value"}
    inputs = [v for v in _kwargs(loop, None).values() if isinstance(v, fx.Node)] + [loop.init[c] for c in loop.carried]
    prev = max(inputs, key=order.__getitem__)
    init, prev = _packed_init(g, loop, kernel, prev, meta)
    with g.inserting_after(prev):
        call = g.call_function(kernel, (), _kwargs(loop, init))
    call.meta = dict(meta)
    items: List[Optional[fx.Node]] = []
    prev = call
    for i, (node, (_, c)) in enumerate(zip(_replaced(loop), loop.collected)):
        value = fake_value(node)
        if isinstance(c, Family) and _span(c) < value.shape[c.dim]:  # the entries the loop wrote
            value = value.narrow(c.dim, 0, _span(c))
        prev = _node_after(g, prev, operator.getitem, (call, i), meta, value)
        items.append(prev)
    finals = [fake_value(loop.roles[c]) if loop.finals.get(c) is None else fake_value(loop.finals[c])
              for c in loop.carried]
    packed = kernel.pack(*finals) if len(finals) > 1 else finals[0]
    prev = flat = _node_after(g, prev, operator.getitem, (call, len(loop.collected)), meta, packed)
    call.meta["example_value"] = (*[it.meta["example_value"] for it in items], packed)
    offset = 0
    for c, value in zip(loop.carried, finals):
        final = loop.finals.get(c)
        if len(finals) > 1 and (final is None or all(u in loop.claimed for u in final.users)):  # not read after
            items.append(None)
        elif len(finals) > 1:
            part = (slice(offset, offset + value.numel()),)
            prev = _node_after(g, prev, operator.getitem, (flat, part), meta, packed[part[0]])
            prev = _node_after(g, prev, "view", (prev, tuple(value.shape)), meta, value)
            items.append(prev)
        else:
            items.append(prev)
        offset += value.numel()
    _reroute(g, loop, items, order)
    _erase(g, loop)


def _packed_init(g: fx.Graph, loop: Loop, kernel: LoopKernel, prev: fx.Node,
                 meta: Dict[str, Any]) -> Tuple[fx.Node, fx.Node]:
    """The contract's initial state: the one carried value's, or ``cat`` of the flattened initial
    states (inserted after ``prev``); and the last node inserted."""
    inits = [loop.init[c] for c in loop.carried]
    if len(inits) == 1:
        return inits[0], prev
    flat = []
    for i in inits:
        v = fake_value(i)
        prev = _node_after(g, prev, "reshape", (i, -1), meta, v.reshape(-1))
        flat.append(prev)
    value = kernel.pack(*[fake_value(i) for i in inits])
    prev = _node_after(g, prev, torch.cat, (flat,), meta, value)
    return prev, prev


def _node_after(g: fx.Graph, prev: fx.Node, target: Any, args: Tuple[Any, ...], meta: Dict[str, Any],
                value: Any) -> fx.Node:
    with g.inserting_after(prev):
        node = g.call_method(target, args) if isinstance(target, str) else g.call_function(target, args)
    node.meta = {**meta, "example_value": value}
    return node


def _reroute(g: fx.Graph, loop: Loop, items: List[Optional[fx.Node]], order: Dict[fx.Node, int]) -> None:
    """Every read of a loop result after the loop goes to the kernel's item instead (``items``: the
    collected values, then each carried value's last state)."""
    claimed = loop.claimed
    for (_, c), item in zip(loop.collected, items):
        if isinstance(c, Family):  # the buffer, read after its last write: the loop's entries from the item
            for u, written in _buffer_reads(loop, c).items():
                if written and _span(c) < fake_value(c.base).shape[c.dim]:  # states[:, :T] -> item[:, :]
                    index = tuple(slice(None) if d == c.dim else e for d, e in enumerate(u.args[1]))
                    u.args = (item, index, *u.args[2:])
                elif written:
                    u.replace_input_with(c.base, item)
        else:
            c.replace_all_uses_with(item)
    for c, item in zip(loop.carried, items[len(loop.collected):]):
        final = loop.finals.get(c)
        if final is not None:
            final.replace_all_uses_with(item, delete_user_cb=lambda u: u not in claimed)


def _erase(g: fx.Graph, loop: Loop) -> None:
    """The steps, their reads and writes, the collectors, and what only they read (a written buffer)."""
    dead = set(loop.claimed) | {c for _, c in loop.collected if isinstance(c, fx.Node)}
    for node in reversed(list(g.nodes)):
        if node in dead and not node.users:
            inputs = node.all_input_nodes
            g.erase_node(node)
            dead.update(a for a in inputs if a.op in ("call_function", "call_method") and not a.users
                        and a.target is not operator.setitem)


__all__ = ["fold_recurrence_loops"]
