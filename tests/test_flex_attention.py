"""FlexAttention models (examples/flex_models.py) compiled with ring_cp: the flex op becomes the ring.

Distributed (gloo, 2 ranks, and 4 for the styles whose documents or prefix every rank boundary
cuts): for each mask_mod / score_mod style, the loss and every parameter gradient within 1e-5
(relative) of the same model run for one process on the whole sequence (flex's dense
implementation, bitwise the ``aot_eager`` compiled run); every flex_attention became one
ring op with the mods and no flex op is left; nothing of create_block_mask's O(S²) build
survives (no vmap, no argsort); no gather fallback, no cp_compile warning; the backend's
record equals what ``cp-compile explain`` prints. Also forward with ``return_aux`` lse.

Single process: the ring op's arguments (mods registered, identity score_mod dropped,
buffers whole, causal off; a learned score buffer passed as one), and the refusals (max_scores, a BlockMask
built from block tensors only, an lse whose gradient the ring would drop), each naming
flex_attention, the source line and the fix.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, flex_attention

import flex_models
from checks import cp_compile_warnings, explain_record, grad_errors, rel, ring_mismatches
from cp_compile.errors import CPRewriteError

# The one-process reference runs flex eagerly (its dense implementation), which torch warns about.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
TOL = 1e-5
STYLES = list(flex_models.FACTORIES)  # all at 2 ranks; at 4 (c = 8 rows a rank, 2 zig-zag halves of 4):
FOUR_RANKS = ["document_input", "prefix_lm", "outside_mask"]  # documents / the prefix cut by chunk boundaries
BLOCK_MASK_BUILD = ("_add_batch_dim", "_vmap_increment_nesting", "argsort")  # create_block_mask's work


def _targets(gms) -> list:
    ring = torch.ops.cp_compile.ring_attention_fwd.default
    return ["ring" if n.target is ring else getattr(n.target, "__name__", str(n.target))
            for gm in gms for n in gm.graph.nodes if n.op == "call_function"]


def _compare(style: str) -> dict:
    """On a rank: ring_cp against the one-process run, and what the rewritten graph calls."""
    import torch.distributed as dist

    import cp_compile

    ref_model, inputs = flex_models.FACTORIES[style]()
    cp_model, _ = flex_models.FACTORIES[style]()
    explained = explain_record(ref_model, inputs, world_size=dist.get_world_size())
    ref = ref_model(*inputs)  # flex compiles its op for one process (== aot_eager bitwise: see below)
    ref.backward()
    backend = cp_compile.RingCP(inner="aot_eager")
    with cp_compile_warnings() as warnings:
        out = torch.compile(cp_model, backend=backend, fullgraph=True)(*inputs)
        out.backward()
    targets = _targets(backend.graphs)
    return {
        "loss": rel(out.detach(), ref.detach()),
        "grad": max(grad_errors(cp_model, ref_model).values()),
        "fallbacks": list(backend.fallbacks), "warnings": warnings,
        "record": backend.records == [explained], "rings": targets.count("ring"),
        "flex": targets.count("flex_attention"), "build": [t for t in targets if t in BLOCK_MASK_BUILD],
        "layers": len(cp_model.layers),
        # one flex_attention a layer (eager flex compiles itself: no ATen count of the reference)
        "ring_mismatches": ring_mismatches(backend, len(cp_model.layers)),
    }


CASES = [(style, 2) for style in STYLES] + [(style, 4) for style in FOUR_RANKS]


@pytest.mark.slow
@pytest.mark.parametrize("style,world", CASES)
def test_flex_model_is_exact_and_ring_only(ranks, style, world):
    for rank, r in enumerate(ranks.run(world, _compare, style, timeout=300)):
        assert r["loss"] <= TOL and r["grad"] <= TOL, (rank, r)
        assert r["fallbacks"] == [] and r["warnings"] == [], (rank, r)
        assert r["rings"] == r["layers"] == 2 and r["flex"] == 0 and r["build"] == [], (rank, r)
        assert not r["ring_mismatches"], (rank, r["ring_mismatches"])
        assert r["record"], (rank, "backend.records differ from explain's record")


class _WithLse(nn.Module):
    """Projection then flex_attention returning (out, lse): the log-sum-exp the ring gives too."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor):  # x (B, S, 8)
        B, S, _ = x.shape
        q, k, v = self.proj(x).view(B, S, 3, 2, 4).permute(2, 0, 3, 1, 4)  # 3 x (B, H=2, S, D=4)
        mask = create_block_mask(flex_models.sliding_window(5), None, None, S, S, device=x.device)
        out, aux = flex_attention(q, k, v, block_mask=mask, return_aux=AuxRequest(lse=True))
        return out, aux.lse  # (B, H, S, D), (B, H, S)


