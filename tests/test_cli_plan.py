"""``cp-compile plan`` (cp_compile.tools.cli): numbers against hand arithmetic, docs/design.md §1's
overlap thresholds, argument errors (exit 2, naming the fix), output, and the module
entry point. Pure and single process; one subprocess for ``python -m cp_compile.tools.cli``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cp_compile.tools import cli
from cp_compile.tools.cli import HARDWARE, MODELS, main, overlap_threshold, plan_numbers

GIB = 2**30
CASE = ["plan", "--model", "llama-8b", "--seq-len", "131072", "--gpus", "8", "--hardware", "h100-nvlink"]


def test_published_parameter_counts():
    assert MODELS["llama-8b"].params == 8_030_261_248  # Meta-Llama-3-8B
    assert MODELS["llama-70b"].params == 70_553_706_496  # Meta-Llama-3-70B


def test_plan_llama8b_131k_8xh100_by_hand():
    """llama-8b, S = 131072, N = 8, H100 NVLink (989 TFLOP/s, 450 GB/s one way), bf16, causal zig-zag."""
    p = plan_numbers(MODELS["llama-8b"], HARDWARE["h100-nvlink"], 131072, 8)
    c, d, heads, kv_heads, b, f = 131072 // 8, 4096 // 32, 32, 8, 2, 0.5
    assert (p.seq_len, p.c, p.work_fraction) == (131072, 16384, 0.5)
    # forward step: 4 f c^2 d H FLOPs = 2.199e12; K+V of 8 KV heads = 2 c d H_kv b = 64 MiB
    assert p.fwd.flops == 4 * f * c * c * d * heads == 2_199_023_255_552
    assert p.fwd.bytes == 2 * c * d * kv_heads * b == 67_108_864
    assert p.fwd.compute_s == pytest.approx(2_199_023_255_552 / 989e12)  # 2.223 ms
    assert p.fwd.transfer_s == pytest.approx(67_108_864 / 450e9)  # 149 us
    # threshold (b/2)(H_kv/H)(1/f) F/B = 1 * 0.25 * 2 * 2197.8 = 1098.9 tokens; margin 16384 / 1098.9 = 14.91
    assert p.fwd.threshold == pytest.approx(0.25 * 2 * 989e12 / 450e9) == pytest.approx(1098.89, abs=0.01)
    assert p.margin == pytest.approx(14.9096, abs=1e-3)
    # backward: 10 f c^2 d H FLOPs; K, V (bf16) + dK, dV (fp32) = 2 c d H_kv (2 + 4) bytes
    assert p.bwd.flops == 10 * f * c * c * d * heads == 5_497_558_138_880
    assert p.bwd.bytes == 2 * c * d * kv_heads * 6 == 201_326_592
    assert p.bwd.threshold == pytest.approx(6 / 5 * 0.25 * 2 * 989e12 / 450e9)  # 1318.7
    # memory: 16 B/param; 34 h B/token/layer; vocab (2 + 4) B/token; 2 KV + 2 fp32 dKV blocks + fp32 out/dQ
    states = 16 * 8_030_261_248
    act = 32 * 34 * 4096 * c
    logits = 128256 * 6 * c
    ring = c * (2 * (2 * d * kv_heads) * 2 + 2 * (2 * d * kv_heads) * 4 + 4 * 4096)
    assert (p.states_bytes, p.act_bytes, p.logits_bytes, p.ring_bytes) == (states, act, logits, ring)
    assert p.total_bytes == states + act + logits + ring  # 200.0 GiB: does not fit 80 GiB
    assert p.total_bytes / GIB == pytest.approx(200.03, abs=0.01)
    assert p.max_seq_len == 0  # 128.5 GB of replicated model states alone exceed 80 GiB
    assert p.recommended == "zigzag"


def test_max_seq_len_solves_memory_for_s():
    """With --fsdp: S_max = (HBM - states/N) / (bytes per local token) * N, rounded down to 2N."""
    model, hw = MODELS["llama-8b"], HARDWARE["h100-nvlink"]
    p = plan_numbers(model, hw, 131072, 8, fsdp=True)
    per_tok = 32 * 34 * 4096 + 128256 * 6 + (2 * 2048 * 2 + 2 * 2048 * 4 + 4 * 4096)
    expected = int((80 * GIB - 16 * 8_030_261_248 / 8) / per_tok * 8) // 16 * 16
    assert p.max_seq_len == expected == 106064
    at = plan_numbers(model, hw, p.max_seq_len, 8, fsdp=True)
    above = plan_numbers(model, hw, p.max_seq_len + 16, 8, fsdp=True)
    assert at.total_bytes <= at.hbm_bytes < above.total_bytes


def test_design_thresholds():
    """docs/design.md §1: c >= (b/2) F/B = 520 (A100) / 1.1k (H100) tokens for bf16. That is the MHA,
    non-causal forward case with B = the *bidirectional* NVLink figure (600 / 900 GB/s)."""
    assert overlap_threshold(312, 600, 2) == pytest.approx(520, rel=0.1)
    assert overlap_threshold(989, 900, 2) == pytest.approx(1100, rel=0.1)
    # The ring uses one direction per block (send to r+1 while receiving from r-1), so with the
    # table's per-direction bandwidth the same MHA non-causal bound is twice docs/design.md's ...
    a100, h100 = HARDWARE["a100-nvlink"], HARDWARE["h100-nvlink"]
    assert overlap_threshold(a100.tflops, a100.gbps, 2) == pytest.approx(1040)
    assert overlap_threshold(h100.tflops, h100.gbps, 2) == pytest.approx(2197.8, abs=0.1)
    # ... while GQA (H_kv/H = 1/4 for llama-8b) and causal zig-zag (f = 1/2) scale it by 1/4 * 2,
    # which lands back on docs/design.md's numbers within 10%.
    for hw, design in ((a100, 520), (h100, 1100)):
        p = plan_numbers(MODELS["llama-8b"], hw, 131072, 8)
        assert p.fwd.threshold == pytest.approx(design, rel=0.1)
    # llama-70b (H_kv/H = 1/8), non-causal: 1/8 of the MHA bound
    p = plan_numbers(MODELS["llama-70b"], h100, 131072, 8, causal=False)
    assert p.fwd.threshold == pytest.approx(2197.8 / 8, abs=0.1)
    assert HARDWARE["h100-ib"].gbps == 50  # NDR 400 Gb/s: 9x the NVLink bound
    assert plan_numbers(MODELS["llama-8b"], HARDWARE["h100-ib"], 131072, 8).fwd.threshold == pytest.approx(9890)


def test_layouts_and_options():
    model, hw = MODELS["llama-8b"], HARDWARE["a100-nvlink"]
    contiguous = plan_numbers(model, hw, 4096, 4, load_balance="contiguous")
    assert contiguous.work_fraction == 1.0  # the ring waits for the rank that attends a full block
    assert plan_numbers(model, hw, 4096, 4, causal=False).recommended == "any"
    assert plan_numbers(model, hw, 1000, 8).seq_len == 1008  # padded to 2N = 16 for zig-zag
    assert plan_numbers(model, hw, 1000, 8, load_balance="striped").seq_len == 1000
    no_opt = plan_numbers(model, hw, 4096, 4, optimizer=False)
    assert no_opt.states_bytes == 4 * model.params  # bf16 weights + grads
    assert plan_numbers(model, hw, 4096, 4, fsdp=True).states_bytes == 16 * model.params / 4
    one, two = (plan_numbers(model, hw, 4096, 4, micro_batch=m) for m in (1, 2))
    assert (two.act_bytes, two.fwd.flops, two.fwd.threshold) == (2 * one.act_bytes, 2 * one.fwd.flops,
                                                                 one.fwd.threshold)
    fp32 = plan_numbers(model, hw, 4096, 4, dtype="fp32")
    assert fp32.fwd.threshold == pytest.approx(2 * plan_numbers(model, hw, 4096, 4).fwd.threshold)


def test_custom_specs():
    m = cli.parse_model("custom:32,4096,32,8")
    assert (m.layers, m.hidden, m.heads, m.kv_heads, m.ffn, m.vocab) == (32, 4096, 32, 8, 14336, 128256)
    assert m.params == MODELS["llama-8b"].params
    assert cli.parse_model("custom:2,256,4,2,512,1000").ffn == 512
    hw = cli.parse_hardware("custom:989,450,80")
    assert (hw.tflops, hw.gbps, hw.hbm_gib, hw.node_gpus, hw.inter_gbps) == (989.0, 450.0, 80.0, 8, None)
    hw = cli.parse_hardware("custom:989,450,80,4,25")
    assert (hw.tflops, hw.gbps, hw.hbm_gib, hw.node_gpus, hw.inter_gbps) == (989.0, 450.0, 80.0, 4, 25.0)


def test_ring_across_nodes_uses_the_inter_node_link(capsys):
    """h100-cluster: NVLink 450 GB/s inside nodes of 8, 50 GB/s between. The ring-only numbers use the
    node link for a ring of <= 8 GPUs, the inter-node link beyond (the ring waits for its slowest hop)."""
    model, hw = MODELS["llama-8b"], HARDWARE["h100-cluster"]
    inside, across = plan_numbers(model, hw, 131072, 8), plan_numbers(model, hw, 131072, 16)
    assert inside.fwd.transfer_s == pytest.approx(2 * 16384 * 128 * 8 * 2 / 450e9)
    assert across.fwd.transfer_s == pytest.approx(2 * 8192 * 128 * 8 * 2 / 50e9)
    assert across.bwd.transfer_s == pytest.approx(2 * 8192 * 128 * 8 * 6 / 50e9)
    assert across.fwd.threshold == pytest.approx(0.25 * 2 * 989e12 / 50e9)  # 9890 tokens > c = 8192
    # a custom profile with the same links gives the same numbers; a flat one (3 fields) the node link
    custom = cli.parse_hardware("custom:989,450,80,8,50")
    assert plan_numbers(model, custom, 131072, 16).fwd == across.fwd
    assert plan_numbers(model, cli.parse_hardware("custom:989,450,80"), 131072, 16).fwd.transfer_s == \
        pytest.approx(2 * 8192 * 128 * 8 * 2 / 450e9)
    assert main(["plan", "--model", "llama-8b", "--seq-len", "131072", "--gpus", "16", "--hardware",
                 "custom:989,450,80,8,50"]) == 0
    out = capsys.readouterr().out
    assert "450 GB/s per direction inside nodes of 8, 50 between nodes" in out
    assert "ring over 16 GPUs at 50 GB/s" in out and "transfer-bound" in out


@pytest.mark.parametrize("name", ["h100-cluster", "cpu-gloo", "a100-nvlink", "h200-nvlink"])
def test_every_profile_plans(capsys, name):
    assert main(["plan", "--model", "llama-8b", "--seq-len", "65536", "--gpus", "16", "--hardware", name]) == 0
    assert "cheapest  " in capsys.readouterr().out


@pytest.mark.parametrize("change, fix", [
    ({"--model": "llama-9b"}, "choose one of llama-8b, llama-70b or custom:LAYERS,HIDDEN,HEADS,KV_HEADS"),
    ({"--model": "custom:32,4096"}, "expected custom:LAYERS,HIDDEN,HEADS,KV_HEADS"),
    ({"--model": "custom:32,4096,x,8"}, "with positive numbers, e.g. custom:32,4096,32,8"),
    ({"--model": "custom:32,4096,30,8"}, "HIDDEN must divide by HEADS and HEADS by KV_HEADS"),
    ({"--hardware": "tpu"}, "choose one of a100-nvlink, h100-nvlink, h100-ib, h200-nvlink, h100-cluster, cpu-gloo "
                            "or custom:TFLOPS,GBPS,HBM_GIB[,NODE_GPUS,INTER_GBPS]"),
    ({"--hardware": "custom:989,450"}, "expected custom:TFLOPS,GBPS,HBM_GIB[,NODE_GPUS,INTER_GBPS]"),
    ({"--hardware": "custom:989,-1,80"}, "expected custom:TFLOPS,GBPS,HBM_GIB"),
    ({"--hardware": "custom:989,450,80,8"}, "expected custom:TFLOPS,GBPS,HBM_GIB[,NODE_GPUS,INTER_GBPS]"),
    ({"--hardware": "custom:989,450,80,7.5,50"}, "NODE_GPUS must be a whole number of devices, got 7.5"),
    ({"--gpus": "0"}, "argument --gpus: expected a positive integer, got '0'"),
    ({"--seq-len": "128k"}, "argument --seq-len: expected a positive integer, got '128k'"),
    ({"--dtype": "fp8"}, "argument --dtype: invalid choice: 'fp8' (choose from"),
    ({"--load-balance": "ring"}, "argument --load-balance: invalid choice: 'ring' (choose from"),
])
def test_bad_arguments_exit_2_naming_the_fix(capsys, change, fix):
    argv = list(CASE)
    for flag, value in change.items():
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert fix in capsys.readouterr().err


def test_missing_subcommand_or_argument_exit_2(capsys):
    for argv in ([], ["plan", "--model", "llama-8b"], ["dump"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
    assert "required" in capsys.readouterr().err


def test_main_prints_the_plan(capsys):
    assert main(CASE + ["--fsdp"]) == 0
    out = capsys.readouterr().out
    for line in ("c = S/N = 16384 tokens per GPU", "memory per GPU", "model states", "activations",
                 "ring buffers", "total ", "forward   compute 2.2 TFLOP = 2.22 ms, transfer 64 MiB = 149 us",
                 "overlap   c >= 1099 tokens", "margin c / threshold = 14.91x",
                 "max sequence length that fits on 8 GPUs: S = 106064", "load balance: recommended zigzag"):
        assert line in out, line
    assert sorted(cli.COMMANDS) == ["doctor", "dump", "explain", "plan"]


def test_main_warns_contiguous_causal_and_nothing_fits(capsys):
    assert main(CASE + ["--load-balance", "contiguous"]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "none (model states fill HBM" in out
    assert "warning: causal contiguous is ~1.88x slower than zigzag" in out


@pytest.mark.slow
def test_module_entry_point():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    run = lambda *a: subprocess.run([sys.executable, "-m", "cp_compile.tools.cli", *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=120, env=env)
    ok = run(*CASE, "--no-causal")
    assert ok.returncode == 0, ok.stderr
    assert "overlap   c >= 549 tokens" in ok.stdout and "recommended any (non-causal" in ok.stdout
    bad = run("plan", "--model", "llama-9b", "--seq-len", "1", "--gpus", "1", "--hardware", "h100-nvlink")
    assert bad.returncode == 2 and "choose one of llama-8b" in bad.stderr
    helped = run("plan", "--help")
    assert helped.returncode == 0 and "examples:" in helped.stdout and "Korthikanti" in helped.stdout
