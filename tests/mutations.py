"""Rules switched off one at a time, to show which tests catch each (benchmarks/mutation_check.py).

``CP_COMPILE_TEST_MUTATION=<name>`` makes :func:`from_env` (called by tests/conftest.py in the test
process and by tests/distributed.py in every rank worker) patch cp_compile in that process:

* ``ring``: attention is not made the ring (find_attention's findings dropped: a graph with no other
  mixer is compiled unchanged, every rank running the whole sequence: exact numbers, no CP);
* ``loss``: a loss over the sequence is not made global (each rank's sum is not all-reduced);
* ``grad_sync``: parameter gradients are not summed over the CP group (grad_all_reduce is the identity);
* ``shard_inputs``: no graph input is sharded (the sequence stays whole until the attention indexes it).

Nothing here runs unless the variable is set; no test imports it for its verdict.
"""

from __future__ import annotations

import os

MUTATIONS = ("ring", "loss", "grad_sync", "shard_inputs")


def from_env() -> None:
    name = os.environ.get("CP_COMPILE_TEST_MUTATION")
    if name:
        apply(name)


def apply(name: str) -> None:
    if name not in MUTATIONS:
        raise ValueError(f"unknown mutation {name!r}: one of {MUTATIONS}")
    globals()[f"_{name}"]()


def _ring() -> None:
    from cp_compile.passes import pipeline

    def find_none(gm, ctx):
        out = pipeline.find_attention(gm, ctx)
        ctx.attention = []
        return out

    pipeline.PASSES = tuple(p if p.name != "find_attention" else pipeline.Pass(p.name, p.phase, find_none, p.when)
                            for p in pipeline.PASSES)


def _loss() -> None:
    from cp_compile.passes.propagate.rules import losses

    losses._global_sum = lambda em, local_sum: local_sum


def _grad_sync() -> None:
    from cp_compile import graph_ops

    graph_ops.grad_all_reduce = lambda x, group_name: x
    graph_ops.grad_all_reduce_bucket = lambda xs, group_name: tuple(xs)


def _shard_inputs() -> None:
    from cp_compile.passes import pipeline

    def choose_none(gm, ctx, examples):
        ctx.shard_inputs = {}

    pipeline.choose_seq_inputs = choose_none
