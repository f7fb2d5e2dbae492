"""@cp_compile.context_parallel: decorated training steps track single-process steps.

Each rank also runs the undecorated step on the full batch (the single-device
reference, identical on every rank) with its own copy of the model and optimizer;
every attention of the model became the ring in the graphs the decorator compiled.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import models

import cp_compile
from checks import AttentionCount, explain_record, rel, ring_mismatches

SHARD = {"input_ids": 1, "labels": 1}


def plain_step(model, optimizer, input_ids, labels):
    loss = model(input_ids, labels)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


class Trainer:
    """The step as a method, with the model and optimizer on ``self``."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    @cp_compile.context_parallel(shard=SHARD, inner="aot_eager")
    def step(self, input_ids, labels):
        return plain_step(self.model, self.optimizer, input_ids, labels)


def _train(steps: int, mode: str):
    ref_model, (ids, labels) = models.llama_factory(seq_len=48)
    cp_model, _ = models.llama_factory(seq_len=48)
    # The step is compiled as several graphs (Dynamo splits it at loss.backward(); the optimizer
    # step has no attention): explain traces the model's forward, the graph that holds the attention.
    explained = explain_record(ref_model, (ids, labels), world_size=torch.distributed.get_world_size(),
                               seq_inputs=dict(SHARD))
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    cp_opt = (torch.optim.SGD(cp_model.parameters(), lr=0.1) if mode == "sgd"
              else torch.optim.AdamW(cp_model.parameters(), lr=1e-2))
    if mode == "sgd":
        ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    if mode == "method":
        trainer = Trainer(cp_model, cp_opt)
        step = lambda i, lab: trainer.step(i, lab)  # noqa: E731
        backend = Trainer.step.backend  # one per class, kept across calls of this function
    else:
        local = mode == "local"
        decorated = cp_compile.context_parallel(plain_step, shard=SHARD, inner="aot_eager",
                                                inputs="local" if local else "full")
        step = lambda i, lab: decorated(  # noqa: E731
            cp_model, cp_opt, *((cp_compile.shard(i, 1), cp_compile.shard(lab, 1)) if local else (i, lab)))
        backend = decorated.backend
    seen, rewritten = len(backend.records), len(backend.graphs)  # the method's backend outlives this call
    with torch.no_grad(), AttentionCount() as count:  # the attention calls of one forward
        ref_model(ids, labels)
    ref_losses, cp_losses = [], []
    for _ in range(steps):
        ref_losses.append(plain_step(ref_model, ref_opt, ids, labels).item())
        cp_losses.append(step(ids, labels).item())
    records = backend.records[seen:]
    assert [r for r in records if r.attention] == [explained], (records, explained)  # explain says what it did
    assert all(r.rings == 0 and not r.unsplit for r in records if not r.attention), records
    param_err = max(rel(p, q) for p, q in zip(cp_model.parameters(), ref_model.parameters()))
    this_call = SimpleNamespace(graphs=backend.graphs[rewritten:], records=records)
    return ref_losses, cp_losses, param_err, ring_mismatches(this_call, count.calls)


@pytest.mark.slow
@pytest.mark.parametrize("world,mode", [(2, "function"), (4, "function"), (2, "method"), (2, "local"), (2, "sgd")])
def test_twenty_decorated_steps_equal_single_process(ranks, world, mode):
    for ref, cp, param_err, rings in ranks.run(world, _train, 20, mode, timeout=300):
        assert all(abs(a - b) <= 1e-4 * abs(a) for a, b in zip(ref, cp)), list(zip(ref, cp))
        assert ref[-1] < ref[0]
        assert param_err <= 1e-4 and not rings, (param_err, rings)


def test_bad_decorator_arguments_name_the_fix():
    with pytest.raises(ValueError, match="not parameters of plain_step"):
        cp_compile.context_parallel(plain_step, shard={"tokens": 1})
    with pytest.raises(ValueError, match="needs shard="):
        cp_compile.context_parallel(plain_step, inputs="local")
    with pytest.raises(ValueError, match="'full' or 'local'"):
        cp_compile.context_parallel(plain_step, inputs="sharded")
