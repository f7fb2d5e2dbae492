"""``transformers.Trainer`` on a DP x CP mesh through ``cp_compile.recipes.hf_trainer.RingCPTrainer``.

    torchrun --standalone --nproc-per-node 4 examples/hf_trainer.py --cp 2   # dp = 2, cp = 2
    python examples/hf_trainer.py --single                                   # one process, stock Trainer

A tiny random Hugging Face Llama (``examples/hf_models.py``) trains for ``--steps`` AdamW steps
on a fixed dataset of ``--steps`` x ``--global-batch`` sequences (token ids and labels with ~10%
set to -100, so the Trainer's count of valid labels matters), with the Trainer's default seeded
random sampler. Every step consumes ``--global-batch`` sequences whatever the mesh: each dp
replica takes ``global_batch / dp`` of them per step. Rank 0 prints one JSON line: the losses
the Trainer logged (``logging_steps=1``), the world and CP sizes, and what ring_cp rewrote.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any, Dict, List

import torch

import hf_models


def dataset(n: int, seq_len: int) -> List[Dict[str, torch.Tensor]]:
    """``n`` examples ``{"input_ids", "labels"}`` (labels: the ids, ~10% -100; HF shifts them)."""
    ids, labels = hf_models.hf_tokens(seq_len, batch=n, seed=1)
    return [{"input_ids": row_ids, "labels": row_labels} for row_ids, row_labels in zip(ids, labels)]


def training_args(out: str, steps: int, batch: int, **extra: Any) -> Any:
    """The TrainingArguments of both runs (fp32, AdamW, constant lr, loss logged every step)."""
    import transformers

    return transformers.TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=batch, learning_rate=1e-3,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True, **extra)


def run(args: argparse.Namespace) -> Dict[str, Any]:
    """Train and return the logged losses (and, under CP, what ring_cp did)."""
    import transformers

    data = dataset(args.steps * args.global_batch, args.seq_len)
    model = hf_models.hf_model("llama")
    with tempfile.TemporaryDirectory() as out:
        if args.single:
            trainer = transformers.Trainer(model=model, args=training_args(out, args.steps, args.global_batch),
                                           train_dataset=data)
            trainer.train()
            return {"losses": _losses(trainer), "world_size": 1}
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from cp_compile.recipes.hf_trainer import RingCPTrainer

        world = int(os.environ["WORLD_SIZE"])
        dp = world // args.cp
        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (dp, args.cp), mesh_dim_names=("dp", "cp"))
        targs = training_args(out, args.steps, args.global_batch // dp, torch_compile_backend="ring_cp")
        trainer = RingCPTrainer(model=model, args=targs, train_dataset=data, mesh=mesh,
                                cp_options={"inner": args.inner})
        trainer.train()
        backend = trainer.cp_backend
        rings = sum("ring_attention_fwd" in str(n.target) for gm in backend.graphs for n in gm.graph.nodes)
        return {"losses": _losses(trainer), "world_size": world, "cp": args.cp, "graphs": len(backend.graphs),
                "rings": rings, "fallbacks": len(backend.fallbacks), "ddp": type(trainer.model_wrapped).__name__}


def _losses(trainer: Any) -> List[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--single", action="store_true", help="one process, the stock Trainer (the reference)")
    p.add_argument("--cp", type=int, default=2, help="CP ranks per replica (dp = world size / cp)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--global-batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--inner", default="aot_eager", help="ring_cp's inner compiler: aot_eager or inductor")
    args = p.parse_args()
    torch.set_num_threads(1)
    result = run(args)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
