"""Position biases and prefix masks built in model code become rules of global positions (masks/lift.py).

* ALiBi (examples/zoo/alibi.py): the additive bias ``slope_h · (k − q)`` (or BLOOM's ``slope_h · k``)
  built from aranges, with and without the causal ``masked_fill``, passed to SDPA or added to
  hand-written scores, with the slopes a buffer or computed inline: the ring op gets a score_mod
  and O(S) buffers, no explicit mask rows; causality stays the ring's flag.
* The prefix-LM mask ``(kv <= q) | (kv < P)`` (examples/zoo/prefix_lm.py) becomes a mask_mod.
* Exact on 2 and 4 ranks, every attention the ring (tests/test_zoo.py runs the members; here the
  other variants, and the score kernel cut into row tiles as long sequences are).
* A bias computed from activations is refused, naming the line and the fix (learned slopes, an
  nn.Parameter, are a rule: tests/test_learned_bias.py).
"""

from __future__ import annotations

import pytest
import torch

from checks import AttentionCount, grad_errors, rel, ring_mismatches
from cp_compile.passes.context import CPRewriteError
from cp_compile.tools.explain import explain_model
from zoo import alibi, prefix_lm

TOL = 1e-5
S = 80


def _rings(model, args, world: int = 2) -> list:
    """The ring ops of the rewritten forward graph (no process group: the rewrite alone)."""
    after = explain_model(model, args, world_size=world).after
    fwd = torch.ops.cp_compile.ring_attention_fwd.default
    return [n for n in after.graph.nodes if n.op == "call_function" and n.target is fwd]


def _buffer_shapes(ring, key: str) -> list:
    return [tuple(b.meta["val"].shape) if "val" in b.meta else tuple(b.meta["example_value"].shape)
            for b in ring.kwargs.get(key) or []]


VARIANTS = [
    dict(causal=True, form="sdpa", slopes="buffer", bias="relative"),
    dict(causal=False, form="sdpa", slopes="buffer", bias="relative"),
    dict(causal=True, form="scores", slopes="inline", bias="relative"),
    dict(causal=False, form="scores", slopes="inline", bias="bloom"),
    dict(causal=True, form="sdpa", slopes="inline", bias="bloom"),
]
IDS = ["-".join(str(v) if not isinstance(v, bool) else ("causal" if v else "full") for v in d.values())
       for d in VARIANTS]


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_alibi_becomes_a_score_rule_without_mask_rows(variant: dict) -> None:
    model, args = alibi.factory(S, **variant)
    rings = _rings(model, args)
    assert len(rings) == 2
    for ring in rings:
        from cp_compile.ring.mods import lookup

        assert "attn_mask" not in ring.kwargs, ring.kwargs  # no c x S rows
        assert ring.args[3] is variant["causal"]  # causality stays the ring's flag (tile skipping, balance)
        mods = lookup(ring.kwargs["mods"])
        assert mods.score_mod is not None and mods.mask_mod is None
        shapes = _buffer_shapes(ring, "score_buffers")
        assert shapes and all(len(s) == 4 and s[-2:].count(S) <= 1 for s in shapes), shapes  # O(S) each
        assert all(s[1] in (1, 4) and s[0] == 1 for s in shapes), shapes  # (1, H|1, S|1, S|1)


@pytest.mark.slow
def test_causality_stays_the_flag_where_the_mask_is_too_long_to_evaluate() -> None:
    """At S = 4096 the (H, S, S) bias and the (S, S) causal term are too large to evaluate at compile
    time: ``~(kv > q)`` is read from positions (a band), the bias lifted from its O(S) leaves."""
    model, args = alibi.factory(4096, dim=32, n_layers=1, batch=1)
    (ring,) = _rings(model, args, world=4)
    assert ring.args[3] is True and "attn_mask" not in ring.kwargs, ring.kwargs
    assert all(s[-2:].count(4096) <= 1 for s in _buffer_shapes(ring, "score_buffers"))


@pytest.mark.slow
def test_prefix_mask_becomes_a_mask_rule() -> None:
    model, args = prefix_lm.factory(S)
    rings = _rings(model, args, world=4)
    assert len(rings) == 2
    from cp_compile.ring.mods import lookup

    for ring in rings:
        assert "attn_mask" not in ring.kwargs and ring.args[3] is False
        mods = lookup(ring.kwargs["mods"])
        assert mods.mask_mod is not None and mods.score_mod is None
        assert all(s[-2:].count(S) <= 1 for s in _buffer_shapes(ring, "mask_buffers"))