def _lse_run() -> tuple:
    """(errors of the output and the lse against one process, what of "the flex_attention became
    the ring" fails)."""
    import cp_compile

    torch.manual_seed(0)
    model, x = _WithLse(), torch.randn(2, 32, 8)
    backend = cp_compile.RingCP(inner="aot_eager")
    with torch.no_grad():
        ref = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
        torch._dynamo.reset()
        got = torch.compile(model, backend=backend, fullgraph=True)(x)
    return [rel(a, b) for a, b in zip(got, ref)], ring_mismatches(backend, 1)  # _WithLse: one flex_attention


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_return_lse_is_the_rings(ranks, world):
    for rank, (errors, rings) in enumerate(ranks.run(world, _lse_run, timeout=120)):
        assert max(errors) <= TOL and not rings, (rank, errors, rings)


# ------------------------------------------------------------------- single process
@pytest.mark.slow
@pytest.mark.parametrize("style", ["document_input", "alibi"])
def test_reference_is_the_compiled_one_process_run(style):
    """The ranks compare with the eager model: flex compiles its op for one process anyway, and the
    result equals the model compiled with aot_eager bit for bit (loss and every gradient)."""
    runs = []
    for compiled in (False, True):
        model, inputs = flex_models.FACTORIES[style]()
        torch._dynamo.reset()
        run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        run(*inputs).backward()
        runs.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def _after(model: nn.Module, inputs: tuple):
    from cp_compile.tools.explain import explain_model

    return explain_model(model, inputs, world_size=2).after


def _ring_calls(model: nn.Module, inputs: tuple) -> list:
    return [n for n in _after(model, inputs).graph.nodes if n.target is torch.ops.cp_compile.ring_attention_fwd.default]


@pytest.mark.slow
@pytest.mark.parametrize("style,score,buffers", [
    ("causal", False, {}), ("document_buffer", False, {"mask_buffers": 1}),
    ("alibi", True, {"score_buffers": 1}), ("softcap", True, {}), ("outside_mask", False, {"mask_buffers": 1}),
])
def test_ring_op_gets_the_mods_and_whole_buffers(style, score, buffers):
    from cp_compile.ring.mods import lookup

    model, inputs = flex_models.FACTORIES[style]()
    calls = _ring_calls(model, inputs)
    assert len(calls) == 2
    for call in calls:
        assert call.args[3] is False  # causal: the mask_mod says it
        mods = lookup(call.kwargs["mods"])
        assert mods.mask_mod.args[0].code and (mods.score_mod is not None) == score  # identity: dropped
        got = {k: len(call.kwargs[k]) for k in ("mask_buffers", "score_buffers") if call.kwargs.get(k)}
        assert got == buffers
        for b in (b for k in got for b in call.kwargs[k]):
            assert b.meta["val"].shape[-1] in (32, 4)  # whole: the sequence (S = 32), or the heads


@pytest.mark.slow
@pytest.mark.parametrize("style,form", [
    ("alibi", "mask_mod from flex_attention + score_mod from flex_attention; per rank: score_buffers 1 tensor(s) 16 B"),
    ("causal", "mask_mod from flex_attention; per rank: no mask tensor"),
])
def test_record_states_the_mask_form(style, form):
    """The per-graph record (and so explain) names the mods and the bytes of their buffers per rank
    (ALiBi: one (4,) fp32 slopes buffer)."""
    from cp_compile.tools.explain import explain_model

    model, inputs = flex_models.FACTORIES[style]()
    assert explain_model(model, inputs, world_size=2).ctx.record.masks == [form] * 2


