"""Overlap scheduling (cp_compile.backend.schedule): every gradient all-reduce is issued as soon
as its gradient exists and waited as late as possible.

* A hand-built backward-shaped FX graph (one process, never runs a collective): the
  exact node order after ``schedule_collectives``, a valid graph, and the same results
  with stand-in collectives.
* 2 ranks, the example Llama: ring_cp's rewrite, then aot_eager with the pass in the
  forward and backward compilers. In the scheduled backward, lm_head's all-reduce (its
  gradient is the first to exist) is issued before every other parameter's gradient is
  computed and waited after all of them. Loss and gradients still equal the
  single-process run.
* 2 ranks, Inductor with ``inductor_overlap_config()`` as ``config_patches`` (how the
  backend passes it): same numbers, and the generated backward code issues lm_head's
  all-reduce right after its matmul and waits on it after every other matmul. A second
  compile from the warm cache hits the AOTAutograd cache and stays exact (one cold
  Inductor compile serves both checks: it is the suite's costliest step).
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import uuid
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx

import models

import cp_compile
from checks import AttentionCount, explain_record, loss_and_grad_errors, ring_mismatches
from cp_compile.backend.schedule import schedule_collectives

TOL = 1e-5
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
c10d = torch.ops._c10d_functional
aten = torch.ops.aten


def _violations(gm: fx.GraphModule) -> list:
    """The schedule's definition, checked independently of the pass: each all_reduce sits
    right after the latest of (its inputs, the last placeholder, the previous collective);
    only waits stand between a wait and the first reader of its result."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    earliest = max(pos[n] for n in nodes if n.op == "placeholder") + 1
    bad = []
    for n in nodes:
        if n.target is c10d.all_reduce.default:
            want = max([earliest] + [pos[a] + 1 for a in n.all_input_nodes])
            if pos[n] != want:
                bad.append(f"{n.name} at {pos[n]}, its inputs allow {want}")
            earliest = pos[n] + 1
        if n.target is c10d.wait_tensor.default:
            first = min(pos[u] for u in n.users)
            if any(m.target is not c10d.wait_tensor.default for m in nodes[pos[n] + 1:first]):
                bad.append(f"{n.name} at {pos[n]}, first read at {first}")
    return bad


# ---------------------------------------------------------------- single process, hand-built graph


def _backward_like() -> fx.GraphModule:
    """The all-reduces sit where autograd traced them: at the end, each waited at once."""
    g = fx.Graph()
    x, w1, w2, dy = (g.placeholder(name) for name in ("x", "w1", "w2", "dy"))

    def op(name, target, *args):
        return g.create_node("call_function", target, args, name=name)

    ar0 = op("ar0", c10d.all_reduce.default, dy, "sum", "fake_group")  # e.g. the loss-scale all-reduce
    wt0 = op("wt0", c10d.wait_tensor.default, ar0)
    gw2 = op("gw2", aten.mm.default, x, dy)  # last layer's weight gradient: exists first
    dx = op("dx", aten.mm.default, dy, w2)
    h = op("h", aten.relu.default, dx)
    hs = op("hs", aten.mul.Tensor, h, wt0)  # first reader of wt0
    gw1 = op("gw1", aten.mm.default, hs, x)  # first layer's weight gradient: exists last
    dx1 = op("dx1", aten.mm.default, hs, w1)
    wt2 = op("wt2", c10d.wait_tensor.default, op("ar2", c10d.all_reduce.default, gw2, "sum", "fake_group"))
    wt1 = op("wt1", c10d.wait_tensor.default, op("ar1", c10d.all_reduce.default, gw1, "sum", "fake_group"))
    g.output((wt1, wt2, dx1))
    return fx.GraphModule(torch.nn.Module(), g)


def _fake_all_reduce(x, op, group):
    return x * 2  # the sum over two ranks holding the same tensor


