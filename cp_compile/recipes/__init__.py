"""Recipes: ``ring_cp`` inside training frameworks that own the training loop.

Each framework module imports its framework when it is imported, never from ``import cp_compile``:

* :mod:`cp_compile.recipes.blocks` — each transformer block compiled on its own (torchtitan
  style), the sequence sharded between blocks (:func:`~cp_compile.recipes.blocks.compile_blocks`;
  only torch, so imported here).
* :mod:`cp_compile.recipes.hf_trainer` — ``transformers.Trainer`` on a DP x CP mesh
  (:class:`~cp_compile.recipes.hf_trainer.RingCPTrainer`).
"""

from .blocks import compile_blocks

__all__ = ["compile_blocks"]
