"""The typed description of one ring call (cp_compile/ring/call_spec.py), no process group.

The attention rules record a :class:`RingCall` on each ring op they emit; the record, the cost
model and ``cp-compile explain`` read it (or, where a node is not the emitted one, read it off
the node by the op's schema). Here, through ``explain_model`` (the rewrite with ``pg=None``):

- the description read by schema equals the emitted one, for a causal model, a windowed one,
  an explicitly masked one, packed documents (with the zig-zag layout and with the per-batch
  ``documents`` table) and FlexAttention (mask_mod, score_mod with buffers, GQA); it equals the
  one read off AOTAutograd's forward and backward ring ops too;
- every argument of the ring op's schemas is a field of RingCall / MaskForm or listed in
  ``NOT_DESCRIBED``, so an argument added to the schema fails here instead of silently shifting
  what explain reads; and every described argument is read (none keeps its default when passed);
- the readers take the emitted description, and the backend's timeout reaches it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import flex_models
import models
import packed
from cp_compile.backend.record import mask_form
from cp_compile.passes.node_facts import facts, set_facts
from cp_compile.passes.ring_call import pass_timeout, ring_call
from cp_compile.ring.call_spec import NOT_DESCRIBED, RING_BWD, RING_FWD, MaskForm, RingCall, read_ring_call
from cp_compile.tools.explain import explain_model

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


class _Masked(nn.Module):
    """SDPA given a causal sliding window built from positions (``window``), or an explicit additive
    mask input on top of it (``explicit``): the ring's window, or this rank's rows of the mask."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form, self.qkv = form, nn.Linear(16, 48)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)  # (B, 2, S, 8) each
        i = torch.arange(s)
        band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 4)  # (S, S): 4 keys back
        mask = torch.where(band, bias, float("-inf")) if self.form == "explicit" else band
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()


def _masked(form: str):
    return _Masked(form), (torch.randn(2, 32, 16), torch.randn(1, 1, 32, 32))


# name -> (factory, explain options, the mask form the record states, (H_q, H_kv), layout table)
CASES = {
    "causal": (models.llama_factory, {}, "causal", None, False),
    "window": (lambda: _masked("window"), {}, "causal + window 4", (2, 2), False),
    "explicit": (lambda: _masked("explicit"), {}, "explicit", (2, 2), False),
    "documents": (packed.doc_attention_factory, {}, "causal + documents", (2, 2), False),
    "documents_table": (packed.doc_attention_factory, {"load_balance": "documents"}, "causal + documents", (2, 2),
                        True),
    "flex_mask_mod": (flex_models.FACTORIES["document_buffer"], {}, "mask_mod from flex_attention", None, False),
    "flex_score_mod": (flex_models.FACTORIES["alibi"], {},
                       "mask_mod from flex_attention + score_mod from flex_attention", None, False),
    "flex_gqa": (flex_models.FACTORIES["gqa"], {}, "mask_mod from flex_attention", None, False),
}


def _rings(gm: torch.fx.GraphModule, op=RING_FWD) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is op]


@pytest.mark.parametrize("name", list(CASES))
def test_the_call_read_by_schema_is_the_emitted_one(name: str) -> None:
    factory, opts, form, heads, table = CASES[name]
    model, inputs = factory()
    with torch._dynamo.config.patch(specialize_float=True):
        report = explain_model(model, inputs, world_size=2, aot=True, **opts)
    rings = _rings(report.after)
    assert len(rings) == len(report.attention) >= 1, (rings, report.attention)
    for node in rings:
        emitted = facts(node).ring_call
        assert isinstance(emitted, RingCall), (node.name, facts(node))
        assert read_ring_call(node) == emitted, (node.name, read_ring_call(node), emitted)
        assert ring_call(node) is emitted
        assert emitted.mask_form == form and emitted.positions is table, emitted
        assert emitted.load_balance == opts.get("load_balance", "zigzag") and emitted.rotate == "p2p", emitted
        assert emitted.heads is not None and emitted.gqa_ratio == emitted.heads[0] // emitted.heads[1], emitted
        if heads is not None:
            assert emitted.heads == heads, emitted
        if name == "flex_gqa":  # its query heads share each KV head in pairs: ratio 2, not causal
            assert emitted.gqa_ratio == 2 and not emitted.causal, emitted
    assert report.ctx.record.masks == [mask_form(n) for n in rings]
    assert [site.call for site in report.rings] == [facts(n).ring_call for n in rings]
    # AOTAutograd's graphs hold new nodes (no emitted description): read by schema, the same calls
    aot_rings = _rings(report.aot_forward) + (_rings(report.aot_backward, RING_BWD) if report.aot_backward else [])
    assert len(aot_rings) == len(rings) * (2 if report.aot_backward else 1), aot_rings
    for node in aot_rings:
        assert facts(node).ring_call is None, node
        assert read_ring_call(node) in [facts(n).ring_call for n in rings], (node.name, read_ring_call(node))


