"""Ulysses and 2-D context parallelism (``strategy="ulysses" | "2d" | "auto"``) against one process.

* :class:`cp_compile.ulysses.heads.HeadPlan`: every rank's local query head reads, through the kernel's
  GQA rule, the K/V head its global head reads; padding and replication as documented.
* The all-to-all ops on gloo (N = 2, 4; zig-zag, striped, contiguous, a positions table): what
  ``seq_to_heads`` gives a rank is the whole tensor's slice it should hold, ``heads_to_seq`` undoes it,
  and the two are adjoint (so each one's backward, the other, is exact).
* Models compiled with ring_cp under each strategy at N = 2 and 4 (2 x 2 for 2-D): loss and every
  parameter gradient within 1e-5 of the eager one-process run on the whole sequence; the all-to-alls in
  the graph; explain's record (strategy and why included) equal to the runtime's. The cases cover GQA
  with fewer K/V heads than the degree, MQA, heads that do not divide the degree (padding), mods that
  index heads (ALiBi slopes, a learned T5 table), documents as a mask_mod and as the layout, an explicit
  per-query mask (bool, and additive per head), striped, and a length that needs padding.
* ``auto``'s choice from the cost model, the option errors, and the fallback WARNING.
"""

from __future__ import annotations

import pytest
import torch

import flex_models
import models
import packed

from checks import MaskedAttention, cp_compile_warnings, explain_record, grad_errors, masked_inputs, rel
from cp_compile.hardware import HARDWARE
from cp_compile.ulysses.choose import choose
from cp_compile.ulysses.cost import AttentionShape
from cp_compile.ulysses.heads import HeadPlan

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
TOL = 1e-5


# --------------------------------------------------------------------------- head plans (pure)
@pytest.mark.parametrize("H,Hkv,u,hq,m", [(8, 8, 2, 4, 4), (8, 2, 4, 2, 1), (8, 1, 2, 4, 1), (6, 6, 4, 2, 2),
                                          (6, 2, 4, 2, 2), (12, 3, 8, 2, 1), (4, 2, 4, 1, 1), (2, 2, 4, 1, 1)])
