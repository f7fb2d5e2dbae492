"""``cp-compile dump`` / ``explain`` (cp_compile/cli_graph.py, cp_compile/inspect_graph.py).

Single process, no process group: the graph is traced once and rewritten for a
synthetic CP group. The subcommands are called through a local parser built with
the add_*_parser functions, so these tests do not depend on cli.py.
"""

from __future__ import annotations

import argparse
import os
import re
import textwrap

import pytest

from cp_compile import cli_graph
from cp_compile.cli_graph import add_dump_parser, add_explain_parser, cmd_dump, cmd_explain
from cp_compile.inspect_graph import inspect
from cp_compile.targets import load_target

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = os.path.join(REPO, "examples", "models.py") + ":llama_factory"


def run(argv, capsys):
    parser = argparse.ArgumentParser(prog="cp-compile")
    sub = parser.add_subparsers(dest="command", required=True)
    add_dump_parser(sub)
    add_explain_parser(sub)
    args = parser.parse_args(argv)
    code = {"dump": cmd_dump, "explain": cmd_explain}[args.command](args)
    out, err = capsys.readouterr()
    return code, out, err


def after_section(text):
    return text.split("== after", 1)[1].splitlines()[1:]


def kind_of(line):
    return line[2:].split()[1]


@pytest.fixture
def shift_factory(tmp_path):
    """A factory file outside the repo: the Llama with the Hugging Face label shift inside forward()."""
    path = tmp_path / "shifted.py"
    path.write_text(textwrap.dedent(f"""
        import importlib.util, sys
        _spec = importlib.util.spec_from_file_location("cp_test_models", {os.path.join(REPO, "examples", "models.py")!r})
        models = importlib.util.module_from_spec(_spec)
        sys.modules["cp_test_models"] = models
        _spec.loader.exec_module(models)

        def factory(seq_len=64):
            return models.llama_factory(seq_len=seq_len, shift_labels_inside=True)
    """))
    return f"{path}:factory"


def test_dump_text_llama(capsys):
    code, out, err = run(["dump", LLAMA], capsys)
    assert code == 0, err
    before = out.split("== before", 1)[1].split("== after", 1)[0]
    assert "scaled_dot_product_attention" in before
    after = after_section(out)
    kinds = [kind_of(ln) for ln in after if ln.strip()]
    assert kinds.count("ring_attention") == 2
    assert kinds.count("grad_all_reduce") == 16
    assert kinds.count("grad_all_reduce_bucket") == 1
    assert kinds.count("gather") == 0
    assert kinds.count("shard") == 10  # input_ids, 4 RoPE cos/sin tables per layer, the loss target
    assert not [ln for ln in after if ln[2:].split()[2] == "scaled_dot_product_attention"]  # all replaced
    # every inserted node is marked, and the collectives are among them
    for ln in after:
        if kind_of(ln) in ("ring_attention", "shard", "grad_all_reduce", "grad_all_reduce_bucket"):
            assert ln.startswith("*"), ln
    # global -> local shapes, and source lines on copied nodes
    x = next(ln for ln in after if ln[2:].split()[0] == "x")
    assert "(2, 64, 64) -> (2, 32, 64)" in x
    assert "examples/models.py:" in x and "tok_emb(input_ids)" in x
    ring = next(ln for ln in after if kind_of(ln) == "ring_attention")
    assert "scaled_dot_product_attention" in ring  # the ring op carries the attention's source line
    q = next(ln for ln in after if ln[2:].split()[0] == "q")
    assert q.startswith("*") and "(2, 64, 4, 16) -> (2, 32, 4, 16)" in q  # view with a rewritten length


def test_dump_world_size_4_striped(capsys):
    code, out, _ = run(["dump", LLAMA, "--world-size", "4", "--seq-len", "128", "--load-balance", "striped"], capsys)
    assert code == 0
    assert "(2, 128, 64) -> (2, 32, 64)" in out
    assert "load balance striped" in out