def test_every_schema_argument_is_described_or_listed() -> None:
    """A new argument of the ring op must be described (a field of RingCall or MaskForm, read by
    name in call_spec.py) or listed in NOT_DESCRIBED with the reason: else this test fails."""
    fields = {f.name for f in dataclasses.fields(RingCall)} | {f.name for f in dataclasses.fields(MaskForm)}
    for op in (RING_FWD, RING_BWD):
        names = [a.name for a in op._schema.arguments]
        missing = [n for n in names if n not in fields and n not in NOT_DESCRIBED]
        assert not missing, (f"{op}: arguments neither described by RingCall/MaskForm nor listed in "
                             f"call_spec.NOT_DESCRIBED: {missing}")
        both = [n for n in names if n in fields and n in NOT_DESCRIBED]
        assert not both, (op, both)
    listed = set(NOT_DESCRIBED) - {a.name for op in (RING_FWD, RING_BWD) for a in op._schema.arguments}
    assert not listed, f"NOT_DESCRIBED names arguments the schemas lack: {listed}"


def test_every_described_argument_is_read() -> None:
    """A ring node passing every argument away from its default: each field named after a schema
    argument differs from its default in the description read by schema (none is left unread)."""
    graph = torch.fx.Graph()
    t = [graph.placeholder(name) for name in ("q", "k", "v", "mask", "ids", "buf", "table")]
    flags = {"causal": True, "scale": 0.5, "group_name": "g", "load_balance": "striped", "rotate": "a2a",
             "kernel": "aten", "valid_len": 7, "timeout": 3.0, "window": 5}
    node = graph.call_function(RING_FWD, (*t[:3], *flags.values()), {
        "attn_mask": t[3], "doc_ids": t[4], "mods": "mods:unregistered", "mask_buffers": [t[5]],
        "score_buffers": [t[5], t[5]], "positions": t[6]})
    call = read_ring_call(node)
    described = {**{f.name: getattr(call, f.name) for f in dataclasses.fields(RingCall)},
                 **{f.name: getattr(call.mask, f.name) for f in dataclasses.fields(MaskForm)}}
    defaults = {f.name: f.default for cls in (RingCall, MaskForm) for f in dataclasses.fields(cls)}
    for arg in RING_FWD._schema.arguments:
        if arg.name in NOT_DESCRIBED:
            continue
        if arg.name in flags:
            assert described[arg.name] == flags[arg.name], (arg.name, call)
        else:
            assert described[arg.name] != defaults[arg.name], (arg.name, call)
    assert call.mask_form == "causal + window 5 + documents + explicit + mods mods:unregistered", call.mask_form


def test_readers_take_the_emitted_description_and_the_timeout_reaches_it() -> None:
    report = explain_model(*_masked("window"), world_size=2)
    (node,) = _rings(report.after)
    emitted = facts(node).ring_call
    pass_timeout(node, 30)  # what the backend does with its timeout option (compiler._set_ring_timeout)
    assert node.kwargs["timeout"] == 30.0 and facts(node).ring_call == read_ring_call(node), facts(node)
    assert facts(node).ring_call == dataclasses.replace(emitted, timeout=30.0)
    set_facts(node, ring_call=dataclasses.replace(emitted, causal=False))  # readers read the recorded call
    assert mask_form(node).startswith("window 4;"), mask_form(node)
    assert read_ring_call(node).causal, read_ring_call(node)


def test_a_ring_node_with_an_argument_the_schema_lacks_is_refused() -> None:
    from cp_compile.ring.call_spec import ring_arguments

    graph = torch.fx.Graph()
    q = graph.placeholder("q")
    node = graph.call_function(RING_FWD, (q, q, q, True, 0.5, "0", "zigzag", "p2p", "auto"), {"windw": 4})
    with pytest.raises(ValueError, match="windw"):
        ring_arguments(node)
