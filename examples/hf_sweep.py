"""Every Hugging Face family of ``examples/hf_models.py`` through ring_cp, against one process.

    torchrun --standalone --nproc-per-node 2 examples/hf_sweep.py [--seq-len 64] [--families llama,gpt2]
                                                                 [--padding none,left,right]

For each family and padding form, every rank builds the same tiny random model twice
from one seed: one copy runs eagerly on the full sequence (the single-device
reference), the other is compiled unchanged with
``torch.compile(backend=cp_compile.RingCP(inner="aot_eager"), fullgraph=True)``. Both
get ``model(input_ids, attention_mask, labels)`` with the labels unshifted (the model
shifts them), and ``attention_mask`` holding 9 tokens of padding in row 0 on the given
side (``none``: no attention_mask argument at all). Rank 0 prints one table row per
case: the relative error of the loss, of the worst parameter gradient (examples/_exact.py:
each relative to its own norm but those ``hf_models.ZERO_GRADS`` names) and of the logits of
real tokens, how many ops gathered the sequence, and what each attention mask became
(``causal``/``full``, ``w=W`` a sliding window, ``+mask`` an explicit mask).
A case that raises prints the first line of the error instead.

This is the sweep behind the families list in the README; ``tests/test_hf_models.py``
and ``tests/test_backend_masks.py`` keep a subset of it in CI.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_models  # noqa: E402
from _exact import grad_errors, rel  # noqa: E402

import cp_compile  # noqa: E402

PAD = 9  # padding tokens in row 0 of the batch
OVERRIDES = {"mistral": {"use_cache": False}, "gemma3": {"use_cache": False}}  # the window-16 families


def _batch(seq_len: int, padding: str) -> dict:
    ids, labels = hf_models.hf_tokens(seq_len)
    batch = {"input_ids": ids, "labels": labels}
    if padding != "none":
        mask = torch.ones_like(ids)
        pad = slice(0, PAD) if padding == "left" else slice(seq_len - PAD, seq_len)
        mask[0, pad] = 0
        labels[0, pad] = -100
        batch["attention_mask"] = mask
    return batch


def _rings(backend: cp_compile.RingCP) -> str:
    """What each ring op of the rewritten graphs takes: causal/full, window, explicit mask."""
    kinds = []
    for gm in backend.graphs:
        for n in gm.graph.nodes:
            if "ring_attention_fwd" in str(n.target):
                w = n.kwargs.get("window", -1)
                kinds.append(("causal" if n.args[3] else "full") + (f" w={w}" if w > 0 else "")
                             + (" +mask" if "attn_mask" in n.kwargs else ""))
    return ", ".join(sorted(set(kinds))) or "none"


def run_case(family: str, seq_len: int, padding: str) -> dict:
    """Errors of one family and padding form on this rank."""
    torch._dynamo.reset()
    ref_model, cp_model = (hf_models.hf_model(family, **OVERRIDES.get(family, {})) for _ in range(2))
    batch = _batch(seq_len, padding)
    ref = ref_model(**batch)
    ref.loss.backward()
    backend = cp_compile.RingCP(inner="aot_eager")
    with torch._dynamo.config.patch(specialize_float=True):
        out = torch.compile(cp_model, backend=backend, fullgraph=True)(**batch)
    out.loss.backward()
    grad = max(grad_errors(cp_model, ref_model, hf_models.ZERO_GRADS.get(family, ())).values())
    real = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()[..., None]
    return {"loss": rel(out.loss.detach(), ref.loss.detach()), "grad": grad,
            "logits": rel(out.logits.detach() * real, ref.logits.detach() * real),
            "fallbacks": len(backend.fallbacks), "rings": _rings(backend)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--families", default=",".join(hf_models.FAMILIES))
    p.add_argument("--padding", default="none,left,right")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    if rank == 0:
        print(f"{dist.get_world_size()} ranks, S={args.seq_len}, fp32; relative errors vs one process")
        print("| family | attention_mask | loss | worst grad | logits | gathers | ring ops |")
        print("|---|---|---|---|---|---|---|")
    for family in args.families.split(","):
        for padding in args.padding.split(","):
            try:
                r = run_case(family, args.seq_len, padding)
                row = f"{r['loss']:.1e} | {r['grad']:.1e} | {r['logits']:.1e} | {r['fallbacks']} | {r['rings']}"
            except Exception as e:  # noqa: BLE001 - a sweep reports every case
                row = f"error: {str(e).splitlines()[0][:160]} | | | |"
            if rank == 0:
                print(f"| {family} | {padding} | {row} |", flush=True)
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