def test_explain_llama_bytes_by_hand():
    model, ex = load_target(LLAMA)
    r = inspect(model, ex, world_size=4)
    B, H_kv, D, S, N, fp32 = 2, 2, 16, 64, 4, 4
    c = S // N
    kv_block = 2 * B * H_kv * c * D * fp32  # K and V of one hop
    acc_block = 2 * B * H_kv * c * D * 4  # the fp32 dK/dV accumulators of one hop
    by = {(x.phase, x.what): x for x in r.collectives}
    fwd = by[("forward", "ring K/V send+recv (p2p)")]
    assert (fwd.count, fwd.bytes) == (2 * (N - 1), 2 * (N - 1) * kv_block) == (6, 49152)
    bwd_kv = by[("backward", "ring K/V send+recv (p2p)")]
    assert (bwd_kv.count, bwd_kv.bytes) == (6, 49152)
    acc = by[("backward", "ring dK/dV send+recv (fp32)")]
    assert (acc.count, acc.bytes) == (2 * N, 2 * N * acc_block) == (8, 65536)
    # parameters: embedding and lm_head 256x64; per layer wq, wo 64x64, wk, wv 32x64, w1, w3, w2 128x64
    matrices = 2 * 256 * 64 + 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64)
    single = by[("backward", "grad all_reduce (parameters)")]
    assert (single.count, single.bytes) == (16, matrices * 4) == (16, 425984)
    bucket = by[("backward", "grad all_reduce (1-D parameter buckets)")]
    assert (bucket.count, bucket.bytes) == (1, 5 * 64 * 4)  # the 5 RMSNorm weights
    loss = by[("forward", "all_reduce (global loss / reductions)")]
    assert (loss.count, loss.bytes) == (2, 8)  # local loss sum and valid-token count, fp32 scalars
    assert r.shard_inputs == {"input_ids": 1}
    assert 0 < r.act_bytes_local < r.act_bytes_global / 2


def test_explain_text_llama(capsys):
    code, out, err = run(["explain", LLAMA], capsys)
    assert code == 0, err
    assert "attention: 2 node(s)" in out
    assert out.count("scaled_dot_product_attention") == 2
    assert "sharded inputs: input_ids (dim 1)" in out
    assert "fallbacks: none" in out
    assert "32,768 B" in out  # forward ring at N=2: 2 attention x 1 hop x 16,384 B
    assert "425,984 B" in out
    assert "crude upper bound" in out


def test_explain_shift_inside_has_one_fallback(shift_factory, capsys):
    code, out, err = run(["explain", shift_factory], capsys)
    assert code == 0, err
    assert "fallbacks: 1 op(s)" in out
    line = next(ln for ln in out.splitlines() if "logits[:, :-1, :]" in ln)
    assert re.search(r"models\.py:\d+", line)
    # gathered logits (B, S, V) = (2, 64, 256) fp32
    assert f"gathers {2 * 64 * 256 * 4:,} B" in out
    assert "all_gather (fallbacks)" in out and "reduce_scatter (fallbacks)" in out
    code, dump, _ = run(["dump", shift_factory], capsys)
    kinds = [kind_of(ln) for ln in after_section(dump) if ln.strip()]
    assert kinds.count("gather") == 1


def test_dump_html_and_dot(tmp_path, capsys):
    code, out, err = run(["dump", LLAMA, "--format", "html", "--out", str(tmp_path / "h")], capsys)
    assert code == 0, err
    files = os.listdir(tmp_path / "h")
    assert files == ["graph.html"]
    html = (tmp_path / "h" / "graph.html").read_text()
    assert html.count("<table>") == 2 and 'class="marked' in html and "<style>" in html
    assert "ring_attention" in html and "(2, 32, 64)" in html
    code, out, err = run(["dump", LLAMA, "--format", "dot", "--out", str(tmp_path / "d")], capsys)
    assert code == 0, err
    assert sorted(os.listdir(tmp_path / "d")) == ["after.dot", "before.dot"]
    dot = (tmp_path / "d" / "after.dot").read_text()
    assert dot.startswith("digraph") and dot.rstrip().endswith("}") and "ring_attention" in dot and "->" in dot


