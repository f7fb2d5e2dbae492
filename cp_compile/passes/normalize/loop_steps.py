"""Find the loops Dynamo unrolled: T copies of one step, a state carried from each copy to the next.

A loop ``for t in range(T)`` over a tensor's dim leaves *families* of reads in the graph: the same
tensor indexed with the same index but for one entry, the positions 0..T-1 of one dim
(``x[:, 0]``, ``x[:, 1]``, ... ``x[:, T-1]``) or its chunks of C (``x[:, 0:C]``, ``x[:, C:2C]``, ...:
lightning attention's block loop), and, where the loop writes into a buffer, families of
``buf[:, t] = y`` writes. Each node then belongs to the step of the latest position it reads
(:func:`_steps`). Step 1's nodes are the template; every other step must be a copy of it
(:class:`_Unifier`): the same ops, reading the same family at its own position, the same values
from outside the loop, and, where step 1 reads a value of step 0 (the *carried* state), the previous
step's copy of that value; step 0 reads the state entering the loop there instead. What the loop
gives the rest of the graph must be per-step values collected in order (``torch.stack`` / ``torch.cat``
of a list of T, or the buffer written at every position) and the last step's state.

    found = find_loops(gm)          # [Loop(template, carried, init, families, outputs, ...)]

Nothing here changes the graph; :mod:`.fold_loops` replaces each loop by one kernel call.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
import torch.fx as fx

from ..fx_utils import fake_value, reads_only_shape

_ALL = slice(None, None, None)
_COLLECTORS = (torch.stack, torch.cat)


@dataclass(eq=False)
class Family:
    """Reads (or writes) ``base[index]`` at every position t of dim ``dim``: t -> the nodes."""

    base: fx.Node
    dim: int
    index: Tuple[Any, ...]  # the index with None at ``dim``
    write: bool
    chunk: Optional[int] = None  # tokens per step when the step reads ``x[:, t*C:(t+1)*C]``; None: ``x[:, t]``
    nodes: Dict[int, List[fx.Node]] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return len(self.nodes)


@dataclass
class Loop:
    """One unrolled loop, as :mod:`.fold_loops` needs it."""

    steps: int
    template: List[fx.Node]  # step 1's nodes, in graph order
    reads: Dict[fx.Node, Family]  # each template read -> its family
    carried: List[fx.Node]  # step 0's values step 1 reads that are the state
    derived: List[fx.Node]  # step 0's values step 1 reads that are ops of the state and outside values only
    roles: Dict[fx.Node, fx.Node]  # carried value -> the template node that is its next value
    init: Dict[fx.Node, fx.Node]  # carried value -> what step 0 read in its place (the initial state)
    outers: List[fx.Node]  # values from outside the loop the template reads
    collected: List[Tuple[fx.Node, Any]]  # (template value, its list collector node | its write Family)
    finals: Dict[fx.Node, fx.Node]  # carried value -> its last step's copy (read after the loop)
    claimed: Set[fx.Node]  # every node of every step (reads and writes included)


def find_loops(gm: fx.GraphModule) -> List[Loop]:
    """Every unrolled loop of ``gm`` that :mod:`.fold_loops` can replace (module docstring)."""
    found = []
    for group in _groups(_families(gm), {n: i for i, n in enumerate(gm.graph.nodes)}):
        loop = _loop(gm, group)
        if loop is not None:
            found.append(loop)
    return found


def _position(index: Any) -> Optional[Tuple[int, int, Tuple[Any, ...], Optional[int]]]:
    """(dim, t, index with None at dim, chunk) of ``x[index]`` whose first entry other than a full slice
    is a position ``t`` (chunk None) or a chunk ``t*C:(t+1)*C`` (chunk C); else None."""
    entries = index if isinstance(index, tuple) else (index,)
    if any(isinstance(x, fx.Node) for x in entries):
        return None
    for d, e in enumerate(entries):
        if isinstance(e, bool):
            return None
        rest = tuple(None if i == d else x for i, x in enumerate(entries))
        if isinstance(e, int):
            return (d, e, rest, None) if e >= 0 else None
        if isinstance(e, slice) and e != _ALL:
            c = _chunk(e)
            return None if c is None else (d, e.start // c, rest, c)
        if e != _ALL:
            return None
    return None


def _chunk(s: slice) -> Optional[int]:
    """C of a slice ``t*C:(t+1)*C`` (start and stop ints, no step), else None."""
    if not (type(s.start) is int and type(s.stop) is int and s.step in (None, 1)):
        return None
    c = s.stop - s.start
    return c if c > 0 and s.start >= 0 and s.start % c == 0 else None


def _families(gm: fx.GraphModule) -> List[Family]:
    """Every complete family of reads and writes (positions 0..T-1 of the base's dim, T >= 3)."""
    found: Dict[Any, Family] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in (operator.getitem, operator.setitem):
            continue
        base = n.args[0]
        if not isinstance(base, fx.Node) or not isinstance(fake_value(base), torch.Tensor) \
                or (n.users and all(reads_only_shape(u) for u in n.users)):
            continue  # `zeros_like(x[:, 0])` before the loop reads a shape, not a step's token
        pos = _position(n.args[1])
        if pos is None:
            continue
        d, t, index, chunk = pos
        write = n.target is operator.setitem
        fam = found.setdefault((base, d, repr(index), write, chunk), Family(base, d, index, write, chunk))
        fam.nodes.setdefault(t, []).append(n)
    complete = []
    for fam in found.values():
        size, steps = fake_value(fam.base).shape[fam.dim], len(fam.nodes)
        span = steps * (fam.chunk or 1)  # reads cover the whole dim; writes may fill its first entries only
        if isinstance(size, int) and steps >= 3 and set(fam.nodes) == set(range(steps)) \
                and (span == size or (fam.write and span < size)):
            complete.append(fam)
    return complete


def _groups(families: List[Family], order: Dict[fx.Node, int]) -> List[List[Family]]:
    """Families whose spans in graph order overlap, with the same T: one loop each."""
    spans = []
    for fam in families:
        at = [order[n] for ns in fam.nodes.values() for n in ns]
        spans.append((min(at), max(at), fam))
    spans.sort(key=lambda s: s[0])
    groups: List[List[Family]] = []
    end = -1
    for lo, hi, fam in spans:
        if groups and lo <= end and groups[-1][0].steps == fam.steps:
            groups[-1].append(fam)
            end = max(end, hi)
        else:
            groups.append([fam])
            end = hi
    return groups


def _steps(gm: fx.GraphModule, reads: Dict[fx.Node, Tuple[Family, int]],
           writes: Dict[fx.Node, Tuple[Family, int]]) -> Dict[fx.Node, int]:
    """The step of every node that depends on a read: the latest position among its inputs. A write
    belongs to the step of its position: ``states[:, t] = h`` before step t updates ``h`` stores the
    state entering step t (xLSTM's chunk states), which step t - 1 computed."""
    step: Dict[fx.Node, int] = {}
    for n in gm.graph.nodes:
        if n in reads or n in writes:
            step[n] = (reads.get(n) or writes[n])[1]
            continue
        got = [step[a] for a in n.all_input_nodes if a in step]
        if got:
            step[n] = max(got)
    return step


def _loop(gm: fx.GraphModule, group: List[Family]) -> Optional[Loop]:
    """The loop of one group of families, or None when its steps are not copies of one step."""
    reads = {n: (f, t) for f in group if not f.write for t, ns in f.nodes.items() for n in ns}
    writes = {n: (f, t) for f in group if f.write for t, ns in f.nodes.items() for n in ns}
    if not reads:  # (a step may read one position of some tensors and one chunk of others: fold_loops
        return None  # checks that each advances by as many tokens)
    step = _steps(gm, reads, writes)
    template = [n for n in gm.graph.nodes if step.get(n) == 1 and n not in reads and n.op != "output"
                and all(step.get(a, 0) in (0, 1) for a in n.all_input_nodes)]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    carried = sorted({a for n in template for a in n.all_input_nodes if step.get(a) == 0 and a not in reads},
                     key=order.__getitem__)
    if not template or not carried:
        return None
    u = _Unifier(group[0].steps, template, reads, writes, step)
    return u.solve(carried)


class _Unifier:
    """Matches every step against the template (module docstring); ``solve`` returns the Loop or None."""

    def __init__(self, steps: int, template: List[fx.Node], reads, writes, step) -> None:
        self.T, self.template, self.reads, self.writes, self.step = steps, template, reads, writes, step
        self.members = set(template)
        self.inst: List[Dict[fx.Node, fx.Node]] = [{} for _ in range(steps)]
        self.claimed: List[Set[fx.Node]] = [set() for _ in range(steps)]
        self.inst[1] = {n: n for n in template}
        self.claimed[1] = set(template)
        self.init: Dict[fx.Node, fx.Node] = {}
        self.roles: Dict[fx.Node, fx.Node] = {}

    # -- matching ---------------------------------------------------------------------------------
    def node(self, tn: fx.Node, cn: Any, t: int) -> bool:
        """Whether ``cn`` is step ``t``'s copy of template node ``tn`` (recording it and its inputs')."""
        if not isinstance(cn, fx.Node):
            return False
        got = self.inst[t].get(tn)
        if got is not None:
            return got is cn
        if cn in self.claimed[t] or cn.op != tn.op or cn.target != tn.target or len(cn.args) != len(tn.args) \
                or set(cn.kwargs) != set(tn.kwargs):
            return False
        self.inst[t][tn] = cn
        self.claimed[t].add(cn)
        if tn in self.writes:  # buf[index at t] = value: the same buffer, its own position, a copy of the value
            return self.writes.get(cn, (None, -1)) == (self.writes[tn][0], t) and cn.args[0] is tn.args[0] \
                and self.arg(tn.args[2], cn.args[2], t)
        return self.arg(tn.args, cn.args, t) and all(self.arg(tn.kwargs[k], cn.kwargs[k], t) for k in tn.kwargs)

    def arg(self, ta: Any, ca: Any, t: int) -> bool:
        if isinstance(ta, fx.Node):
            return self._node_arg(ta, ca, t)
        if isinstance(ta, (list, tuple)):
            return type(ta) is type(ca) and len(ta) == len(ca) and all(self.arg(a, b, t) for a, b in zip(ta, ca))
        if isinstance(ta, dict):
            return isinstance(ca, dict) and ta.keys() == ca.keys() and all(self.arg(ta[k], ca[k], t) for k in ta)
        if isinstance(ta, slice):
            return isinstance(ca, slice) and all(self.arg(getattr(ta, f), getattr(ca, f), t)
                                                 for f in ("start", "stop", "step"))
        return type(ta) is type(ca) and ta == ca

    def _node_arg(self, ta: fx.Node, ca: Any, t: int) -> bool:
        if ta in self.reads:  # the same family, as many positions from the step's own as in the template
            fam, at = self.reads[ta]
            return isinstance(ca, fx.Node) and ca in self.reads and self.reads[ca] == (fam, t + at - 1)
        if ta in self.members:
            return self.node(ta, ca, t)
        if self.step.get(ta) == 0:  # the carried state
            if t == 0:
                return isinstance(ca, fx.Node) and ca not in self.step and self.init.setdefault(ta, ca) is ca
            role = self.roles.get(ta)
            return role is not None and self.node(role, ca, t - 1)
        return isinstance(ca, fx.Node) and ca not in self.step and _same_outside(ta, ca)

    # -- solving ----------------------------------------------------------------------------------
    def _try(self, tn: fx.Node, cn: fx.Node, t: int) -> bool:
        saved = copy.copy(self.inst[t]), copy.copy(self.claimed[t]), dict(self.init)
        if self.node(tn, cn, t):
            return True
        self.inst[t], self.claimed[t], self.init = saved
        return False

    def _candidates(self, tn: fx.Node, t: int) -> List[fx.Node]:
        """Step ``t``'s nodes that could be the copy of ``tn``: users of its inputs' copies (a write: its
        family's writes at ``t``, which step 0 may make from the initial state alone)."""
        if tn in self.writes:
            return [n for n in self.writes[tn][0].nodes.get(t, []) if n not in self.claimed[t]]
        seen: List[fx.Node] = []
        for a in tn.all_input_nodes:
            if a in self.reads:
                fam, at = self.reads[a]
                mapped = fam.nodes.get(t + at - 1, [])
            elif a in self.members:
                mapped = [self.inst[t][a]] if a in self.inst[t] else []
            elif self.step.get(a) == 0:
                role = self.roles.get(a)
                mapped = [self.inst[t - 1][role]] if t > 0 and role in self.inst[t - 1] else []
            else:
                mapped = []
            seen += [u for m in mapped for u in m.users if u.target == tn.target and u not in self.claimed[t]]
        return list(dict.fromkeys(seen))

    def _complete(self, t: int) -> List[fx.Node]:
        """Match every template node at step ``t``; the ones with no copy there."""
        for tn in self.template:  # a node found by none of its inputs' users may be found as a later one's input
            if tn not in self.inst[t]:
                any(self._try(tn, c, t) for c in self._candidates(tn, t))
        return [tn for tn in self.template if tn not in self.inst[t]]

    def solve(self, carried: List[fx.Node]) -> Optional[Loop]:
        if self._complete(0):
            return None
        back = {c: tn for tn, c in self.inst[0].items()}
        if any(c not in back or c not in self.init for c in carried):
            return None
        self.roles = {c: back[c] for c in carried}
        for t in range(2, self.T):
            if self._complete(t) and t < self.T - 1:  # the last step may lack what nothing reads (removed)
                return None
        return self._loop(self._reroot(carried))

    def _reroot(self, carried: List[fx.Node]) -> List[fx.Node]:
        """Carried values whose next value the last step lacks, taken back to the state they are one
        op of. RG-LRU's ``h = a_t * h.to(device) + x_t`` carries ``h.to(device)``; the loop's last
        ``.to`` is never traced, and what the graph reads after the loop is the last ``h``. The state
        is then ``h`` (its next value the template's ``h``, its initial value what the first ``.to``
        read), and ``h.to(device)`` a derived value the step recomputes from it (:meth:`_split`)."""
        last = self.inst[self.T - 1]
        out = list(carried)
        for c in carried:
            role = self.roles[c]
            srcs = [a for a in role.all_input_nodes if a in self.members]
            inits = [a for a in self.init[c].all_input_nodes if a not in self.step]
            if role in last or len(srcs) != 1 or srcs[0] not in last or srcs[0] not in self.inst[0] \
                    or len(inits) != 1 or self.inst[0][srcs[0]] not in c.all_input_nodes:
                continue
            state = self.inst[0][srcs[0]]
            self.roles[state], self.init[state] = srcs[0], inits[0]
            out.append(state)
        order = {n: i for i, n in enumerate(self.template[0].graph.nodes)}
        return sorted(dict.fromkeys(out), key=order.__getitem__)

    def _loop(self, carried: List[fx.Node]) -> Optional[Loop]:
        """The Loop, once every use of a step's values outside the steps is a collector or a final state."""
        claimed = set().union(*self.claimed) | set(self.reads)
        if any(w not in claimed for w in self.writes):
            return None  # a write no step's copy of the template makes
        last = self.T - 1
        finals = {c: self.inst[last][r] for c, r in self.roles.items() if r in self.inst[last]}
        collected = self._collected(claimed)
        if collected is None:
            return None
        allowed = set(finals.values())
        for t in range(self.T):
            for cn in self.claimed[t] | {n for n, (_, s) in self.reads.items() if s == t}:
                for u in cn.users:
                    if u in claimed or u in self._collector_nodes(collected) or cn in allowed:
                        continue
                    if t + 1 < self.T and any(self.inst[t].get(r) is cn for r in self.roles.values()):
                        continue  # the state read by the next step
                    return None
        if not collected and not any(u not in claimed for f in finals.values() for u in f.users):
            return None  # the loop gives nothing to the rest of the graph
        state, derived = self._split(carried)
        outers = list(dict.fromkeys(self._outers() + [a for d in derived for a in d.all_input_nodes
                                                      if a not in self.step]))
        return Loop(self.T, self.template, {n: self.reads[n][0] for n in self.template_reads()}, state, derived,
                    self.roles, {c: self.init[c] for c in carried}, outers, collected, finals, claimed)

    def _split(self, carried: List[fx.Node]) -> Tuple[List[fx.Node], List[fx.Node]]:
        """(the state, the carried values that are one op of it and of outside values). ``h_next =
        decay * h`` read by the next step's ``h_next - x_t`` is Dynamo's order of ``decay * h - x_t``:
        it belongs to the next step, which recomputes it from the state; its initial value must be
        the same op of the initial state."""
        state: List[fx.Node] = []
        derived: List[fx.Node] = []
        for c in carried:  # in graph order: what a value is derived from comes first
            ins = c.all_input_nodes
            known = set(state) | set(derived)
            if known and any(a in known for a in ins) and all(a in known or a not in self.step for a in ins) \
                    and self._same_op_of_init(c):
                derived.append(c)
            else:
                state.append(c)
        return state, derived

    def _same_op_of_init(self, c: fx.Node) -> bool:
        first = self.init[c]

        def same(x: Any, y: Any) -> bool:
            if isinstance(x, fx.Node):
                if x in self.init:
                    return y is self.init[x]
                return isinstance(y, fx.Node) and _same_outside(x, y)
            if isinstance(x, (list, tuple)):
                return type(x) is type(y) and len(x) == len(y) and all(same(p, q) for p, q in zip(x, y))
            return type(x) is type(y) and x == y

        return first.op == c.op and first.target == c.target and same(c.args, first.args) \
            and c.kwargs.keys() == first.kwargs.keys() and all(same(c.kwargs[k], first.kwargs[k]) for k in c.kwargs)

    def template_reads(self) -> List[fx.Node]:
        return list(dict.fromkeys(a for n in self.template for a in n.all_input_nodes if a in self.reads))

    def _outers(self) -> List[fx.Node]:
        return list(dict.fromkeys(a for n in self.template for a in n.all_input_nodes
                                  if a not in self.step and not (n in self.writes and a is n.args[0])))

    def _collector_nodes(self, collected) -> Set[fx.Node]:
        return {c for _, c in collected if isinstance(c, fx.Node)}

    def _collected(self, claimed: Set[fx.Node]) -> Optional[List[Tuple[fx.Node, Any]]]:
        """(template value, collector) for every list collector and every write family of the loop."""
        out: List[Tuple[fx.Node, Any]] = []
        for tn in self.template:
            if tn in self.writes:
                out.append((tn.args[2], self.writes[tn][0]))
                continue
            for u in tn.users:
                if u in claimed or u.op != "call_function" or u.target not in _COLLECTORS:
                    continue
                items = u.args[0]
                if not isinstance(items, (list, tuple)) or len(items) != self.T or items[1] is not tn \
                        or any(self.inst[t].get(tn) is not items[t] for t in range(self.T)):
                    return None
                out.append((tn, u))
        return out


def _same_outside(a: fx.Node, b: fx.Node) -> bool:
    """Whether two values from outside the loop are the same value: one node, or one pure op of the same
    arguments written again at every step (``w.t()`` in the loop body)."""
    if a is b:
        return True
    if a.op != b.op or a.op not in ("call_function", "call_method") or a.target != b.target:
        return False
    if a.op == "call_function" and a.target in (operator.setitem,):
        return False

    def same(x: Any, y: Any) -> bool:
        if isinstance(x, fx.Node):
            return isinstance(y, fx.Node) and _same_outside(x, y)
        if isinstance(x, (list, tuple)):
            return type(x) is type(y) and len(x) == len(y) and all(same(p, q) for p, q in zip(x, y))
        return type(x) is type(y) and x == y

    return same(a.args, b.args) and a.kwargs.keys() == b.kwargs.keys() and all(
        same(a.kwargs[k], b.kwargs[k]) for k in a.kwargs)


__all__ = ["Family", "Loop", "find_loops"]
