"""What the zoo checks, measured on one rank of a CP group: :func:`measure`.

For a member, on every rank of an initialised process group: the model built twice from one
seed; one copy run eagerly on the whole sequence (the one-device reference), the other
compiled unchanged with ``torch.compile(model, backend=cp_compile.RingCP(inner="aot_eager"))``
and called with the same full inputs. Returned (all plain values, picklable):

* ``loss`` and ``grad``: relative errors of the loss and of the worst parameter gradient
  (``grad_name`` names it; a gradient below 1e-3 of the largest, such as a key bias's, which is
  zero in exact arithmetic, relative to that 1e-3 of the largest) against the reference;
* ``fallbacks``: the record's gather fallbacks (ops run on the gathered sequence, with lines);
* ``sharded``: the smallest sharded fraction of activation bytes over the graphs holding attention;
* ``attention`` / ``rings``: attention found and ring ops made, over all graphs;
* ``whole_attention``: on a second call, the forward's attention ops that are not the ring
  (an SDPA / flex / fused-MHA kernel at the top level of the compiled code runs on whatever
  every rank holds: the whole sequence);
* ``quadratic``: on that call, ops whose result spans the sequence twice (one dim the whole
  length S and another S or this rank's c): an S x S or c x S mask or score tensor;
* ``records`` / ``explained``: the runtime's per-graph records and the one ``cp-compile
  explain`` prints for this rank, to compare.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Tuple

import torch

from . import SEQ_LEN, Member, members

_ATTENTION_OPS = ("scaled_dot_product", "flex_attention", "_native_multi_head_attention",
                  "_transformer_encoder_layer_fwd")


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-30) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(floor)).item()


# A gradient that is zero in exact arithmetic (a key projection's bias: softmax is invariant
# to adding q.b_k to every score of a row) is fp32 rounding noise in both runs; it is compared
# against this fraction of the model's largest gradient norm instead of its own norm.
_VANISHING = 1e-3


def _loss(out: Any) -> torch.Tensor:
    return out.loss if hasattr(out, "loss") else out


def _call(model: torch.nn.Module, inputs: Any) -> torch.Tensor:
    return _loss(model(**inputs) if isinstance(inputs, dict) else model(*inputs))


def _second_call(compiled: torch.nn.Module, inputs: Any, world: int) -> Tuple[List[str], List[str]]:
    """Profile a forward of the compiled model (ATen ops with their input shapes): the attention
    kernels that see the whole sequence S (K/V of length S; the ring's block kernels see at
    most c = S/N keys), and the ops fed a tensor with one dim S and another S or c."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:  # grad mode as the first call: no recompile
        _call(compiled, inputs)
    events = [(e.name, [tuple(s) for s in e.input_shapes if s]) for e in prof.events()]
    rows = {shapes[0][2] for name, shapes in events if "ring_attention_fwd" in name and shapes}  # q (B, H, c, D)
    whole, quadratic = set(), set()
    for c in rows:
        s = c * world
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


def measure(name: str, seq_len: int = SEQ_LEN) -> Dict[str, Any]:
    """Run member ``name`` on this rank (see the module docstring); needs an initialised process group."""
    import torch.distributed as dist

    import cp_compile
    from cp_compile.tools.explain import inspect
    from cp_compile.tools.targets import example_inputs

    member: Member = members()[name]
    ref_model, args, kwargs = example_inputs(member.factory(seq_len=seq_len, seed=0))
    cp_model = copy.deepcopy(ref_model)
    inputs: Any = kwargs if kwargs else args
    world, rank = dist.get_world_size(), dist.get_rank()
    explained = inspect(ref_model, args, world_size=world, example_kwargs=kwargs, rank=rank).ctx.record
    torch._dynamo.reset()

    ref = _call(ref_model, inputs)
    ref.backward()
    backend = cp_compile.RingCP(inner="aot_eager")
    compiled = torch.compile(cp_model, backend=backend, fullgraph=member.fullgraph)
    out = _call(compiled, inputs)
    out.backward()
    n_graphs = len(backend.records)
    whole, quadratic = _second_call(compiled, inputs, world)  # cached graphs: no new compile
    scale = max((q.grad.double().norm().item() for q in ref_model.parameters() if q.grad is not None), default=0.0)
    grads = [(n, _rel(p.grad, q.grad, _VANISHING * scale))
             for (n, p), q in zip(cp_model.named_parameters(), ref_model.parameters()) if q.grad is not None]
    missing = [n for (n, p), q in zip(cp_model.named_parameters(), ref_model.parameters())
               if (p.grad is None) != (q.grad is None)]
    worst = max(grads, key=lambda g: g[1]) if grads else ("", 0.0)
    attn = [r for r in backend.records if r.attention]
    return {
        "loss": _rel(out.detach(), ref.detach()), "grad": worst[1], "grad_name": worst[0],
        "grads_missing": missing, "fallbacks": [f for r in backend.records for f in r.fallbacks],
        "sharded": min((r.sharded_fraction for r in attn), default=0.0),
        "attention": sum(len(r.attention) for r in backend.records), "rings": sum(r.rings for r in backend.records),
        "whole_attention": whole, "quadratic": quadratic,
        "recompiled": len(backend.records) != n_graphs, "records": list(backend.records), "explained": explained,
    }
