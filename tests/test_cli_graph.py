"""``cp-compile dump`` / ``explain`` (cp_compile/tools/graph_commands.py, cp_compile/tools/explain.py).

Single process, no process group: the graph is traced once and rewritten for a
synthetic CP group. The subcommands are called through a local parser built with
the add_*_parser functions, so these tests do not depend on cli.py.
"""

from __future__ import annotations

import os
import textwrap

import pytest
import torch

from cp_compile.tools import graph_commands as cli_graph
from cp_compile.tools.explain import explain_model
from cp_compile.tools.targets import TargetError, example_inputs, load_target
from checks import LLAMA_TARGET, run_cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS_PY = os.path.join(REPO, "examples", "models.py")


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
        _spec = importlib.util.spec_from_file_location("cp_test_models", {MODELS_PY!r})
        models = importlib.util.module_from_spec(_spec)
        sys.modules["cp_test_models"] = models
        _spec.loader.exec_module(models)

        def factory(seq_len=64):
            return models.llama_factory(seq_len=seq_len, shift_labels_inside=True)
    """))
    return f"{path}:factory"


def test_dump_text_llama(capsys):
    code, out, err = run_cli(["dump", LLAMA_TARGET], capsys)
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


@pytest.mark.slow
def test_dump_world_size_4_striped(capsys):
    argv = ["dump", LLAMA_TARGET, "--world-size", "4", "--seq-len", "128", "--load-balance", "striped"]
    code, out, _ = run_cli(argv, capsys)
    assert code == 0
    assert "(2, 128, 64) -> (2, 32, 64)" in out
    assert "load balance striped" in out


@pytest.mark.slow
def test_explain_llama_bytes_by_hand():
    model, ex, kw = load_target(LLAMA_TARGET)
    assert kw == {}
    r = explain_model(model, ex, world_size=4, example_kwargs=kw)
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
    code, out, err = run_cli(["explain", LLAMA_TARGET], capsys)
    assert code == 0, err
    assert "attention: 2 node(s)" in out
    assert out.count("scaled_dot_product_attention") == 2
    assert "sharded inputs: input_ids (dim 1)" in out
    assert "fallbacks: none" in out
    assert "32,768 B" in out  # forward ring at N=2: 2 attention x 1 hop x 16,384 B
    assert "425,984 B" in out
    assert "crude upper bound" in out
    # every attention gets a mask line, read off its ring op: is_causal=True is the causal flag, no tensor
    assert out.count("mask: causal by position (no mask tensor)") == 2


@pytest.mark.slow
def test_explain_shift_inside_gathers_nothing(shift_factory, capsys):
    """The label shift inside forward() moves the labels, not the logits (passes/loss_shift.py)."""
    code, out, err = run_cli(["explain", shift_factory], capsys)
    assert code == 0, err
    assert "fallbacks: none" in out
    assert "all_gather (fallbacks)" not in out
    code, dump, _ = run_cli(["dump", shift_factory], capsys)
    kinds = [kind_of(ln) for ln in after_section(dump) if ln.strip()]
    assert kinds.count("gather") == 0


@pytest.mark.slow
def test_dump_html_and_dot(tmp_path, capsys):
    code, out, err = run_cli(["dump", LLAMA_TARGET, "--format", "html", "--out", str(tmp_path / "h")], capsys)
    assert code == 0, err
    files = os.listdir(tmp_path / "h")
    assert files == ["graph.html"]
    html = (tmp_path / "h" / "graph.html").read_text()
    assert html.count("<table>") == 2 and 'class="marked' in html and "<style>" in html
    assert "ring_attention" in html and "(2, 32, 64)" in html
    code, out, err = run_cli(["dump", LLAMA_TARGET, "--format", "dot", "--out", str(tmp_path / "d")], capsys)
    assert code == 0, err
    assert sorted(os.listdir(tmp_path / "d")) == ["after.dot", "before.dot"]
    dot = (tmp_path / "d" / "after.dot").read_text()
    assert dot.startswith("digraph") and dot.rstrip().endswith("}") and "ring_attention" in dot and "->" in dot


def test_svg_without_graphviz(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli_graph.shutil, "which", lambda name: None)
    code, _, err = run_cli(["dump", LLAMA_TARGET, "--format", "svg", "--out", str(tmp_path)], capsys)
    assert code == 2
    assert "graphviz" in err and "--format dot" in err and "--format html" in err


def test_bad_targets(tmp_path, capsys):
    code, _, err = run_cli(["explain", "examples/models.py"], capsys)
    assert code == 2 and "path/to/file.py:factory" in err
    code, _, err = run_cli(["explain", str(tmp_path / "missing.py") + ":f"], capsys)
    assert code == 2 and "does not exist" in err
    code, _, err = run_cli(["explain", LLAMA_TARGET.replace("llama_factory", "nope")], capsys)
    assert code == 2 and "no function 'nope'" in err and "llama_factory" in err and "gpt2_factory" in err
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\n"
                   "def boom(): raise RuntimeError('no weights here')\n"
                   "def single(): return torch.nn.Linear(2, 2)\n"
                   "def fixed(): return torch.nn.Linear(2, 2), (torch.zeros(1, 2),)\n")
    code, _, err = run_cli(["explain", f"{bad}:boom"], capsys)
    assert code == 2 and "RuntimeError: no weights here" in err
    code, _, err = run_cli(["explain", f"{bad}:single"], capsys)
    assert code == 2 and "(model, args), (model, kwargs) or (model, args, kwargs)" in err and "Linear" in err
    code, _, err = run_cli(["explain", f"{bad}:fixed", "--seq-len", "32"], capsys)
    assert code == 2 and "seq_len" in err and "--seq-len" in err


def test_bad_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        run_cli(["dump", LLAMA_TARGET, "--world-size", "1"], capsys)
    assert e.value.code == 2
    assert ">= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        run_cli(["dump", LLAMA_TARGET, "--stage", "optimizer"], capsys)
    assert e.value.code == 2


def test_no_attention_graph(tmp_path, capsys):
    f = tmp_path / "mlp.py"
    f.write_text("import torch\n"
                 "def factory(): return torch.nn.Linear(4, 4), (torch.zeros(2, 8, 4),)\n")
    code, out, err = run_cli(["explain", f"{f}:factory"], capsys)
    assert code == 0, err
    assert "attention: none found" in out
    code, out, err = run_cli(["dump", f"{f}:factory"], capsys)
    assert code == 0 and "unchanged (no attention" in out


def test_help_mentions_example(capsys):
    for cmd in ("dump", "explain"):
        with pytest.raises(SystemExit) as e:
            run_cli([cmd, "--help"], capsys)
        assert e.value.code == 0
        assert "examples/models.py:llama_factory" in capsys.readouterr().out


@pytest.mark.slow
def test_dump_backward_stage_shows_the_ring_and_every_gradient_all_reduce(capsys):
    """The per-rank backward graph AOTAutograd makes: 2 ring backward ops, and one all-reduce
    (+ wait) per matrix (16), for the bucket of 1-D norm scales (1) and for the global loss sum (1)."""
    code, out, _ = run_cli(["dump", LLAMA_TARGET, "--stage", "backward"], capsys)
    assert code == 0
    lines = [ln for ln in out.splitlines() if ln.startswith("*")]
    assert sum("ring_attention_bwd" in ln for ln in lines) == 2
    assert sum("_c10d_functional.all_reduce" in ln for ln in lines) == 16 + 1 + 1
    assert sum("wait_tensor" in ln for ln in lines) == 16 + 1 + 1
    code, out, _ = run_cli(["dump", LLAMA_TARGET, "--stage", "forward"], capsys)
    assert code == 0 and "ring_attention_fwd" in out and "== forward graph" in out


def test_dump_aot_stages_are_text_only(capsys):
    code, _, err = run_cli(["dump", LLAMA_TARGET, "--stage", "all", "--format", "html"], capsys)
    assert code == 2 and "--format text" in err


# -- the factory's return forms, as torch.export takes them: (model, args), (model, kwargs), (model, args, kwargs)
@pytest.fixture
def forms_factory(tmp_path):
    """Factories of the example Llama (forward(input_ids, labels=None)) returning each accepted form."""
    path = tmp_path / "forms.py"
    path.write_text(textwrap.dedent(f"""
        import importlib.util, sys
        _spec = importlib.util.spec_from_file_location("cp_test_models_forms", {MODELS_PY!r})
        models = importlib.util.module_from_spec(_spec)
        sys.modules["cp_test_models_forms"] = models
        _spec.loader.exec_module(models)

        def tensor_only():            # args as a single tensor: model(input_ids)
            model, (ids, labels) = models.llama_factory()
            return model, ids

        def kwargs_only():            # model(input_ids=ids, labels=labels)
            model, (ids, labels) = models.llama_factory()
            return model, {{"input_ids": ids, "labels": labels}}

        def args_and_kwargs():        # model(ids, labels=labels)
            model, (ids, labels) = models.llama_factory()
            return model, [ids], {{"labels": labels}}

        def ids_positional():
            model, (ids, labels) = models.llama_factory()
            return model, (ids,)
    """))
    return str(path)


def _without_target(text, target):
    return text.replace(target, "TARGET")


@pytest.mark.slow
@pytest.mark.parametrize("form,reference", [("tensor_only", "ids_positional"), ("kwargs_only", None),
                                            ("args_and_kwargs", None)])
def test_factory_return_forms_explain_and_dump(forms_factory, form, reference, capsys):
    """Each accepted form traces the very call its positional twin does: explain and dump print
    the same report (the example Llama's own factory returns (model, (input_ids, labels)))."""
    target = f"{forms_factory}:{form}"
    ref = f"{forms_factory}:{reference}" if reference else LLAMA_TARGET
    outs = {}
    for command in ("explain", "dump"):
        code, outs[command], err = run_cli([command, target], capsys)
        assert code == 0, err
        code, expected, err = run_cli([command, ref], capsys)
        assert code == 0, err
        assert _without_target(outs[command], target) == _without_target(expected, ref)
    assert "sharded inputs: input_ids (dim 1)" in outs["explain"] and "attention: 2 node(s)" in outs["explain"]
    has_loss = "all_reduce (global loss / reductions)" in outs["explain"]
    assert has_loss == (form != "tensor_only")  # labels given: the loss is a global mean


def test_example_inputs_normalises_the_forms_torch_export_takes():
    model, x, y = torch.nn.Linear(2, 2), torch.zeros(1, 2), torch.ones(1, 2)
    assert example_inputs((model, x)) == (model, (x,), {})
    assert example_inputs([model, [x, y]]) == (model, (x, y), {})
    assert example_inputs((model, {"input": x})) == (model, (), {"input": x})
    assert example_inputs((model, (x,), {"b": y})) == (model, (x,), {"b": y})
    assert example_inputs((model, (x,), None)) == (model, (x,), {})
    with pytest.raises(TargetError, match=r"\(model, args\), \(model, kwargs\) or \(model, args, kwargs\)"):
        example_inputs(())


def test_bad_factory_returns_list_the_accepted_forms(tmp_path, capsys):
    bad = tmp_path / "returns.py"
    bad.write_text(textwrap.dedent("""
        import torch
        x = torch.zeros(1, 2)
        def model_only_in_a_tuple(): return (torch.nn.Linear(2, 2),)
        def four_items(): return torch.nn.Linear(2, 2), (x,), {}, 1
        def kwargs_then_args(): return torch.nn.Linear(2, 2), {"input": x}, (x,)
        def a_number(): return torch.nn.Linear(2, 2), 3
        def inputs_first(): return (x,), torch.nn.Linear(2, 2)
        def keys_not_names(): return torch.nn.Linear(2, 2), {0: x}
        def unknown_keyword(): return torch.nn.Linear(2, 2), {"inputs": x}
    """))
    forms = "(model, args), (model, kwargs) or (model, args, kwargs)"
    returned = {"model_only_in_a_tuple": "a tuple of (Linear)", "four_items": "a tuple of (Linear, tuple, dict, int)",
                "kwargs_then_args": "a tuple of (Linear, dict, tuple)", "a_number": "a tuple of (Linear, int)",
                "inputs_first": "a tuple of (tuple, Linear)"}
    for name, got in returned.items():
        for command in ("explain", "dump"):
            code, _, err = run_cli([command, f"{bad}:{name}"], capsys)
            assert code == 2, (name, err)
            assert forms in err and f"it returned {got}" in err and "Fix: return" in err, err
            assert "torch.export" in err and "single tensor" in err, err
    code, _, err = run_cli(["explain", f"{bad}:keys_not_names"], capsys)
    assert code == 2 and "not argument names: [0]" in err and "Fix:" in err, err
    code, _, err = run_cli(["explain", f"{bad}:unknown_keyword"], capsys)
    assert code == 2 and "['inputs']" in err and "Linear.forward(input: torch.Tensor)" in err, err
    assert "Fix: key them by its parameter names (input)" in err, err


# -- the mask line: what the ring op is given, read off the rewritten graph -------------------------------
HF_PACKED = """
import torch, transformers

def _model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=256,
                                   attn_implementation="sdpa", pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.LlamaForCausalLM(cfg)

def _inputs(seq_len):
    ids = torch.randint(3, 128, (2, seq_len))
    half = seq_len // 2  # two documents packed in each row: positions restart at the second one
    pos = torch.cat([torch.arange(half), torch.arange(seq_len - half)])[None].expand(2, -1)
    return {"input_ids": ids, "position_ids": pos, "labels": ids}

def packed(seq_len=64):
    return _model(), {**_inputs(seq_len), "use_cache": False}

def packed_with_cache(seq_len=64):   # the KV cache makes Hugging Face ignore packing: a causal mask
    return _model(), _inputs(seq_len)
"""


@pytest.mark.slow
@pytest.mark.parametrize("world,seq_len", [(2, 64), (4, 60)])
def test_explain_hf_llama_packed_documents_states_the_document_ids(tmp_path, capsys, world, seq_len):
    """HF Llama called with keywords, position_ids restarting at each document and use_cache=False:
    HF builds a packed-document mask, whose document term becomes the ring op's ``doc_ids``: the
    whole (B, S) ids, int64, on every rank (S = 60 on 4 ranks pads to 64; the ids cover the 60
    real positions), and no attn_mask. explain states that form and its per-rank bytes, the ones
    of the ring op's doc_ids in the rewritten graph (cp_compile/backend/record.py)."""
    pytest.importorskip("transformers")
    path = tmp_path / "hf_packed.py"
    path.write_text(HF_PACKED)
    model, args, kwargs = load_target(f"{path}:packed", seq_len=seq_len)
    report = explain_model(model, args, world_size=world, example_kwargs=kwargs)
    B = 2
    rings = [n for n in report.after.graph.nodes if "ring_attention_fwd" in str(n.target)]
    given = [("attn_mask" in n.kwargs, tuple(n.kwargs["doc_ids"].meta["val"].shape)) for n in rings]
    assert given == [(False, (B, seq_len))] * 2, given  # what the ring ops are given
    argv = ["explain", f"{path}:packed", "--world-size", str(world), "--seq-len", str(seq_len)]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    lines = [ln.strip() for ln in out.splitlines() if ln.strip().startswith("mask")]
    size = "1.0 KiB" if B * seq_len * 8 == 1024 else f"{B * seq_len * 8} B"
    form = f"mask form: causal + documents; per rank: doc_ids ({B}, {seq_len}) int64 {size}"
    assert lines == ["mask: causal by position, documents by their ids (no mask tensor)", form] * 2, lines


@pytest.mark.slow
def test_explain_hf_llama_with_cache_still_prints_every_mask(tmp_path, capsys):
    """Without use_cache=False HF keeps its KV cache and skips the packed-document mask (is_causal=True):
    the graph explain traces has no mask tensor, and it says so for every attention rather than
    printing nothing."""
    pytest.importorskip("transformers")
    path = tmp_path / "hf_packed.py"
    path.write_text(HF_PACKED)
    code, out, err = run_cli(["explain", f"{path}:packed_with_cache"], capsys)
    assert code == 0, err
    assert out.count("mask: causal by position (no mask tensor)") == 2, out
