"""What the zoo checks, measured on one rank of a CP group: :func:`measure`.

For a member, on every rank of an initialised process group: the model built twice from one
seed; one copy run eagerly on the whole sequence (the one-device reference), the other
compiled unchanged with ``torch.compile(model, backend=cp_compile.RingCP(inner="aot_eager"))``
and called with the same full inputs. Returned (all plain values, picklable):

* ``loss`` and ``grad``: relative errors of the loss and of the worst parameter gradient
  (``grad_name`` names it) against the reference, by the rule of :mod:`_exact`: each gradient
  relative to its own norm, those the member names as zero in exact arithmetic
  (``Member.zero_grads``, such as a key bias nothing rotates) relative to a fraction of the
  whole gradient's norm;
* ``fallbacks``: the record's gather fallbacks (ops run on the gathered sequence, with lines);
* ``sharded``: the smallest sharded fraction of activation bytes over the graphs holding attention;
* ``attention`` / ``rings``: attention calls of the eager reference run (counted by their ATen
  ops, without cp_compile) and ring ops in the rewritten graphs; ``ring_mismatches``: what of
  "every attention became the ring" fails (:func:`_exact.ring_mismatches`), [] when it holds;
* ``whole_attention``: on a second call, the forward's attention ops that are not the ring
  (an SDPA / flex / fused-MHA kernel at the top level of the compiled code runs on whatever
  every rank holds: the whole sequence);
* ``quadratic``: on that call, ops whose result spans the sequence twice (one dim the whole
  length S and another S or this rank's c): an S x S or c x S mask or score tensor;
* ``strategies``: per ring op of the rewritten graphs, the strategy the attention got, e.g.
  ``"ulysses u=2"`` / ``"2d u=2 x r=2"`` / ``"ring"`` (its description: ``ring_call(node)``), and
  ``not_applied``: those that got the ring although ``strategy`` asked for Ulysses / 2-D, each with
  the record's why ("" never: a silent ring says so); ``a2a``: the ``seq_to_heads`` ops in the graphs;
* ``records`` / ``explained``: the runtime's per-graph records and the one ``cp-compile
  explain`` prints for this rank, to compare.

``measure(name, seq_len, **options)``: ``options`` go to ``RingCP`` and to the explain run
(``strategy="ulysses"``, ``ulysses_degree=2``, ...); none: the default (ring) run.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Tuple

import torch
from _exact import AttentionCount, grad_errors, rel, ring_mismatches

from . import SEQ_LEN, Member, members

_ATTENTION_OPS = ("scaled_dot_product", "flex_attention", "_native_multi_head_attention",
                  "_transformer_encoder_layer_fwd")


def _loss(out: Any) -> torch.Tensor:
    return out.loss if hasattr(out, "loss") else out


def _call(model: torch.nn.Module, inputs: Any) -> torch.Tensor:
    return _loss(model(**inputs) if isinstance(inputs, dict) else model(*inputs))


def _inside_ring(event: Any) -> bool:
    """Whether a profiler event ran inside a ring op (its block kernels: under Ulysses they see the
    u·c tokens of the Ulysses group, which the strategy means; under the ring at most c keys)."""
    parent = event.cpu_parent
    while parent is not None:
        if "ring_attention" in parent.name:
            return True
        parent = parent.cpu_parent
    return False


def _second_call(compiled: torch.nn.Module, inputs: Any, world: int, ring: int) -> Tuple[List[str], List[str]]:
    """Profile a forward of the compiled model (ATen ops with their input shapes): the attention
    kernels outside the ring ops that see the whole sequence S (K/V of length S; the ring's
    block kernels see at most S/ring keys), and the ops outside the ring ops fed a tensor with
    one dim S and another S or c = S/N. ``ring``: the ring's size (N, or N/u under Ulysses)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:  # grad mode as the first call: no recompile
        _call(compiled, inputs)
    events = [(e.name, [tuple(s) for s in e.input_shapes if s]) for e in prof.events()]
    rows = {shapes[0][2] for name, shapes in events if "ring_attention_fwd" in name and shapes}  # q (B, H, S/ring, D)
    events = [ev for ev, e in zip(events, prof.events()) if not _inside_ring(e)]
    whole, quadratic = set(), set()
    for r in rows:
        s = r * ring
        c = s // world
        for name, shapes in events:
            if any(a in name for a in _ATTENTION_OPS) and len(shapes) > 1 and len(shapes[1]) > 2 and shapes[1][2] == s:
                whole.add(f"{name} k {shapes[1]}")
            for shape in shapes:
                dims = list(shape)
                if s in dims:
                    dims.remove(s)
                    if s in dims or c in dims:
                        quadratic.add(f"{name} <- {shape}")
    return sorted(whole), sorted(quadratic)


