"""``cp-compile plan``'s strategy comparison (cp_compile.tools.plan_strategies, priced by
cp_compile.ulysses.cost): the table's bytes and memory against formulas derived here from the
definitions (MHA; GQA with H_kv < u; H not dividing u), who wins where, every ``--strategy`` value,
``--ulysses-degree`` and its errors (exit 2 naming the fix). Pure, single process.
"""

from __future__ import annotations

import pathlib
import shlex

import pytest

from cp_compile.hardware import HARDWARE
from cp_compile.tools import cli
from cp_compile.tools.cli import main, plan_numbers
from cp_compile.tools.plan_strategies import default_ulysses_degree, fmt_bytes, strategy_costs
from cp_compile.ulysses.cost import AttentionShape, strategy_cost

MIB = 2**20


def hand(batch, heads_per_rank, kv_per_rank, head_dim, c, u, r, e):
    """Bytes one rank sends per attention per training step, and its attention operands, from the
    definitions. Ulysses over u ranks: each rank holds c tokens of every head and must end with u·c
    tokens of its hq query heads and m K/V heads; an all-to-all keeps 1/u of a tensor and sends the
    rest, so forward it sends (u-1)·c·hq rows of q, (u-1)·c·m of k and of v, and (u-1)·c·hq of out
    (back to the sequence layout); the backward moves dout, dq, dk, dv the same way. Ring over r ranks:
    a K/V block is K and V of u·c tokens and m heads; forward it hops r-1 times, backward r-1 times
    plus its fp32 dK/dV accumulator r times (back home). Memory: head-sharded q, k, v, out (u·c tokens)
    when u > 1; two K/V blocks and two fp32 accumulators when r > 1."""
    row = batch * head_dim * e  # one token of one head
    a2a = 2 * (u - 1) * c * row * (2 * heads_per_rank + 2 * kv_per_rank) if u > 1 else 0
    block = 2 * (u * c) * kv_per_rank * row
    acc = block * max(4, e) // e
    ring_kv, ring_acc = (2 * (r - 1) * block, r * acc) if r > 1 else (0, 0)
    heads_mem = (u * c) * row * (2 * heads_per_rank + 2 * kv_per_rank) if u > 1 else 0
    memory = heads_mem + (2 * block + 2 * acc if r > 1 else 0)
    return {"a2a_bytes": a2a, "ring_kv_bytes": ring_kv, "ring_acc_bytes": ring_acc,
            "total_bytes": a2a + ring_kv + ring_acc, "memory_bytes": memory}


def table(out: str) -> dict:
    """{strategy: its row of the table} from ``plan``'s output."""
    rows = {}
    for line in out.splitlines():
        words = line.split()
        if len(words) > 4 and words[0] in ("ring", "ulysses", "2d") and words[2] == "x":
            rows[words[0]] = line
    return rows