def _refusal(model: nn.Module, inputs: tuple) -> str:
    with pytest.raises(CPRewriteError) as err:
        _after(model, inputs)
    msg = str(err.value)
    assert "flex_attention" in msg and "test_flex_attention.py" in msg and "Fix:" in msg, msg
    return msg


class _Probe(nn.Module):
    """One flex_attention on (B, H=2, S, D=4) from a projection; ``how`` picks the call."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.proj = how, nn.Linear(8, 24)
        self.bias = nn.Parameter(torch.zeros(2))  # a learned per-head bias

    def forward(self, x: torch.Tensor, blocks=None):
        B, S, _ = x.shape
        q, k, v = self.proj(x).view(B, S, 3, 2, 4).permute(2, 0, 3, 1, 4)
        if self.how == "learned":
            bias = self.bias
            return flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + bias[h]).sum()
        if self.how in ("lse_grad", "lse_detached"):
            out, aux = flex_attention(q, k, v, return_aux=AuxRequest(lse=True))
            return out.sum() + (aux.lse if self.how == "lse_grad" else aux.lse.detach()).sum()
        return flex_attention(q, k, v, block_mask=blocks).sum()  # "plain", "tensors_only"


@pytest.mark.slow
def test_learned_score_buffer_is_passed_to_the_ring():
    """A score_mod reading a parameter becomes the ring with that parameter as a score buffer (its gradient:
    tests/test_ring_learned_bias.py). (A mask_mod reading one torch refuses itself: "Captured buffers from
    mask mod that require grad are not supported"; find_flex refuses it too, should it ever get through.)"""
    (call,) = _ring_calls(_Probe("learned"), (torch.randn(2, 32, 8),))
    (buf,) = call.kwargs["score_buffers"]
    assert buf.meta["val"].shape == (2,)  # the (H,) bias, whole


@pytest.mark.slow
def test_max_scores_are_refused():
    """flex refuses max_scores on CPU before Dynamo records it, so the request is set on the traced node
    (kernel_options["OUTPUT_MAX"], what flex records on a GPU)."""
    from cp_compile.group import CPGroup
    from cp_compile.passes.context import RewriteContext
    from cp_compile.passes.analyze.find_attention import find_attention

    graphs = []
    torch._dynamo.reset()
    torch.compile(_Probe("plain"), backend=lambda gm, ex: graphs.append(gm) or gm, fullgraph=True)(
        torch.randn(2, 32, 8))
    (node,) = [n for n in graphs[0].graph.nodes if "flex_attention" in str(n.target)]
    node.args = (*node.args[:6], {**node.args[6], "OUTPUT_MAX": True}, *node.args[7:])
    with pytest.raises(CPRewriteError) as err:
        find_attention(graphs[0], RewriteContext(group=CPGroup(pg=None, rank=0, size=2)))
    msg = str(err.value)
    assert "flex_attention" in msg and "test_flex_attention.py" in msg and "max_scores" in msg and "Fix:" in msg


@pytest.mark.slow
def test_lse_whose_gradient_the_ring_drops_is_refused():
    assert "lse" in _refusal(_Probe("lse_grad"), (torch.randn(2, 32, 8),))


@pytest.mark.slow
def test_detached_lse_is_the_rings():
    calls = _ring_calls(_Probe("lse_detached"), (torch.randn(2, 32, 8),))
    assert len(calls) == 1 and "mods" not in calls[0].kwargs  # no block_mask, no score_mod: plain attention


@pytest.mark.slow
def test_block_mask_from_block_tensors_only_is_refused():
    ones = torch.ones(1, 1, 1, dtype=torch.int32)
    blocks = BlockMask.from_kv_blocks(ones, torch.zeros(1, 1, 1, 1, dtype=torch.int32), BLOCK_SIZE=32,
                                      seq_lengths=(32, 32))
    assert "create_block_mask" in _refusal(_Probe("tensors_only"), (torch.randn(2, 32, 8), blocks))