def test_svg_without_graphviz(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli_graph.shutil, "which", lambda name: None)
    code, _, err = run(["dump", LLAMA, "--format", "svg", "--out", str(tmp_path)], capsys)
    assert code == 2
    assert "graphviz" in err and "--format dot" in err and "--format html" in err


def test_bad_targets(tmp_path, capsys):
    code, _, err = run(["explain", "examples/models.py"], capsys)
    assert code == 2 and "path/to/file.py:factory" in err
    code, _, err = run(["explain", str(tmp_path / "missing.py") + ":f"], capsys)
    assert code == 2 and "does not exist" in err
    code, _, err = run(["explain", LLAMA.replace("llama_factory", "nope")], capsys)
    assert code == 2 and "no function 'nope'" in err and "llama_factory" in err and "gpt2_factory" in err
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\n"
                   "def boom(): raise RuntimeError('no weights here')\n"
                   "def single(): return torch.nn.Linear(2, 2)\n"
                   "def fixed(): return torch.nn.Linear(2, 2), (torch.zeros(1, 2),)\n")
    code, _, err = run(["explain", f"{bad}:boom"], capsys)
    assert code == 2 and "RuntimeError: no weights here" in err
    code, _, err = run(["explain", f"{bad}:single"], capsys)
    assert code == 2 and "(model, example_inputs)" in err and "Linear" in err
    code, _, err = run(["explain", f"{bad}:fixed", "--seq-len", "32"], capsys)
    assert code == 2 and "seq_len" in err and "--seq-len" in err


def test_bad_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        run(["dump", LLAMA, "--world-size", "1"], capsys)
    assert e.value.code == 2
    assert ">= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        run(["dump", LLAMA, "--stage", "optimizer"], capsys)
    assert e.value.code == 2


def test_no_attention_graph(tmp_path, capsys):
    f = tmp_path / "mlp.py"
    f.write_text("import torch\n"
                 "def factory(): return torch.nn.Linear(4, 4), (torch.zeros(2, 8, 4),)\n")
    code, out, err = run(["explain", f"{f}:factory"], capsys)
    assert code == 0, err
    assert "attention: none found" in out
    code, out, err = run(["dump", f"{f}:factory"], capsys)
    assert code == 0 and "unchanged (no attention" in out


def test_help_mentions_example(capsys):
    for cmd in ("dump", "explain"):
        with pytest.raises(SystemExit) as e:
            run([cmd, "--help"], capsys)
        assert e.value.code == 0
        assert "examples/models.py:llama_factory" in capsys.readouterr().out


def test_dump_backward_stage_shows_the_ring_and_every_gradient_all_reduce(capsys):
    """The per-rank backward graph AOTAutograd makes: 2 ring backward ops, and one all-reduce
    (+ wait) per matrix (16), for the bucket of 1-D norm scales (1) and for the global loss sum (1)."""
    code, out, _ = run(["dump", LLAMA, "--stage", "backward"], capsys)
    assert code == 0
    lines = [ln for ln in out.splitlines() if ln.startswith("*")]
    assert sum("ring_attention_bwd" in ln for ln in lines) == 2
    assert sum("_c10d_functional.all_reduce" in ln for ln in lines) == 16 + 1 + 1
    assert sum("wait_tensor" in ln for ln in lines) == 16 + 1 + 1
    code, out, _ = run(["dump", LLAMA, "--stage", "forward"], capsys)
    assert code == 0 and "ring_attention_fwd" in out and "== forward graph" in out


def test_dump_aot_stages_are_text_only(capsys):
    code, _, err = run(["dump", LLAMA, "--stage", "all", "--format", "html"], capsys)
    assert code == 2 and "--format text" in err