# (model, S, N, extra flags, c, e, micro-batch, {strategy: (u, r, hq, m)}, head-split text per strategy)
CASES = {
    # MHA, H = 8, H_kv = 8, d = 64; N = 4: Ulysses u = 4 gives 2 q heads and their own 2 K/V heads per rank;
    # default 2d degree: min(8 GPUs per node, 4) = 4 = N, so N's largest proper divisor, 2
    "mha": ("custom:2,512,8,8", 128, 4, [], 32, 2, 1,
            {"ring": (1, 4, 8, 8), "ulysses": (4, 1, 2, 2), "2d": (2, 2, 4, 4)},
            {"ulysses": "heads 8 -> 2/rank, K/V 8 -> 2/rank;", "2d": "heads 8 -> 4/rank, K/V 8 -> 4/rank;"}),
    # GQA H = 8, H_kv = 2 (groups of 4 q heads), d = 32, fp32, S = 201 padded to 2N = 16's multiple 208.
    # u = 8: 1 q head per rank, reading 1 K/V head: 8 slots for 2 heads, each sent 4 times.
    # u = 4 (asked): q heads 2j, 2j+1 lie in one group: 1 K/V head per rank, each sent twice.
    "gqa": ("custom:2,256,8,2", 201, 8, ["--dtype", "fp32", "--ulysses-degree", "4"], 26, 4, 1,
            {"ring": (1, 8, 8, 2), "ulysses": (8, 1, 1, 1), "2d": (4, 2, 2, 1)},
            {"ulysses": "heads 8 -> 1/rank, K/V 2 -> 1/rank (replicated x4)",
             "2d": "heads 8 -> 2/rank, K/V 2 -> 1/rank (replicated x2)"}),
    # H = 6 (groups of 3: q 0-2 read K/V 0, 3-5 K/V 1), d = 64, micro-batch 3. u = 4: ceil(6/4) = 2 q heads
    # per rank, padded to 8; rank 1 holds q 2, 3, which read K/V 0 and 1, so every rank gets 2 K/V slots
    # (8 for 2 heads: x4). u = 2: q 0-2 / 3-5, one K/V head each, nothing replicated.
    "padded": ("custom:2,384,6,2", 120, 4, ["--micro-batch", "3"], 30, 2, 3,
               {"ring": (1, 4, 6, 2), "ulysses": (4, 1, 2, 2), "2d": (2, 2, 3, 1)},
               {"ulysses": "heads 6 -> 2/rank (padded to 8: 2 zero heads), K/V 2 -> 2/rank (replicated x4)",
                "2d": "heads 6 -> 3/rank, K/V 2 -> 1/rank;"}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_table_bytes_by_hand(capsys, case):
    spec, S, N, flags, c, e, batch, splits, head_text = CASES[case]
    model = cli.parse_model(spec)
    assert main(["plan", "--model", spec, "--seq-len", str(S), "--gpus", str(N), "--hardware", "h100-nvlink",
                 *flags]) == 0
    out = capsys.readouterr().out
    rows = table(out)
    assert sorted(rows) == sorted(splits)
    shape = AttentionShape(batch, model.heads, model.kv_heads, model.hidden // model.heads, c * N, e, True)
    u2d = splits["2d"][0]
    costs = {x.strategy: x for x in strategy_costs(shape, N, HARDWARE["h100-nvlink"], "all", u2d)}
    for name, (u, r, hq, m) in splits.items():
        expected = hand(batch, hq, m, model.hidden // model.heads, c, u, r, e)
        assert max(expected.values()) < MIB  # small enough that the table prints exact bytes
        got = costs[name]
        assert (got.u, got.r) == (u, r)
        assert {k: getattr(got, k) for k in expected} == expected, name
        words = rows[name].split()
        assert words[1:4] == [str(u), "x", str(r)]
        printed = [expected[k] for k in ("a2a_bytes", "ring_kv_bytes", "ring_acc_bytes", "total_bytes")]
        assert " ".join(words[4:12]) == " ".join(fmt_bytes(b) for b in printed)
        assert rows[name].rstrip().endswith(fmt_bytes(expected["memory_bytes"]))
    for name, text in head_text.items():
        assert f"  {name:8} {text}" in out


def test_cost_memory_and_time_parts():
    """cost.py's memory_bytes and the parts of its seconds, for the 2-D split of llama-8b on 16 H100s."""
    shape = AttentionShape(1, 32, 8, 128, 131072, 2, True)
    hw = HARDWARE["h100-cluster"]
    two_d = strategy_cost(shape, 16, "2d", 8, hw)
    c = 131072 // 16
    # u = 8: 4 q heads, 1 K/V head per rank, 8·c tokens; ring over 2: blocks of 8·c tokens, 1 head
    heads = 8 * c * 128 * 2 * (2 * 4 + 2 * 1)
    block = 2 * 8 * c * 128 * 2
    assert two_d.memory_bytes == heads + 2 * block + 2 * 2 * block
    fwd_flops = 4 * 0.5 * 131072 * c * 128 * 32  # causal: half of this rank's c x S pairs, all 32 heads
    assert two_d.compute_seconds == pytest.approx(3.5 * fwd_flops / 989e12)
    assert two_d.a2a_seconds == pytest.approx(two_d.a2a_bytes / 450e9)  # inside a node of 8
    assert two_d.ring_hidden and two_d.seconds == pytest.approx(two_d.compute_seconds + two_d.a2a_seconds)
    ulysses = strategy_cost(shape, 16, "ulysses", hw=hw)
    assert ulysses.a2a_seconds == pytest.approx(ulysses.a2a_bytes / 50e9)  # 16 ranks: across nodes
    assert ulysses.seconds == pytest.approx(ulysses.compute_seconds + ulysses.a2a_seconds)
    ring = strategy_cost(shape, 16, "ring", hw=hw)
    assert not ring.ring_hidden and ring.seconds > ring.compute_seconds and ring.a2a_seconds == 0
    assert strategy_cost(shape, 16, "ring").memory_bytes == 2 * (2 * c * 8 * 128 * 2) * (1 + 2)


def test_ring_hidden_agrees_with_the_ring_step_numbers():
    """The ring row's 'hidden' (cost.py) and the ring-only section (compute >= transfer per step) agree."""
    for gpus, hw in ((8, "h100-nvlink"), (16, "h100-cluster"), (16, "h100-ib"), (4, "a100-nvlink")):
        for S in (16384, 131072, 1048576):
            p = plan_numbers(cli.MODELS["llama-8b"], HARDWARE[hw], S, gpus)
            shape = cli.attention_shape(cli.MODELS["llama-8b"], p.seq_len, "bf16", True, 1)
            ring = strategy_costs(shape, gpus, HARDWARE[hw], "ring", None)[0]
            both = p.fwd.compute_s >= p.fwd.transfer_s and p.bwd.compute_s >= p.bwd.transfer_s
            assert ring.ring_hidden == both, (gpus, hw, S)


def run(capsys, *argv):
    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out


def cheapest(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("cheapest  ")).split()[1]


def test_ulysses_beats_ring_when_the_ring_is_transfer_bound(capsys):
    """llama-8b, S = 128k on 16 GPUs over InfiniBand (50 GB/s): c = 8192 is below the ring's overlap threshold
    (~9.9k tokens), so the ring is transfer-bound; Ulysses moves ~5x fewer bytes (360 MiB against 1984)."""
    argv = ["--model", "llama-8b", "--seq-len", "131072", "--gpus", "16", "--hardware", "h100-ib"]
    out = run(capsys, *argv, "--strategy", "all")
    shape = cli.attention_shape(cli.MODELS["llama-8b"], 131072, "bf16", True, 1)
    by = {c.strategy: c for c in strategy_costs(shape, 16, HARDWARE["h100-ib"], "all", None)}
    assert by["ulysses"].seconds < by["ring"].seconds and not by["ring"].ring_hidden
    assert by["ulysses"].total_bytes * 5 < by["ring"].total_bytes
    assert "ring-bound" in table(out)["ring"]
    # across nodes of an H100 cluster, 2-D keeps the all-to-all on NVLink and its short ring hides: it wins
    out = run(capsys, *argv[:-1], "h100-cluster")
    assert cheapest(out) == "2d"
    assert "all-to-all over 8 ranks at 450 GB/s (inside a node); ring over 2 ranks 8 apart at 50 GB/s" in out
    assert "ulysses: its all-to-all over 16 ranks is exposed, " in out


def test_ring_wins_when_heads_do_not_split(capsys):
    """4 heads on 16 GPUs: Ulysses pads to 16 heads (4x the attention FLOPs), 2-D to 8 (2x); on NVLink with
    c = 16384 the ring's transfer hides, so the ring is cheapest."""
    out = run(capsys, "--model", "custom:2,512,4,4", "--seq-len", "262144", "--gpus", "16", "--hardware",
              "h100-nvlink")
    assert cheapest(out) == "ring"
    assert "ring hidden" in table(out)["ring"]
    assert "heads 4 -> 1/rank (padded to 16: 12 zero heads), K/V 4 -> 1/rank (replicated x4)" in out
    assert "2d: pads 4 heads to 8 over u = 8 ranks (2x the attention FLOPs)" in out


@pytest.mark.parametrize("strategy, rows", [("ring", ["ring"]), ("ulysses", ["ulysses"]), ("2d", ["2d"]),
                                            ("all", ["2d", "ring", "ulysses"])])
def test_every_strategy_value_runs(capsys, strategy, rows):
    out = run(capsys, "--model", "llama-8b", "--seq-len", "65536", "--gpus", "8", "--hardware", "h100-nvlink",
              "--strategy", strategy)
    assert sorted(table(out)) == rows
    assert ("cheapest  " in out) == (len(rows) > 1)
    if strategy in ("2d", "all"):  # 8 GPUs, nodes of 8: u = 8 would be Ulysses, so N's largest proper divisor
        assert table(out)["2d"].split()[1:4] == ["4", "x", "2"]


def test_contiguous_causal_notes_the_balanced_assumption(capsys):
    out = run(capsys, "--model", "llama-8b", "--seq-len", "65536", "--gpus", "8", "--hardware", "h100-nvlink",
              "--load-balance", "contiguous")
    assert "note      the strategy table prices a balanced causal layout" in out
    assert "note      " not in run(capsys, "--model", "llama-8b", "--seq-len", "65536", "--gpus", "8", "--hardware",
                                   "h100-nvlink", "--load-balance", "contiguous", "--no-causal")


def test_ulysses_degree_and_its_default(capsys):
    out = run(capsys, "--model", "llama-8b", "--seq-len", "65536", "--gpus", "16", "--hardware", "h100-nvlink",
              "--strategy", "2d", "--ulysses-degree", "2")
    assert table(out)["2d"].split()[1:4] == ["2", "x", "8"]
    cluster, flat = HARDWARE["h100-cluster"], cli.parse_hardware("custom:989,450,80,6,50")
    assert [default_ulysses_degree(cluster, n) for n in (1, 2, 7, 8, 12, 16, 64)] == [1, 1, 1, 4, 6, 8, 8]
    assert [default_ulysses_degree(flat, n) for n in (6, 12, 8)] == [3, 6, 4]
    out = run(capsys, "--model", "llama-8b", "--seq-len", "65536", "--gpus", "7", "--hardware", "h100-nvlink")
    assert sorted(table(out)) == ["ring", "ulysses"] and "2d       not planned: needs a u with 1 < u < N" in out
    out = run(capsys, "--model", "llama-8b", "--seq-len", "65536", "--gpus", "1", "--hardware", "h100-nvlink")
    assert sorted(table(out)) == ["ring"] and "ulysses  not planned: needs N > 1" in out


@pytest.mark.parametrize("flags, fix", [
    (["--gpus", "16", "--ulysses-degree", "3"], "--ulysses-degree 3 must divide --gpus 16 and lie strictly between "
                                                "1 and 16 (u = 1 is the ring, u = N Ulysses). Fix: --ulysses-degree "
                                                "one of 2, 4, 8."),
    (["--gpus", "16", "--ulysses-degree", "16"], "Fix: --ulysses-degree one of 2, 4, 8."),
    (["--gpus", "16", "--ulysses-degree", "1"], "Fix: --ulysses-degree one of 2, 4, 8."),
    (["--gpus", "16", "--ulysses-degree", "0"], "argument --ulysses-degree: expected a positive integer"),
    (["--gpus", "16", "--strategy", "ring", "--ulysses-degree", "4"], "Fix: drop --ulysses-degree, or --strategy 2d"),
    (["--gpus", "16", "--strategy", "ulysses", "--ulysses-degree", "4"], "applies to --strategy 2d or all"),
    (["--gpus", "7", "--strategy", "2d"], "--strategy 2d needs a u with 1 < u < N dividing N = 7 (none exists"),
    (["--gpus", "1", "--strategy", "ulysses"], "--strategy ulysses needs --gpus > 1. Fix: more GPUs"),
    (["--gpus", "8", "--strategy", "tree"], "argument --strategy: invalid choice: 'tree'"),
])
def test_bad_strategy_arguments_exit_2_naming_the_fix(capsys, flags, fix):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "llama-8b", "--seq-len", "65536", "--hardware", "h100-cluster", *flags])
    assert e.value.code == 2
    assert fix in capsys.readouterr().err


def test_documented_examples_run(capsys):
    """Every ``cp-compile plan`` line of the --help examples and of docs/debugging.md runs."""
    doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "debugging.md").read_text()
    lines = [ln.strip() for ln in (cli.PLAN_EXAMPLES + doc).splitlines() if ln.strip().startswith("cp-compile plan ")]
    assert len(lines) >= 6
    for line in lines:
        assert main(shlex.split(line)[1:]) == 0, line
        assert "strategies, per attention layer" in capsys.readouterr().out
