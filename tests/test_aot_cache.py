"""The AOTAutograd-cache patch (cp_compile.backend.aot_cache): what it marks, and that its key
follows the source. The cache hit itself, and exactness from a warm cache shared by
two ranks, are tested in
test_schedule.py::test_inductor_overlap_config_reorders_the_backward_and_the_warm_cache_hits."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch._functorch._aot_autograd import autograd_cache

from cp_compile import graph_ops
from cp_compile.backend.aot_cache import aot_cache_config, source_hash
from checks import MaskedAttention, masked_inputs


def test_source_hash_follows_every_file(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    (tmp_path / "notes.txt").write_text("not source")
    first = source_hash.__wrapped__(str(tmp_path))
    (tmp_path / "notes.txt").write_text("changed, still not source")
    assert source_hash.__wrapped__(str(tmp_path)) == first
    (tmp_path / "sub" / "b.py").write_text("y = 3\n")
    assert source_hash.__wrapped__(str(tmp_path)) != first


def test_config_marks_exactly_the_graph_helpers_and_keeps_user_entries():
    user = {"my_pkg.my_fn": "v1"}
    with torch._inductor.config.patch(unsafe_marked_cacheable_functions=user):
        marked = aot_cache_config()["unsafe_marked_cacheable_functions"]
    assert marked.pop("my_pkg.my_fn") == "v1"
    assert set(marked) == {f"{fn.__module__}.{fn.__name__}" for fn in graph_ops.GRAPH_FUNCTIONS}
    assert "cp_compile.graph_ops.grad_scale" in marked and "cp_compile.ring.masking.additive_mask" in marked
    assert set(marked.values()) == {f"cp_compile:{source_hash()}"}


def test_helpers_bypass_the_cache_without_the_patch_and_pass_with_it():
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(graph_ops.grad_scale, (x, 0.5)))
    node = next(n for n in graph.nodes if n.op == "call_function")
    with pytest.raises(autograd_cache.BypassAOTAutogradCache):  # else: revisit cp_compile.backend.aot_cache
        autograd_cache.check_node_safe(node)
    with torch._inductor.config.patch(aot_cache_config()):
        autograd_cache.check_node_safe(node)


def test_every_function_a_rewritten_graph_calls_is_cacheable():
    """The rewrite of a model with an explicit mask (the widest set of emitted helpers) passes
    AOTAutograd's node check with the patch: no graph silently loses the cache."""
    from cp_compile.tools.explain import explain_model

    inputs = masked_inputs("causal_padding", 30)  # padded: gathers, masks and padding helpers too
    report = explain_model(MaskedAttention("causal_padding"), (inputs["x"], inputs["padding"]), world_size=2)
    with torch._inductor.config.patch(aot_cache_config()):
        for node in report.after.graph.nodes:
            if node.op == "call_function":
                autograd_cache.check_node_safe(node)
