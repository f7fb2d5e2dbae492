"""The rewrite's pipeline (cp_compile/passes/pipeline.py): the pass order told once, the options
frozen apart from the analysis, and the per-pass dump ``CP_COMPILE_DUMP``.

Single process, no process group: :func:`cp_compile.tools.explain.explain_model` runs the same
pipeline as the backend (through ``rewrite_for_cp``) for a synthetic CP group of 2.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cp_compile.group import CPGroup
from cp_compile.options import BackendOptions, RewriteOptions
from cp_compile.passes.context import RewriteContext
from cp_compile.passes.dump import CODE_END, ENV
from cp_compile.passes.pipeline import PASSES, has_mixers
from cp_compile.tools.explain import explain_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
S, D = 16, 8


class Attention(nn.Module):
    """One causal self-attention layer: (B, S, D) -> (B, S, D)."""

    def __init__(self, s: int = S, d: int = D) -> None:
        super().__init__()
        self.s, self.d = s, d
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape[0], self.s, self.d
        q, k, v = (t.view(b, s, 2, d // 2).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, 2, S, D/2)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


class NoAttention(nn.Module):
    """A per-token MLP: nothing the ring replaces."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


def _expected(passes) -> list:
    return ["00_input.py"] + [f"{PASSES.index(p) + 1:02d}_{p.phase}_{p.name}.py" for p in passes]


def _dumped(root) -> tuple:
    (graph_dir,) = [os.path.join(root, d) for d in os.listdir(root)]  # no process group: no rank<r>/ level
    return graph_dir, sorted(os.listdir(graph_dir))


def _code(path: str) -> str:
    text = open(path).read()
    return text.split("\n", 1)[1].split(f"\n{CODE_END}\n", 1)[0]  # after the header line, before the node table


def test_dump_writes_the_graph_after_every_pass_in_order(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv(ENV, str(tmp_path))
    with caplog.at_level(logging.INFO, logger="cp_compile"):
        report = explain_model(Attention(), (torch.randn(2, S, D),), world_size=2)
    graph_dir, files = _dumped(tmp_path)
    assert files == _expected(PASSES)  # every pass ran on a graph with attention, each wrote one file
    assert _code(os.path.join(graph_dir, files[-1])) == report.after.code  # the last: the rewritten graph
    assert "ring_attention_fwd" in _code(os.path.join(graph_dir, files[-1]))
    assert "scaled_dot_product_attention" in _code(os.path.join(graph_dir, files[0]))
    table = open(os.path.join(graph_dir, files[-1])).read().split(CODE_END, 1)[1]
    assert all(line.startswith("# ") for line in table.strip().splitlines())  # the node table, in comments
    announced = [r for r in caplog.records if ENV in r.getMessage()]
    assert len(announced) == 1 and str(tmp_path) in announced[0].getMessage()  # once, naming the directory


def test_dump_stops_where_a_graph_without_attention_stops(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(ENV, str(tmp_path))
    report = explain_model(NoAttention(), (torch.randn(2, S, D),), world_size=2)
    assert not report.rewritten
    _, files = _dumped(tmp_path)
    assert files == _expected([p for p in PASSES if p.when is not has_mixers])
    assert files[-1].endswith("_analyze_find_unsplit_attention.py")


def test_nothing_is_dumped_without_the_variable(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    explain_model(Attention(), (torch.randn(2, S, D),), world_size=2)
    assert os.listdir(tmp_path) == []


def _design_pass_list() -> list:
    """(name, phase) of each item of docs/design.md section 5's pass list, in order."""
    text = open(os.path.join(REPO, "docs", "design.md")).read()
    section = text.split("## 5. Pass order", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\s*\d+\.\s+`([a-z_]+)`\s+\((normalize|analyze|propagate|finalize)\)", section, re.M)


def test_design_doc_lists_the_pipelines_passes_in_order() -> None:
    assert _design_pass_list() == [(p.name, p.phase) for p in PASSES]


def test_pass_names_are_unique_and_every_pass_has_a_summary() -> None:
    assert len({p.name for p in PASSES}) == len(PASSES)
    assert all(p.summary for p in PASSES), [p.name for p in PASSES if not p.summary]


def test_rewrite_options_are_frozen_and_typed() -> None:
    ctx = RewriteContext(group=CPGroup(pg=None, rank=0, size=2))
    assert ctx.options == RewriteOptions()  # default options
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.options.strict = True
    with pytest.raises(ValueError, match="load_balance"):
        RewriteOptions(load_balance="diagonal")
    trial = dataclasses.replace(ctx.options, strict=True)
    assert trial.strict and not ctx.options.strict


def test_backend_options_build_the_rewrite_options() -> None:
    names = {"x": 1}
    opts = BackendOptions(load_balance="striped", seq_inputs=names, strict=True, timeout=5, inner="eager")
    rewrite = opts.rewrite_options()
    assert isinstance(rewrite, RewriteOptions)
    assert (rewrite.load_balance, rewrite.strict, rewrite.timeout, rewrite.seq_inputs) == ("striped", True, 5.0, names)
    assert rewrite.seq_inputs is not names  # the rewrite's own copy


def test_the_trial_rewrite_settles_a_hidden_size_equal_to_s(tmp_path, monkeypatch) -> None:
    """x (B, S, S): both dims have attention's length; the strict trial rewrites (on a copy of the
    options) pick the one that reaches attention's sequence axis, and leave the graph as it was."""
    monkeypatch.setenv(ENV, str(tmp_path))
    report = explain_model(Attention(s=8, d=8), (torch.randn(2, 8, 8),), world_size=2)
    assert report.shard_inputs == {"x": 1} and not report.fallbacks
    assert not report.ctx.options.strict  # the trials' strict=True was theirs alone
    graph_dir, files = _dumped(tmp_path)
    at = next(i for i, p in enumerate(PASSES, start=1) if p.name == "resolve_candidates")  # its dump's number
    before, after = (_code(os.path.join(graph_dir, f)) for f in files if f[:2] in (f"{at - 1:02d}", f"{at:02d}"))
    assert files[at].startswith(f"{at:02d}_analyze_resolve_candidates") and before == after


def test_dump_goes_per_rank_under_a_process_group(tmp_path) -> None:
    """With a process group each rank writes its own graphs under rank<r>/ (the group object itself is
    never used by the dump: a stand-in is enough here)."""
    from cp_compile.passes.dump import GraphDump

    ctx = RewriteContext(group=CPGroup(pg=object(), rank=1, size=2))
    gm = torch.fx.symbolic_trace(NoAttention())
    path = GraphDump(ctx, root=str(tmp_path)).write(3, "analyze_x", gm)
    assert os.path.relpath(path, tmp_path).split(os.sep)[0] == "rank1" and path.endswith("03_analyze_x.py")
    assert _code(path) == gm.code
