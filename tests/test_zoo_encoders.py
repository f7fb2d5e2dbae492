"""What the encoder / ViT / decoder-layer zoo members needed (examples/zoo/: nn_encoder,
nn_decoder_only, vit_registers, video_vit, bert), checked on the rewritten graph:

* a patch-embedding convolution (stride = kernel) is opened into patches + linear
  (``cp_compile.passes.normalize.patch_conv``), and the row selection reads only this rank's patches
  off the image (``row_select``: the merged reshape indexed at the unravelled positions):
  no convolution left, the patch linear runs on this rank's patch rows only, for ViT's
  Conv2d (cls + registers before the patches) and a video Conv3d tubelet;
* a convolution that is not per patch (overlapping windows) is left as written;
* ``nn.TransformerDecoderLayer`` used decoder-only (``memory`` = the sequence) is named:
  its cross-attention, why it cannot be context-parallel, and the fix
  (``nn.TransformerEncoderLayer`` with a causal mask); an error under ``strict=True``;
* the eval-mode paths of the torch.nn members (no_grad; the batch-first encoder layer's
  fused fast path) stay exact on 2 ranks.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from checks import AttentionCount, grad_errors, rel, ring_mismatches
from cp_compile.errors import CPRewriteError
from cp_compile.sequence import rank_positions
from cp_compile.tools.explain import explain_model
from zoo import nn_decoder_only, nn_encoder, video_vit, vit_registers


def _after(factory, rank: int, **opts):
    model, args = factory()
    return explain_model(model, args, world_size=2, rank=rank, **opts).after


def _calls(gm, name: str):
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method") and name in str(n.target)]


def _local(node) -> tuple:
    return tuple(node.meta["val"].shape)


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("factory,prefix,patch", [(vit_registers.factory, 5, 27), (video_vit.factory, 0, 96)],
                         ids=["vit_conv2d", "video_conv3d"])
def test_patch_convolution_embeds_only_this_ranks_patches(factory, prefix, patch, rank) -> None:
    gm = _after(factory, rank)
    assert not _calls(gm, "conv"), "the patch convolution should be opened into patches + linear"
    mine = int((torch.as_tensor(rank_positions(80, 2, rank, "zigzag")) >= prefix).sum())  # this rank's patch positions
    picks = [n for n in _calls(gm, "getitem")
             if isinstance(n.args[1], tuple) and any(isinstance(a, torch.fx.Node) for a in n.args[1])]
    assert picks and all(_local(n)[:2] == (3, mine) for n in picks), [(_local(n)) for n in picks]
    embeds = [n for n in _calls(gm, "linear") if _local(n)[1] == mine and n.args[0].meta["val"].shape[-1] == patch]
    assert len(embeds) == 1, "one patch linear on this rank's patches"


class _OverlapStem(nn.Module):
    """A conv stem with overlapping windows (kernel 3, stride 1, padding 1): not per patch."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, stride=1, padding=1)
        self.qkv = nn.Linear(32, 96)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images).flatten(2).transpose(1, 2)  # (B, 80, 32)
        q, k, v = self.qkv(x).unflatten(-1, (3, 4, 8)).permute(2, 0, 3, 1, 4).unbind(0)
        return F.scaled_dot_product_attention(q, k, v).sum()


def test_overlapping_convolution_is_left_as_written() -> None:
    gm = _after(lambda: (_OverlapStem(), (torch.randn(3, 3, 4, 20),)), 0)
    assert len(_calls(gm, "conv2d")) == 1


@pytest.mark.slow
def test_decoder_layer_cross_attention_is_named_with_the_fix(caplog) -> None:
    model, args = nn_decoder_only.decoder_layer_factory()
    with caplog.at_level(logging.WARNING, logger="cp_compile"):
        explain_model(model, args, world_size=2)
    (msg,) = [r.getMessage() for r in caplog.records if "TransformerDecoderLayer" in r.getMessage()]
    for part in ("cross-attention of nn.TransformerDecoderLayer model.layer", "multihead_attn", "memory",
                 "cannot be made context-parallel", "nn_decoder_only.py:",
                 "nn.TransformerEncoderLayer with a causal mask",
                 "generate_square_subsequent_mask"):
        assert part in msg, (part, msg)
    with pytest.raises(CPRewriteError, match="TransformerDecoderLayer model.layer.*strict=True"):
        explain_model(model, args, world_size=2, strict=True)


def _eval_exact(name: str) -> dict:
    """One member in eval mode under no_grad: compiled ring_cp loss against eager one process."""
    import copy

    import cp_compile
    from cp_compile.tools.targets import example_inputs

    factory = {"nn_encoder": nn_encoder.factory, "nn_decoder_only": nn_decoder_only.factory}[name]
    model, args, kwargs = example_inputs(factory())
    model.eval()
    backend, seen = cp_compile.RingCP(inner="aot_eager"), []

    def recording(gm, example_inputs):  # what Dynamo hands the backend: the fast path or the Python layers
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return backend(gm, example_inputs)

    compiled = torch.compile(copy.deepcopy(model), backend=recording, fullgraph=True)
    with torch.no_grad():
        with AttentionCount() as count:
            ref = model(*args, **kwargs)
        out = compiled(*args, **kwargs)
    return {"rel": ((out - ref).abs() / ref.abs()).item(), "rings": ring_mismatches(backend, count.calls),
            "attention": count.calls, "fastpath": any("_transformer_encoder_layer_fwd" in t for t in seen),
            "fallbacks": [f for r in backend.records for f in r.fallbacks]}


@pytest.mark.slow
@pytest.mark.parametrize("name,fastpath", [("nn_encoder", False), ("nn_decoder_only", True)])
def test_eval_mode_is_exact(ranks, name, fastpath) -> None:
    """Sequence-first layers take the Python path in eval too; the batch-first causal GPT's
    layers take the fused fast path (opened by expand_fastpath, its square mask read as causal)."""
    for r in ranks.run(2, _eval_exact, name, timeout=240):
        assert r["rel"] <= 1e-5 and not r["rings"] and r["attention"] == 2 and not r["fallbacks"], r
        assert r["fastpath"] == fastpath, r


def _inductor_vit() -> dict:
    """vit_registers under the default inner compiler (Inductor): loss and worst gradient error, and
    what of "every attention became the ring" fails."""
    import copy

    import cp_compile

    _, args = vit_registers.factory()
    torch.manual_seed(0)
    model = vit_registers.VisionTransformer(depth=1)  # one block: Inductor compiles in half the time
    cp_model, backend = copy.deepcopy(model), cp_compile.RingCP()  # backend="ring_cp": Inductor inside
    with AttentionCount() as count:
        ref = model(*args)
    out = torch.compile(cp_model, backend=backend)(*args)
    ref.backward()
    out.backward()
    return {"loss": rel(out, ref), "grad": max(grad_errors(cp_model, model).values()),
            "rings": ring_mismatches(backend, count.calls)}


@pytest.mark.inductor
def test_rank_dependent_graphs_keep_one_collective_order_under_inductor(ranks) -> None:
    """Where the sequence arises in the graph each rank's graph has its own shapes (rank 0 takes
    the cls and register rows, rank 1 none): Inductor's comm reordering, which follows data
    dependencies and peak memory, ordered the gradient all-reduces differently per rank (a
    gloo size mismatch); the backend leaves it off for such graphs."""
    for r in ranks.run(2, _inductor_vit, timeout=300):
        assert r["loss"] <= 1e-5 and r["grad"] <= 1e-5 and not r["rings"], r