def _standin(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy that runs in one process: collectives replaced by local stand-ins."""
    gm = copy.deepcopy(gm)
    for n in gm.graph.nodes:
        if n.target is c10d.all_reduce.default:
            n.target = _fake_all_reduce
        elif n.target is c10d.wait_tensor.default:
            n.target = torch.clone
    gm.recompile()
    return gm


def test_issues_rise_to_their_inputs_and_waits_sink_to_their_readers():
    gm = _backward_like()
    original = copy.deepcopy(gm)
    assert _violations(gm)  # as traced: issued late, waited at once
    assert schedule_collectives(gm) is gm
    gm.graph.lint()
    assert [n.name for n in gm.graph.nodes] == [
        "x", "w1", "w2", "dy",
        "ar0",  # its input is a placeholder: issued before any compute
        "gw2", "ar2",  # issued as soon as the gradient exists ...
        "dx", "h", "wt0", "hs",  # wt0 waits behind independent compute, up to its reader
        "gw1", "ar1",
        "dx1", "wt2", "wt1",  # ... and waited only by the output, after all compute
        "output",
    ]
    assert _violations(gm) == []
    inputs = [torch.randn(4, 4) for _ in range(4)]
    for want, got in zip(_standin(original)(*inputs), _standin(gm)(*inputs)):
        assert torch.equal(want, got)


def test_collectives_keep_their_order_and_nothing_crosses_an_in_place_op():
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    late = g.create_node("call_function", aten.relu.default, (x,), name="late")
    first = g.create_node("call_function", c10d.all_reduce.default, (late, "sum", "g"), name="first")
    w_first = g.create_node("call_function", c10d.wait_tensor.default, (first,), name="w_first")
    second = g.create_node("call_function", c10d.all_reduce.default, (y, "sum", "g"), name="second")
    w_second = g.create_node("call_function", c10d.wait_tensor.default, (second,), name="w_second")
    z = g.create_node("call_function", aten.mul.Tensor, (x, 2), name="z")
    acc = g.create_node("call_function", aten.add_.Tensor, (z, 1), name="acc")  # in place
    third = g.create_node("call_function", c10d.all_reduce.default, (y, "sum", "g"), name="third")
    w_third = g.create_node("call_function", c10d.wait_tensor.default, (third,), name="w_third")
    g.output((w_first, w_second, w_third, acc))
    gm = schedule_collectives(fx.GraphModule(torch.nn.Module(), g))
    # "second"'s input is ready first, but it stays behind "first" (same collective order on
    # every rank); "third" may not cross the in-place add_; the waits sink to the output.
    assert [n.name for n in gm.graph.nodes] == [
        "x", "y", "late", "first", "second", "z", "acc", "third", "w_first", "w_second", "w_third", "output"]


def test_a_graph_without_collectives_is_left_alone():
    g = fx.Graph()
    g.output(g.create_node("call_function", aten.relu.default, (g.placeholder("x"),)))
    gm = fx.GraphModule(torch.nn.Module(), g)
    code = gm.code
    assert schedule_collectives(gm) is gm and gm.code == code


# ---------------------------------------------------------------- 2 ranks, the example Llama


def _ring_rewrite(gm, example_inputs, seen: dict) -> fx.GraphModule:
    """ring_cp's graph rewrite alone (the inner compile happens in the caller)."""
    backend = cp_compile.RingCP(inner="eager")
    backend(gm, example_inputs)
    (rewritten,) = backend.graphs
    seen["backend"], seen["records"] = backend, backend.records
    seen["inputs"] = [n.name for n in rewritten.graph.nodes if n.op == "placeholder"]
    return rewritten


def _grad_output_index(seen: dict, n_outputs: int, param: str) -> int:
    """Backward outputs = gradients of the forward inputs, in order (lifted ones first);
    Dynamo names the input of ``self.a.b.weight`` ``l_self_modules_a_modules_b_parameters_weight_``."""
    *mods, leaf = param.split(".")
    name = "l_self_" + "".join(f"modules_{m}_" for m in mods) + f"parameters_{leaf}_"
    return n_outputs - len(seen["inputs"]) + seen["inputs"].index(name)


def _reference_and_cp():
    """The eager reference run: (its model, its loss, the model to compile, the inputs, its attention calls)."""
    torch._dynamo.reset()
    ref_model, inputs = models.llama_factory()
    cp_model, _ = models.llama_factory()
    with AttentionCount() as count:
        ref = ref_model(*inputs)
    ref.backward()
    return ref_model, ref, cp_model, inputs, count.calls


def _errors(ref_model, ref, cp_model, out) -> tuple:
    return loss_and_grad_errors(ref_model, ref, cp_model, out)


def _llama_aot_eager_scheduled():
    from torch._dynamo.backends.debugging import aot_eager, boxed_nop

    ref_model, ref, cp_model, inputs, attentions = _reference_and_cp()
    explained = explain_record(ref_model, inputs, world_size=dist.get_world_size())
    seen = {}

    def compiler(kind):
        def compile_(gm, example_inputs):
            seen[kind + "_before"] = [n.name for n in gm.graph.nodes]
            seen[kind] = schedule_collectives(gm)
            return boxed_nop(gm, example_inputs)
        return compile_

    def backend(gm, example_inputs):
        rewritten = _ring_rewrite(gm, example_inputs, seen)
        return aot_eager(rewritten, example_inputs, fw_compiler=compiler("fw"), bw_compiler=compiler("bw"))

    out = torch.compile(cp_model, backend=backend, fullgraph=True)(*inputs)
    out.backward()
    assert seen["records"] == [explained], (seen["records"], explained)  # explain says what the rewrite did

    bw = seen["bw"]
    before = {name: i for i, name in enumerate(seen["bw_before"])}
    pos = {n: i for i, n in enumerate(bw.graph.nodes)}
    (grads,) = [n for n in bw.graph.nodes if n.op == "output"][0].args
    waits = {}  # parameter name -> (its gradient, all_reduce, wait_tensor)
    for name, _ in cp_model.named_parameters():
        wait = grads[_grad_output_index(seen, len(grads), name)]
        issue = wait.args[0]
        waits[name] = (issue.args[0], issue, wait)
    grad, issue, wait = waits["lm_head.weight"]
    others = [g for n, (g, _, _) in waits.items() if n != "lm_head.weight"]
    return {
        "errors": _errors(ref_model, ref, cp_model, out), "rings": ring_mismatches(seen["backend"], attentions),
        "violations": _violations(bw) + _violations(seen["fw"]),
        "lm_head": (pos[grad], pos[issue], pos[wait], tuple(grad.meta["val"].shape)),
        "others": [pos[g] for g in others],
        "before": (before[issue.name], max(before[g.name] for g in others), before[wait.name]),
        "n_all_reduce": sum(n.target is c10d.all_reduce.default for n in bw.graph.nodes),
    }


def test_llama_backward_overlaps_all_reduces_and_stays_exact(ranks):
    for rank, res in enumerate(ranks.run(2, _llama_aot_eager_scheduled)):
        loss_err, grad_err = res["errors"]
        assert loss_err <= TOL and grad_err <= TOL and not res["rings"], (rank, res["errors"], res["rings"])
        assert res["violations"] == [], res["violations"]
        # one per matrix, one bucket of the 1-D norm scales, the loss-sum's backward
        assert res["n_all_reduce"] == 16 + 1 + 1
        grad, issue, wait, shape = res["lm_head"]
        assert shape == (256, 64)
        # As traced, every all-reduce is waited at once (the rewrite emits the per-matrix
        # all-reduces after the 1-D buckets, so autograd already issues them early).
        issue_before, _last_grad_before, wait_before = res["before"]
        assert wait_before == issue_before + 1
        # Scheduled: issued right after its gradient, in flight while every other
        # parameter's gradient is computed, waited after all of them.
        assert issue == grad + 1
        assert all(issue < other < wait for other in res["others"]), (issue, wait, res["others"])


# ---------------------------------------------------------------- 2 ranks, Inductor


def _backward_events(codes: list, seen: dict) -> dict:
    """lm_head's gradient buffer and the call order of collectives and compute in the
    generated backward code."""
    (bw_code,) = [c for c in codes if "tangents_1" in c]
    body = bw_code[bw_code.index("def call(self, args)"):]
    returned = re.search(r"\n        return \((.*)\)\n", body).group(1)
    outputs, depth, start = [], 0, 0  # split the returned tuple at top-level commas
    for i, ch in enumerate(returned + ","):
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            outputs.append(returned[start:i].strip())
            start = i + 1
    outputs = [o for o in outputs if o]
    lm_buf = re.search(r"buf\d+", outputs[_grad_output_index(seen, len(outputs), "lm_head.weight")]).group(0)
    events = []  # in call order: ("AR" | "W", buffer) for collectives, ("mm" | "kernel", "") for compute
    for line in body.splitlines():
        m = re.match(r"\s*(extern_kernels\.mm\(|cpp_fused|torch\.ops\._c10d_functional\.(all_reduce|wait))", line)
        if m:
            kind = {"all_reduce": "AR", "wait": "W"}.get(m.group(2), "mm" if "mm(" in m.group(1) else "kernel")
            events.append((kind, re.search(r"buf\d+", line).group(0) if kind in ("AR", "W") else ""))
    return {"lm_buf": lm_buf, "events": events}


def _llama_inductor_cold_then_warm(cache_dir: str):
    """Cold: compile with Inductor into an empty cache both ranks share and read the
    generated backward. Warm: the same model again after ``torch._dynamo.reset()``: it
    must hit the AOTAutograd cache (both ranks load the same entry, the first of the two
    written, so one of them runs the other's artifact; the gradient all-reduce lives in
    the traced graph, so a cache hit cannot drop it) and stay exact."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    rounds = []
    with mock.patch.dict(os.environ, {"TORCHINDUCTOR_CACHE_DIR": cache_dir}):  # restored for later tests
        for warm in (False, True):
            counters.clear()
            ref_model, ref, cp_model, inputs, attentions = _reference_and_cp()
            explained = explain_record(ref_model, inputs, world_size=dist.get_world_size())
            backend = cp_compile.RingCP(inner="inductor")  # the backend applies inductor_overlap_config() itself

            def run():
                out = torch.compile(cp_model, backend=backend, fullgraph=True)(*inputs)
                out.backward()  # the backward is compiled here, after the backend call returned
                return out

            out, codes = run_and_get_code(run)
            assert backend.records == [explained], (backend.records, explained)  # explain says what it did
            res = {"errors": _errors(ref_model, ref, cp_model, out), "aot": dict(counters["aot_autograd"]),
                   "rings": ring_mismatches(backend, attentions)}
            if not warm:
                seen = {"inputs": [n.name for n in backend.graphs[0].graph.nodes if n.op == "placeholder"]}
                res.update(_backward_events(codes, seen))
            rounds.append(res)
    return rounds


@pytest.mark.slow
@pytest.mark.inductor
def test_inductor_overlap_config_reorders_the_backward_and_the_warm_cache_hits(ranks):
    cache = os.path.join(REPO, ".cache", f"inductor-shared-{uuid.uuid4().hex[:8]}")
    try:
        per_rank = ranks.run(2, _llama_inductor_cold_then_warm, cache, timeout=300)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    for rank, (cold, warm) in enumerate(per_rank):
        for res in (cold, warm):
            loss_err, grad_err = res["errors"]
            assert loss_err <= TOL and grad_err <= TOL and not res["rings"], (rank, res["errors"], res["rings"])
        assert warm["aot"].get("autograd_cache_hit") == 1, (rank, warm["aot"])  # warm: AOTAutograd skipped
        events, lm = cold["events"], cold["lm_buf"]
        issue, wait = events.index(("AR", lm)), events.index(("W", lm))
        assert sum(kind == "AR" for kind, _ in events) == 16 + 1 + 1, events
        mms = [i for i, (kind, _) in enumerate(events) if kind == "mm"]
        # issued right after the matmul giving its gradient, in flight during every other matmul
        assert [i for i in mms if not issue < i < wait] == [issue - 1], events
        # every gradient all-reduce (all but the loss-sum's, first) is waited after the last matmul
        waits = [i for i, (kind, _) in enumerate(events) if kind == "W"]
        assert all(i > mms[-1] for i in waits[1:]), events
