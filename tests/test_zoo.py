"""Every zoo member (examples/zoo/) under ring_cp against one process, on real gloo ranks.

For each member and each CP size it lists (``Member.worlds``; ``examples/zoo_sweep.py`` runs
all members at 2 and 4 ranks), measured on every rank by :func:`zoo.measure.measure`:

* the loss and every parameter gradient within ``Member.tol`` (1e-5 relative) of the eager
  one-process run on the whole sequence (each gradient relative to its own norm, only those
  ``Member.zero_grads`` names as zero in exact arithmetic relative to 1e-4 of the whole
  gradient's: examples/_exact.py), and no gradient missing on either side;
* every attention of the eager run (counted by its ATen ops, without cp_compile) became the
  ring, none is recorded as unsplit, and a second call runs no attention kernel outside the
  ring and builds no tensor spanning the sequence twice (no S x S or c x S mask or scores);
* gather fallbacks exactly those the member declares (``Member.mixes_tokens``: ops that
  really mix tokens outside attention), none where nothing does;
* the sharded fraction of activation bytes at least ``Member.min_sharded`` (0.9);
* ``cp-compile explain`` prints the record the runtime keeps (field by field where Dynamo
  splits the model into several graphs); and given the member's file as a TARGET
  (``cp-compile explain examples/zoo/FILE.py:factory``), it prints that record's summary.
"""

from __future__ import annotations

import argparse
import sys

import pytest

from checks import zoo_problems
from cp_compile.tools.explain import explain_model
from zoo import members
from zoo.measure import measure

ZOO = members()
CASES = [pytest.param(name, world, id=f"{name}-N{world}") for name, m in ZOO.items() for world in m.worlds]


@pytest.mark.slow
@pytest.mark.parametrize("name,world", CASES)
def test_zoo_member_is_exact_ring_only_and_sharded(ranks, name, world):
    per_rank = ranks.run(world, measure, name, timeout=300)
    failures = {rank: p for rank, r in enumerate(per_rank) if (p := zoo_problems(ZOO[name], r))}
    assert not failures, f"{name} on {world} ranks: {failures}"


def _target(member) -> str:
    """``examples/zoo/FILE.py:factory`` of a member, as a user types it to ``cp-compile explain``."""
    module = sys.modules[member.factory.__module__]
    return f"{module.__file__}:{member.factory.__name__}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ZOO))
def test_cli_explain_on_the_member_file_prints_the_record(name, capsys):
    """The member's file given as a TARGET imports as a module of the zoo package (its relative
    imports work) and explain prints the record of the traced rewrite, the one the runtime keeps."""
    from cp_compile.tools.graph_commands import add_explain_parser, cmd_explain
    from cp_compile.tools.targets import load_target

    parser = argparse.ArgumentParser(prog="cp-compile")
    add_explain_parser(parser.add_subparsers(dest="command", required=True))
    assert cmd_explain(parser.parse_args(["explain", _target(ZOO[name])])) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("record: ")]
    model, args, kwargs = load_target(_target(ZOO[name]))
    want = explain_model(model, args, world_size=2, example_kwargs=kwargs).ctx.record
    assert printed == [f"record: {want.summary()}"], printed
    assert want.rings == len(want.attention) > 0 and not want.fallbacks, want.summary()
