"""``cp-compile explain`` takes the ring_cp options that change the rewrite, so the record it
prints is the one the runtime keeps with the same options (``tools/graph_commands.py``).

Each value a flag documents runs, and each row reads only what the CLI itself printed: the options
line with the flag's value (different from a run with no flags), and the work that shows it (the
ring ops' kernel and rotation, the gradient all-reduce, a symbolic S, the inputs sharded, each
attention's strategy)."""

from __future__ import annotations

import os

import pytest

from cp_compile.tools.explain import explain_model
from cp_compile.tools.targets import load_target
from checks import LLAMA_TARGET, run_cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


FLAGS = [
    [], ["--dynamic"], ["--inputs", "local"], ["--inputs", "full"], ["--outputs", "local"], ["--outputs", "full"],
    ["--grad-sync", "none"], ["--grad-sync", "allreduce"], ["--kernel", "reference"], ["--rotate", "allgather"],
    ["--rotate", "p2p"], ["--strict"], ["--seq-inputs", "auto"], ["--seq-inputs", "input_ids=1,labels=1"],
    ["--strategy", "ring"], ["--strategy", "ulysses"], ["--strategy", "auto"],
    ["--world-size", "4", "--strategy", "2d", "--ulysses-degree", "2"],
    ["--strategy", "auto", "--hardware", "h100-ib"], ["--strategy", "auto", "--hardware", "custom:989,450,80,8,50"],
]
_DEFAULTS: dict = {}


def _explained(flags: list, capsys) -> str:
    code, out, err = run_cli(["explain", LLAMA_TARGET, *flags], capsys)
    assert code == 0, err
    return out


def _options(out: str) -> dict:
    """The ``options:`` line the CLI printed, as {name: value}."""
    [line] = [x for x in out.splitlines() if x.startswith("  options: ")]
    return dict(word.split("=", 1) for word in line[len("  options: "):].split(" "))


def _asked(flags: list) -> dict:
    """What each flag asks of the options line (the flag's own value)."""
    asked = {}
    for name, value in zip(flags, flags[1:] + [None]):
        key = name[2:].replace("-", "_")
        if key == "strict":
            asked[key] = "True"
        elif key not in ("world_size", "dynamic") and name.startswith("--"):
            asked[key] = value
    return asked


@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: " ".join(f) or "defaults")
def test_every_option_flag_runs_and_the_cli_prints_what_it_changed(flags, capsys):
    """Read from the CLI's own output only: the options line carries each flag's value (and, for a flag
    other than its default, differs there from a run with no flags); where the runtime's work shows
    it, that changes too (the ring op's kernel and rotation, the parameter gradients' all-reduce, a
    symbolic S, the sequence inputs, each attention's strategy)."""
    if "defaults" not in _DEFAULTS:
        _DEFAULTS["defaults"] = _explained([], capsys)
    base, out = _DEFAULTS["defaults"], _explained(flags, capsys)
    got, defaults = _options(out), _options(base)
    for key, value in _asked(flags).items():
        assert got[key] == value, (key, got)
    changed = {k for k, v in _asked(flags).items() if defaults[k] != v}
    assert {k for k in got if got[k] != defaults[k]} == changed, (got, defaults)
    rings = [x.strip() for x in out.splitlines() if x.strip().startswith("ring op: ")]
    assert rings and all(x == f"ring op: kernel {got['kernel']}, rotate {got['rotate']}" for x in rings), rings
    assert ("grad all_reduce (parameters)" in out) == (got["grad_sync"] == "allreduce"), out
    assert ("symbolic in the graph" in out) == ("--dynamic" in flags or got["inputs"] == "local"), out
    if "labels=1" in " ".join(flags) or got["inputs"] == "local":
        assert "sharded inputs: input_ids (dim 1), labels (dim 1)" in out, out
    strategies = [x.strip() for x in out.splitlines() if x.strip().startswith("strategy: ")]
    want = got["strategy"] if got["strategy"] != "auto" else None
    assert strategies and all(want is None or x.startswith(f"strategy: {want}") for x in strategies), strategies
    if "--world-size" in flags:
        assert "CP group of 4 ranks" in out and all("u = 2" in x or "2d" in x for x in strategies), strategies


def test_explain_prints_the_record_the_runtime_keeps(capsys):
    """The record line explain printed is the one ``explain_model`` (the runtime's code path) keeps."""
    out = _explained(["--rotate", "allgather"], capsys)
    model, args, kwargs = load_target(LLAMA_TARGET)
    ctx = explain_model(model, args, 2, example_kwargs=kwargs, rotate="allgather").ctx
    assert f"record: {ctx.record.summary()}" in out and ctx.options.rotate == "allgather"


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
