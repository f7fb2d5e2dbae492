"""Recipes: ``ring_cp`` inside training frameworks that own the training loop.

Each module imports its framework when it is imported, never from ``import cp_compile``:

* :mod:`cp_compile.recipes.hf_trainer` — ``transformers.Trainer`` on a DP x CP mesh
  (:class:`~cp_compile.recipes.hf_trainer.RingCPTrainer`).
"""
