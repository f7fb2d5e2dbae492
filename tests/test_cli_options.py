"""``cp-compile explain`` takes the ring_cp options that change the rewrite, so the record it
prints is the one the runtime keeps with the same options (``tools/graph_commands.py``).

Each value a flag documents runs; each flag reaches the rewrite (the printed record, or the
report's context, changes as the same option changes it when passed to ``inspect``)."""

from __future__ import annotations

import os

import pytest

from cp_compile.tools.explain import explain_model
from cp_compile.tools.targets import load_target
from checks import LLAMA_TARGET, run_cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.parametrize("flags", [
    [], ["--dynamic"], ["--inputs", "local"], ["--inputs", "full"], ["--outputs", "local"], ["--outputs", "full"],
    ["--grad-sync", "none"], ["--grad-sync", "allreduce"], ["--kernel", "reference"], ["--rotate", "allgather"],
    ["--rotate", "p2p"], ["--strict"], ["--seq-inputs", "auto"], ["--seq-inputs", "input_ids=1,labels=1"],
    ["--strategy", "ring"], ["--strategy", "ulysses"], ["--strategy", "auto"],
    ["--world-size", "4", "--strategy", "2d", "--ulysses-degree", "2"],
    ["--strategy", "auto", "--hardware", "h100-ib"], ["--strategy", "auto", "--hardware", "custom:989,450,80,8,50"],
], ids=lambda f: " ".join(f) or "defaults")
def test_every_option_flag_runs_and_reaches_the_rewrite(flags, capsys):
    code, out, err = run_cli(["explain", LLAMA_TARGET, *flags], capsys)
    assert code == 0, err
    model, args, kwargs = load_target(LLAMA_TARGET)
    options = {"inputs": "full", "outputs": "full", "grad_sync": "allreduce", "kernel": "auto", "rotate": "p2p",
               "seq_inputs": "auto", "strict": False, "strategy": "ring", "ulysses_degree": None, "hardware": None}
    for name, value in zip(flags[::2], flags[1::2] + [None]):
        key = name[2:].replace("-", "_")
        if key in options:
            options[key] = {"input_ids": 1, "labels": 1} if value == "input_ids=1,labels=1" else value
    options["strict"] = "--strict" in flags
    if options["ulysses_degree"] is not None:
        options["ulysses_degree"] = int(options["ulysses_degree"])
    world = int(flags[flags.index("--world-size") + 1]) if "--world-size" in flags else 2
    ctx = explain_model(model, args, world, example_kwargs=kwargs, dynamic="--dynamic" in flags, **options).ctx
    for key, value in options.items():
        assert getattr(ctx.options, key) == value, key
    assert f"record: {ctx.record.summary()}" in out  # the record explain printed is this one
    if options["strategy"] != "ring":  # each attention's strategy, and why, printed as the record has it
        assert all(f"strategy: {s}" in out for s in ctx.record.strategies) and ctx.record.strategies, out
    if "labels=1" in " ".join(flags):
        assert "labels (dim 1)" in out


def test_strict_refuses_what_would_gather(tmp_path, capsys):
    path = tmp_path / "running_sum.py"  # tokens mixed outside attention: a cumsum over the sequence, gathered
    # under load_balance="striped" (no contiguous runs to scan)
    path.write_text("import torch\nimport torch.nn.functional as F\n"
                    "class M(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                    "        self.emb, self.qkv = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 48)\n"
                    "    def forward(self, ids):\n        x = self.emb(ids).cumsum(dim=1)\n"
                    "        q, k, v = self.qkv(x).view(*ids.shape, 3, 2, 8).permute(2, 0, 3, 1, 4)\n"
                    "        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()\n"
                    "def factory(seq_len=64):\n    return M(), (torch.randint(0, 32, (2, seq_len)),)\n")
    code, _, err = run_cli(["explain", f"{path}:factory", "--load-balance", "striped"], capsys)
    assert code == 0, err
    code, _, err = run_cli(["explain", f"{path}:factory", "--load-balance", "striped", "--strict"], capsys)
    assert code == 1 and "strict" in err


def test_bad_seq_inputs_names_the_form(capsys):
    with pytest.raises(SystemExit) as e:
        run_cli(["explain", LLAMA_TARGET, "--seq-inputs", "input_ids"], capsys)
    assert e.value.code == 2
    assert "NAME=DIM" in capsys.readouterr().err