def test_a_rule_evaluates_to_the_mask_it_replaces() -> None:
    """The lifted mask_mod, evaluated on the whole grid, is the model's own prefix mask."""
    from cp_compile.ring.mods import lookup

    model, args = prefix_lm.factory(S)
    ring = _rings(model, args)[0]
    after = ring.graph.owning_module
    mods = lookup(ring.kwargs["mods"])
    leaves = _leaf_values(after, ring.kwargs["mask_buffers"])
    grid = mods.with_buffers(leaves, None).mask(1, 1, torch.arange(S), torch.arange(S))[0, 0]
    assert torch.equal(grid, model.prefix_mask(S, torch.device("cpu")))


def _leaf_values(gm, nodes) -> list:
    """Run the rewritten graph's pure prefix that computes ``nodes`` (aranges and views)."""
    env = {}
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method") and all(a in env for a in n.all_input_nodes):
            args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
            try:
                env[n] = getattr(args[0], n.target)(*args[1:], **kwargs) if n.op == "call_method" \
                    else n.target(*args, **kwargs)
            except Exception:  # noqa: BLE001 - an op of the rest of the graph
                continue
        if all(x in env for x in nodes):
            break
    return [env[x] for x in nodes]


class _ActivationAlibi(alibi.AlibiAttention):
    """ALiBi whose slopes are computed from the activations (q): no rule of positions over whole tables
    (learned slopes, an nn.Parameter, are one: tests/test_learned_bias.py)."""

    def __init__(self) -> None:
        super().__init__(32, 4, causal=True, form="sdpa", slopes="buffer", bias="relative")

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(q.shape[2], device=q.device)
        bias = q.mean(dim=(0, 2, 3))[:, None, None] * (pos[None, :] - pos[:, None])  # (H, S, S), requires grad
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias[None], is_causal=False)


def test_a_bias_from_activations_is_refused_naming_the_line_and_the_fix() -> None:
    with pytest.raises(CPRewriteError) as err:
        explain_model(_ActivationAlibi(), (torch.randn(3, S, 32),), world_size=2)
    text = str(err.value)
    assert "requires grad" in text and "test_zoo_bias.py:" in text and "Fix:" in text, text


# -- exactness of the variants the zoo test does not run (multi-rank) -----------------------------
def _rank_errors(variants: list, tile_elements: int = 0) -> list:
    """Per variant: (loss error, worst gradient error, what of "every attention became the ring"
    fails) of ring_cp against one process."""
    from cp_compile.kernels import scores

    saved = scores.TILE_ELEMENTS
    scores.TILE_ELEMENTS = tile_elements or saved  # small: the score kernel's rectangles cut into row tiles
    try:
        return [_errors(variant) for variant in variants]
    finally:
        scores.TILE_ELEMENTS = saved


def _errors(variant: dict) -> tuple:
    import cp_compile

    torch._dynamo.reset()
    (ref, args), (cp, _) = alibi.factory(S, **variant), alibi.factory(S, **variant)
    with AttentionCount() as count:
        loss_ref = ref(*args)
    loss_ref.backward()
    backend = cp_compile.RingCP(inner="aot_eager")
    loss = torch.compile(cp, backend=backend, fullgraph=True)(*args)
    loss.backward()
    grad = max(grad_errors(cp, ref).values())
    return rel(loss.detach(), loss_ref.detach()), grad, ring_mismatches(backend, count.calls)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_alibi_variants_are_exact(ranks, world: int) -> None:
    variants = [VARIANTS[1], VARIANTS[3]] if world == 2 else [VARIANTS[2]]
    for rank, errors in enumerate(ranks.run(world, _rank_errors, variants, timeout=300)):
        assert all(loss <= TOL and grad <= TOL and not rings for loss, grad, rings in errors), (rank, errors)


def test_alibi_is_exact_with_the_score_kernel_in_row_tiles(ranks) -> None:
    """Long sequences run each ring rectangle's explicit scores in tiles of rows (memory bound)."""
    for rank, errors in enumerate(ranks.run(2, _rank_errors, [VARIANTS[0]], 500, timeout=300)):
        assert all(loss <= TOL and grad <= TOL and not rings for loss, grad, rings in errors), (rank, errors)