def test_head_plan_reads_the_right_kv_head(H, Hkv, u, hq, m):
    plan = HeadPlan(H, Hkv, u)
    assert (plan.per_rank, plan.kv_per_rank, plan.padded) == (hq, m, hq * u)
    kv = plan.kv_index()
    for j in range(u):
        for i in range(hq):
            g = j * hq + i
            if g >= H:  # a zero head: its query is zero and its output dropped
                assert plan.q_index()[g] == -1
                continue
            local_kv = kv[j * m + i // (hq // m)]  # the kernel's GQA rule on the rank's heads
            assert local_kv == g // (H // Hkv), (j, i)
            assert plan.head_map(j)[i] == g


# --------------------------------------------------------------------------- the all-to-all ops on gloo
def _ops_on_rank(layout: str, u: int) -> dict:
    """seq_to_heads / heads_to_seq of a known whole tensor, on this rank."""
    import torch.distributed as dist

    import cp_compile
    from cp_compile.group import resolve_group
    from cp_compile.ulysses.groups import sub_groups

    n, S, B, H, D = dist.get_world_size(), 32, 2, 6, 3
    cp = resolve_group(None)
    uly, _ = sub_groups(cp, u)
    table = None
    if layout == "table":  # a per-batch layout: rank r holds a random sorted set of positions
        perm = torch.randperm(S, generator=torch.Generator().manual_seed(0))
        table = perm.view(n, S // n).sort(1).values
    lb = "zigzag" if layout == "table" else layout
    full = torch.randn(B, H, S, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    pos = table[cp.rank] if table is not None else cp_compile.positions(S, load_balance=lb)
    x = full[:, :, pos].clone().requires_grad_()  # (B, H, c, D)
    plan = HeadPlan(H, 2, u)  # K/V-like: 2 heads, replicated as the plan says
    args = dict(u=u, group_name=uly.name, cp_name=cp.name, load_balance=lb, positions=table)
    y = torch.ops.cp_compile.seq_to_heads(x, plan.kv_index(), **args)  # (B, m, u·c, D)
    i = cp.rank // u
    rows = table[i * u:(i + 1) * u] if table is not None else torch.stack(
        [_rank_pos(S, n, i * u + j, lb) for j in range(u)])  # the row's CP ranks' positions
    mine = rows.reshape(-1).sort().values
    want = full[:, plan.kv_index()[uly.rank * plan.kv_per_rank:(uly.rank + 1) * plan.kv_per_rank]][:, :, mine]
    q = torch.ops.cp_compile.seq_to_heads(x, plan.q_index(), **args)
    back = torch.ops.cp_compile.heads_to_seq(q, H, plan.q_index(), **args)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(2 + cp.rank), dtype=torch.float64)
    (y * g).sum().backward()  # <seq_to_heads(x), g> = <x, heads_to_seq(g)>: summed over ranks below
    lhs = torch.tensor([(y.detach() * g).sum().item(), (x.detach() * x.grad).sum().item()], dtype=torch.float64)
    dist.all_reduce(lhs)
    return {"slice": (y.detach() - want).abs().max().item(), "roundtrip": (back - x.detach()).abs().max().item(),
            "adjoint": abs(lhs[0].item() - _pair(x, g, plan, args)) / abs(lhs[0].item())}


def _rank_pos(S: int, n: int, r: int, lb: str) -> torch.Tensor:
    from cp_compile.sequence import rank_positions

    return rank_positions(S, n, r, lb)


def _pair(x, g, plan, args) -> float:
    """<x, heads_to_seq(g)> summed over the ranks."""
    import torch.distributed as dist

    back = torch.ops.cp_compile.heads_to_seq(g, x.shape[1], plan.kv_index(), **args)
    t = torch.tensor([(x.detach() * back).sum().item()], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item()


@pytest.mark.parametrize("world,u,layout", [(2, 2, "zigzag"), (4, 4, "striped"), (4, 2, "zigzag"),
                                            (4, 2, "contiguous"), (4, 2, "table")])
def test_all_to_all_ops_slice_undo_and_are_adjoint(ranks, world, u, layout):
    for rank, r in enumerate(ranks.run(world, _ops_on_rank, layout, u, timeout=120)):
        assert r["slice"] == 0 and r["roundtrip"] == 0, (rank, r)
        assert r["adjoint"] < 1e-12, (rank, r)


# --------------------------------------------------------------------------- models under each strategy
def _make(source: str, kw: dict):
    if source == "llama":
        return models.llama_factory(**kw)
    if source.startswith("masked_"):  # a mask passed in: (B, 1, S, S) bool or (B, 2, S, S) additive
        inputs = masked_inputs(source[len("masked_"):], kw.get("seq_len", 24))
        return MaskedAttention("given"), (inputs["x"], None, inputs["given"])
    if source == "packed":
        return packed.doc_attention_factory(**kw)
    return flex_models.FACTORIES[source](**kw)


def _through(source: str, kw: dict, options: dict) -> dict:
    """On a rank: ``source``'s model through ring_cp with ``options`` against the eager one-process run."""
    import torch.distributed as dist

    import cp_compile

    torch._dynamo.reset()
    ref_model, inputs = _make(source, kw)
    cp_model, _ = _make(source, kw)
    with torch._dynamo.config.patch(specialize_float=True):
        explained = explain_record(ref_model, inputs, world_size=dist.get_world_size(), **options)
        ref = ref_model(*inputs)
        ref.backward()
        backend = cp_compile.RingCP(inner="aot_eager", **options)
        out = torch.compile(cp_model, backend=backend, fullgraph=True)(*inputs)
        out.backward()
    a2a = torch.ops.cp_compile.seq_to_heads.default
    return {"loss": rel(out.detach(), ref.detach()), "grad": max(grad_errors(cp_model, ref_model).values()),
            "record": backend.records == [explained], "fallbacks": list(backend.fallbacks),
            "a2a": sum(n.target is a2a for gm in backend.graphs for n in gm.graph.nodes),
            "strategies": backend.records[0].strategies}


U2 = {"strategy": "ulysses"}
D2 = {"strategy": "2d", "ulysses_degree": 2}
CASES = {  # id: (world, source, factory kwargs, options, Ulysses-wrapped tensors per attention)
    # (the Llama under ulysses at N = 2: tests/test_options.py's strategy=ulysses row)
    "llama_gqa_ulysses_4_kv_replicated": (4, "llama", {"seq_len": 32}, U2, 3),
    "llama_2d_2x2": (4, "llama", {"seq_len": 32}, D2, 3),
    "llama_mqa_ulysses_2": (2, "llama", {"seq_len": 32, "n_kv_heads": 1}, U2, 3),
    "llama_6_heads_padded_on_4": (4, "llama", {"seq_len": 32, "dim": 48, "n_heads": 6, "n_kv_heads": 3}, U2, 3),
    "llama_odd_length_2d_striped": (4, "llama", {"seq_len": 30}, {**D2, "load_balance": "striped"}, 3),
    "alibi_slopes_by_head_ulysses_4": (4, "alibi", {}, U2, 3),
    "t5_learned_table_2d": (4, "t5_bias", {}, D2, 3),
    "documents_mask_mod_2d": (4, "document_input", {}, D2, 3),
    "documents_layout_2d": (4, "packed", {}, {**D2, "load_balance": "documents"}, 3),
    "explicit_bool_rows_ulysses_2": (2, "masked_given", {}, U2, 4),
    "explicit_additive_per_head_2d": (4, "masked_given_additive", {}, D2, 4),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_strategy_is_exact(ranks, case):
    world, source, kw, options, wrapped = CASES[case]
    for rank, r in enumerate(ranks.run(world, _through, source, kw, options, timeout=300)):
        assert r["loss"] <= TOL and r["grad"] <= TOL, (rank, case, r)
        assert r["record"] and r["fallbacks"] == [], (rank, case, r)
        assert r["a2a"] == wrapped * len(r["strategies"]) >= wrapped, (rank, case, r)  # q, k, v (and a mask)
        assert all(s.startswith(options["strategy"]) for s in r["strategies"]), (rank, case, r)


@pytest.mark.slow
@pytest.mark.parametrize("hardware", ["h100-ib", "custom:0.1,1,24,2,0.5"])
def test_auto_is_exact_and_says_why(ranks, hardware):
    for rank, r in enumerate(ranks.run(4, _through, "llama", {"seq_len": 32},
                                       {"strategy": "auto", "hardware": hardware}, timeout=300)):
        assert r["loss"] <= TOL and r["grad"] <= TOL and r["record"], (rank, r)
        assert all(f"auto on {hardware}: cheapest" in s for s in r["strategies"]), r["strategies"]


# --------------------------------------------------------------------------- auto's choice, errors, fallbacks
def test_auto_picks_by_the_cost_model():
    long_ib = AttentionShape(1, 32, 8, 128, 131072)  # transfer-bound ring across nodes: the all-to-all wins
    d = choose("auto", 16, None, long_ib, "", HARDWARE["h100-ib"])
    assert d.strategy in ("ulysses", "2d") and "cheapest" in d.why, d
    few_heads = AttentionShape(1, 2, 2, 128, 131072)  # 2 heads on 16 ranks: Ulysses pads 14 of 16 heads
    d = choose("auto", 16, None, few_heads, "", HARDWARE["h100-nvlink"])
    assert d.strategy == "ring", d
    masked = AttentionShape(1, 32, 8, 128, 131072, mask_bytes=1 * 1 * 8192 * 131072, mask_heads=1)
    d = choose("auto", 16, None, masked, "", HARDWARE["h100-ib"])  # a per-query bool mask must travel too
    assert d.strategy == "ring", d
    d = choose("auto", 4, None, few_heads, "the striped layout under a symbolic length", HARDWARE["cpu-gloo"])
    assert d.strategy == "ring" and "striped" in d.why and not d.fell_back, d
    forced = choose("ulysses", 4, None, None, "", HARDWARE["cpu-gloo"])
    assert forced.strategy == "ring" and forced.fell_back and "head count" in forced.why, forced


@pytest.mark.parametrize("options,match", [
    ({"strategy": "ring", "ulysses_degree": 2}, "strategy='2d'"),
    ({"strategy": "2d", "hardware": "h100-ib"}, "strategy='auto'"),
    ({"strategy": "auto", "hardware": "tpu"}, "custom:TFLOPS"),
    ({"strategy": "2d", "ulysses_degree": 0}, "positive int"),
])
def test_bad_options_name_the_fix(options, match):
    import cp_compile

    with pytest.raises(ValueError, match=match):
        cp_compile.RingCP(**options)


@pytest.mark.parametrize("options,match", [
    ({"strategy": "2d", "ulysses_degree": 3}, "does not divide"),
    ({"strategy": "ulysses", "ulysses_degree": 2}, "strategy='2d'"),
    ({"strategy": "2d", "ulysses_degree": 4}, "strategy='ulysses'"),
])
def test_degrees_the_group_cannot_take_name_the_fix(options, match):
    model, inputs = models.llama_factory(seq_len=32)
    with pytest.raises(Exception, match=match):
        explain_record(model, inputs, world_size=4, **options)


# --------------------------------------------------------------------------- activation checkpointing, the decorator
class _Checkpointed(torch.nn.Module):
    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, *args, use_reentrant=False)


def _checkpointed_step() -> dict:
    """On a rank: the Llama with every block checkpointed, under Ulysses through ``@context_parallel``; the
    all-to-alls of q, k, v run once (saved like the ring's output), never again in the backward."""
    import cp_compile

    def make():
        model, inputs = models.llama_factory(seq_len=32)
        model.layers = torch.nn.ModuleList(_Checkpointed(b) for b in model.layers)
        return model, inputs

    (ref_model, inputs), (cp_model, _) = make(), make()
    ref = ref_model(*inputs)
    ref.backward()
    import cp_compile.backend.compiler as compiler

    graphs, schedule = [], compiler.schedule_collectives  # AOTAutograd's forward and backward graphs, kept
    compiler.schedule_collectives = lambda gm: graphs.append(gm) or schedule(gm)

    @cp_compile.context_parallel(shard={"input_ids": 1, "labels": 1}, inner="aot_eager", strategy="ulysses")
    def step(model, input_ids, labels):
        loss = model(input_ids, labels)
        loss.backward()
        return loss

    try:
        out = step(cp_model, *inputs)
    finally:
        compiler.schedule_collectives = schedule
    rec = [r for r in step.backend.records if r.attention]
    ops = (torch.ops.cp_compile.seq_to_heads.default, torch.ops.cp_compile.heads_to_seq.default,
           torch.ops.aten.rsqrt.default)
    fw, bw = graphs[:2]
    return {"loss": rel(out.detach(), ref.detach()), "grad": max(grad_errors(cp_model, ref_model).values()),
            "regions": sum(len(r.regions) for r in rec), "strategies": [s for r in rec for s in r.strategies],
            "forward": [sum(n.target is op for n in fw.graph.nodes) for op in ops],
            "backward": [sum(n.target is op for n in bw.graph.nodes) for op in ops]}


@pytest.mark.slow
def test_checkpointed_blocks_under_the_decorator(ranks):
    for rank, r in enumerate(ranks.run(2, _checkpointed_step, timeout=300)):
        assert r["loss"] <= TOL and r["grad"] <= TOL, (rank, r)
        assert r["regions"] == 2 and all(s.startswith("ulysses u=2") for s in r["strategies"]), (rank, r)
        # per layer: q, k, v sent and out back in the forward; the backward sends dout and gets dq, dk, dv back,
        # and recomputes the region (RMSNorm's rsqrt) but not its all-to-alls
        assert r["forward"][:2] == [6, 2] and r["backward"][:2] == [2, 6] and r["backward"][2] > 0, (rank, r)


# --------------------------------------------------------------------------- dynamic shapes
def _dynamic(cases: list) -> list:
    """On a rank: each (strategy, layout) compiled with ``dynamic=True`` and run at two lengths (one
    padded) against the eager one-process run; what each attention got, and the WARNINGs."""
    import cp_compile

    out = []
    for strategy, lb in cases:
        torch._dynamo.reset()
        (ref_model, _), (cp_model, _) = models.llama_factory(seq_len=32), models.llama_factory(seq_len=32)
        backend = cp_compile.RingCP(inner="aot_eager", strategy=strategy, load_balance=lb)
        compiled = torch.compile(cp_model, backend=backend, dynamic=True)
        errors = []
        with cp_compile_warnings() as warned:
            for s in (32, 27):  # a second length (padded): one recompile-free run at a new symbolic S
                _, inputs = models.llama_factory(seq_len=s)
                for p in (*cp_model.parameters(), *ref_model.parameters()):
                    p.grad = None
                ref = ref_model(*inputs)
                ref.backward()
                got = compiled(*inputs)
                got.backward()
                errors.append(max(rel(got.detach(), ref.detach()), *grad_errors(cp_model, ref_model).values()))
        out.append({"case": (strategy, lb), "error": max(errors), "warned": warned,
                    "strategies": sorted({s for r in backend.records for s in r.strategies})})
    return out


@pytest.mark.slow
def test_symbolic_lengths(ranks):
    """Under ``dynamic=True`` (two lengths, one padded) Ulysses and 2-D run exact; 2-D under striped, whose
    ring needs a positions table per length, runs the ring and says so once per line and reason."""
    cases = [("2d", "zigzag"), ("2d", "striped")]
    for rank, results in enumerate(ranks.run(4, _dynamic, cases, timeout=300)):
        by_case = {r["case"]: r for r in results}
        assert all(r["error"] <= TOL for r in results), (rank, results)
        assert [s.split(":")[0] for s in by_case["2d", "zigzag"]["strategies"]] == ["2d u=2 x r=2"], by_case
        fell = by_case["2d", "striped"]
        assert [s.split(":")[0] for s in fell["strategies"]] == ["ring"], fell
        assert len(fell["warned"]) == 1 and "striped" in fell["warned"][0] and "models.py" in fell["warned"][0], fell