def _truth(member: Member, seq_len: int) -> Dict[str, torch.Tensor]:
    """The member's parameter gradients in float64, one process (for :func:`_exact.grad_errors`:
    gradients that are zero in exact arithmetic hold only rounding noise in float32)."""
    from cp_compile.tools.targets import example_inputs

    model, args, kwargs = example_inputs(member.factory(seq_len=seq_len, seed=0))
    model = model.double()
    cast = lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
    _call(model, {k: cast(v) for k, v in kwargs.items()} if kwargs else tuple(cast(a) for a in args)).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def strategies(backend: Any, strategy: str) -> Tuple[List[str], List[str]]:
    """(what each ring op of ``backend``'s rewritten graphs got, e.g. ``"ulysses u=2"``; the ring ops
    that got the ring under a ``strategy`` other than ring / auto, each with its record's why)."""
    from cp_compile.passes.ring_call import ring_call

    fwd = torch.ops.cp_compile.ring_attention_fwd.default
    got, not_applied = [], []
    for gm in backend.graphs:
        for node in (n for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes):
            if node.target is not fwd:
                continue
            call = ring_call(node)
            u, world = call.ulysses, backend.records[0].world_size
            got.append({"ring": "ring", "ulysses": f"ulysses u={u}"}.get(call.strategy, f"2d u={u} x r={world // u}"))
            if strategy in ("ulysses", "2d") and call.strategy == "ring":
                not_applied.append(f"{node.name}: {call.why or 'SILENT: no reason recorded'}")
    return got, not_applied


def _ring_size(got: List[str], world: int) -> int:
    """The ring's size under the strategies ``got`` (one for every ring op of a member)."""
    sizes = {world // int(g.split("u=")[1].split()[0]) if "u=" in g else world for g in got}
    return sizes.pop() if len(sizes) == 1 else world


def measure(name: str, seq_len: int = SEQ_LEN, **options: Any) -> Dict[str, Any]:
    """Run member ``name`` on this rank (see the module docstring); needs an initialised process group.
    ``options``: ring_cp backend options (``strategy=...``, ``ulysses_degree=...``) for the run and explain."""
    import torch.distributed as dist

    import cp_compile
    from cp_compile.tools.explain import explain_model
    from cp_compile.tools.targets import example_inputs

    member: Member = members()[name]
    ref_model, args, kwargs = example_inputs(member.factory(seq_len=seq_len, seed=0))
    cp_model = copy.deepcopy(ref_model)
    inputs: Any = kwargs if kwargs else args
    world, rank = dist.get_world_size(), dist.get_rank()
    explained = explain_model(ref_model, args, world_size=world, example_kwargs=kwargs, rank=rank,
                              **options).ctx.record
    torch._dynamo.reset()

    with AttentionCount() as count:
        ref = _call(ref_model, inputs)
    ref.backward()
    backend = cp_compile.RingCP(inner="aot_eager", **options)
    compiled = torch.compile(cp_model, backend=backend, fullgraph=member.fullgraph)
    out = _call(compiled, inputs)
    out.backward()
    n_graphs = len(backend.records)
    got, not_applied = strategies(backend, options.get("strategy", "ring"))
    whole, quadratic = _second_call(compiled, inputs, world, _ring_size(got, world))  # cached graphs: no new compile
    grads = grad_errors(cp_model, ref_model, member.zero_grads, _truth(member, seq_len) if member.zero_grads else None)
    missing = [n for n, err in grads.items() if err == float("inf")]  # a gradient on one side only
    worst = max(((n, e) for n, e in grads.items() if n not in missing), key=lambda g: g[1], default=("", 0.0))
    attn = [r for r in backend.records if r.attention]
    fwd = torch.ops.cp_compile.ring_attention_fwd.default
    return {
        "loss": rel(out.detach(), ref.detach()), "grad": worst[1], "grad_name": worst[0],
        "grads_missing": missing, "fallbacks": [f for r in backend.records for f in r.fallbacks],
        "sharded": min((r.sharded_fraction for r in attn), default=0.0),
        "attention": count.calls, "rings": sum(n.target is fwd for gm in backend.graphs for n in gm.graph.nodes),
        "ring_mismatches": ring_mismatches(backend, count.calls),
        "whole_attention": whole, "quadratic": quadratic,
        "strategies": got, "not_applied": not_applied,
        "a2a": sum(n.target is torch.ops.cp_compile.seq_to_heads.default for gm in backend.graphs
                   for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes),
        "recompiled": len(backend.records) != n_graphs, "records": list(backend.records), "explained": explained,
    }
