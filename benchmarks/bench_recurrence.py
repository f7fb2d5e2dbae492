"""Recurrent layers by state passing (issue 36): per-rank memory, bytes per layer, parallel vs serial.

A Mamba2-style model (in-projection, causal depthwise conv, a chunked SSD kernel registered with
``cp_compile.register_recurrence``, out-projection; ``--layers`` of them) and a hybrid (the same
with one causal attention layer after the first), one training step through ring_cp
(``aot_eager`` inside) on N fresh ranks beside one process (``torch.compile(aot_eager)``), both
calling the same registered kernel (one opaque op, run eagerly, chunk by chunk):

- per-rank peak above the resident size before the step (benchmarks/common.py), N over 1;
- bytes each rank receives per recurrent layer for the state exchange, counted where they are sent
  (``cp_compile.traffic``: the exchange op adds what it gathers) beside the record's cost-model figure
  (N·k summaries of (map, state)), at two sequence lengths (must be equal: independent of S);
- the step time at N = 2 with the kernel declared ``"elementwise"`` (one all-gather, all runs at
  once) against the same kernel declared ``"serial"`` (state handed rank to rank): the parallel
  path is not serial; and N = 1 on the same total work.

    .venv/bin/python benchmarks/bench_recurrence.py                   # S = 16k, N = 1, 2, 4
    .venv/bin/python benchmarks/bench_recurrence.py --seq-len 4096 --worlds 1,2

Writes results/recurrence.json. Loss and gradients are checked in tests/, not here.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Dict, List

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

E, H, P, NS, CHUNK = 128, 8, 16, 16, 64


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                initial_state: Any = None, return_final_states: bool = False):
    """Mamba2's SSD, chunk by chunk (quadratic inside a chunk of CHUNK tokens, the state between):
    x (B, S, H, P), dt (B, S, H), A (H,), B/C (B, S, H, N) -> y (B, S, H, P), h (B, H, P, N)."""
    b, s, h, p = x.shape
    state = x.new_zeros(b, h, p, B.shape[-1]) if initial_state is None else initial_state
    ys = []
    for i in range(0, s, CHUNK):
        xc, dtc, bc, cc = x[:, i:i + CHUNK], dt[:, i:i + CHUNK], B[:, i:i + CHUNK], C[:, i:i + CHUNK]
        a = torch.cumsum(dtc * A, 1)  # (B, Q, H): log decay from the chunk start, step t included
        q = a.shape[1]
        seg = (a.unsqueeze(2) - a.unsqueeze(1)).masked_fill(~torch.ones(q, q, dtype=torch.bool).tril()[:, :, None],
                                                              float("-inf"))  # (B, Qt, Qs, H)
        scores = torch.einsum("bthn,bshn->btsh", cc, bc) * seg.exp()  # (B, Qt, Qs, H)
        y = torch.einsum("btsh,bshp->bthp", scores, dtc.unsqueeze(-1) * xc)
        y = y + torch.einsum("bthn,bhpn->bthp", cc, state) * a.exp().unsqueeze(-1)
        tail = (a[:, -1:] - a).exp() * dtc  # (B, Q, H): each token's weight in the chunk's final state
        state = a[:, -1].exp()[..., None, None] * state + torch.einsum("bsh,bshp,bshn->bhpn", tail, xc, bc)
        ys.append(y)
    return torch.cat(ys, 1), (state if return_final_states else None)


CONTRACT = dict(seq_args={"x": 1, "dt": 1, "B": 1, "C": 1}, outputs={0: 1}, initial_state="initial_state",
                final_state=1, final_state_flag="return_final_states", drive=("x",))


class Mamba2Block(nn.Module):
    """In-projection to x, B, C, dt; causal depthwise conv on x; SSD; gated out-projection."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(E, 2 * H * P + 2 * H * NS + H)
        self.conv = nn.Conv1d(H * P, H * P, 4, groups=H * P, padding=3)
        self.A = nn.Parameter(-torch.rand(H) - 0.5)
        self.out = nn.Linear(H * P, E)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        b, s, _ = u.shape
        x, z, bb, cc, dt = self.inp(u).split([H * P, H * P, H * NS, H * NS, H], -1)
        x = F.silu(self.conv(x.transpose(1, 2))[..., :s]).transpose(1, 2)
        y, _ = ssd_chunked(x.reshape(b, s, H, P), F.softplus(dt), self.A, bb.reshape(b, s, H, NS),
                           cc.reshape(b, s, H, NS))
        return u + self.out(y.reshape(b, s, H * P) * F.silu(z))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(E, 3 * E), nn.Linear(E, E)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        b, s, _ = u.shape
        q, k, v = self.qkv(u).view(b, s, 3, 4, E // 4).permute(2, 0, 3, 1, 4)
        return u + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, E))


class Model(nn.Module):
    def __init__(self, layers: int, hybrid: bool) -> None:
        super().__init__()
        blocks: List[nn.Module] = [Mamba2Block() for _ in range(layers)]
        if hybrid:
            blocks.insert(1, Attention())
        self.blocks = nn.ModuleList(blocks)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            u = blk(u)
        return u.square().mean()


def rank_run(rank: int, world: int, seq: int, layers: int, hybrid: bool, transition: str) -> Dict[str, Any]:
    """One compile + warm-up step, then one measured step (peak, seconds); the record's state bytes."""
    import cp_compile

    cp_compile.register_recurrence(ssd_chunked, transition=transition, **CONTRACT)
    torch.manual_seed(0)
    model = Model(layers, hybrid)
    u = torch.randn(1, seq, E)
    backend = cp_compile.RingCP(inner="aot_eager") if world > 1 else "aot_eager"
    with cp_compile.traffic.measure() as sent:  # the warm-up step and the measured one
        m = common.measure_train_step(model, torch.compile(model, backend=backend, fullgraph=True), (u,), world)
    if world > 1:
        rec = backend.records[-1]
        m["state_bytes_per_layer"] = [int(line.split(" B received")[0].rsplit(" ", 1)[1]) for line in rec.recurrences]
        m["state_bytes_sent_per_layer"] = sent.get("state exchange", 0) // (2 * layers)
        m["fallbacks"] = len(rec.fallbacks)
    return m


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=lambda t: common.int_list(t)[0], default=16384)
    p.add_argument("--worlds", type=common.int_list, default=[1, 2, 4])
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args(argv)
    started, rows = time.perf_counter(), []
    for hybrid in (False, True):
        name = "hybrid (Mamba2 + 1 attention)" if hybrid else "Mamba2"
        for world in args.worlds:
            for transition in (("elementwise", "serial") if world == 2 else ("elementwise",)):
                common.log(f"{name}: N={world} {transition} S={args.seq_len}")
                res = common.try_run_ranks(rank_run, world, args.seq_len, args.layers, hybrid, transition)
                rows.append({"model": name, "world": world, "transition": transition, "seq_len": args.seq_len,
                             "ranks": res})
    half = args.seq_len // 2  # the state bytes at a second length: the same
    res = common.try_run_ranks(rank_run, 2, half, args.layers, False, "elementwise")
    rows.append({"model": "Mamba2", "world": 2, "transition": "elementwise", "seq_len": half, "ranks": res})
    common.write_result("recurrence", {"rows": rows, "summary": summarize(rows)}, started, args)
    for line in summarize(rows):
        print(line)


def summarize(rows: List[Dict[str, Any]]) -> List[str]:
    """The ratios to read: per-rank peak N over 1, serial over parallel at N = 2, bytes at two lengths."""
    def get(model, world, transition="elementwise", seq=None):
        for r in rows:
            if r["model"] == model and r["world"] == world and r["transition"] == transition and \
                    (seq is None or r["seq_len"] == seq) and isinstance(r["ranks"], list):
                return r
        return None

    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        one = get(model, 1)
        for world in sorted({r["world"] for r in rows if r["model"] == model and r["world"] > 1}):
            row = get(model, world, seq=one["seq_len"] if one else None)
            if one and row:
                peak = max(x["peak_above_mib"] for x in row["ranks"]) / one["ranks"][0]["peak_above_mib"]
                out.append(f"{model} S={row['seq_len']}: N={world} per-rank peak {peak:.2f}x of one process; step "
                           f"{max(x['seconds'] for x in row['ranks']):.2f} s vs {one['ranks'][0]['seconds']:.2f} s; "
                           f"state bytes per layer {row['ranks'][0]['state_bytes_per_layer']} (record), "
                           f"{row['ranks'][0]['state_bytes_sent_per_layer']} (counted where sent)")
        par, ser = get(model, 2), get(model, 2, "serial")
        if par and ser:
            out.append(f"{model}: N=2 serial / elementwise step time "
                       f"{max(x['seconds'] for x in ser['ranks']) / max(x['seconds'] for x in par['ranks']):.2f}")
    lens = sorted({r["seq_len"] for r in rows if r["model"] == "Mamba2" and r["world"] == 2
                   and r["transition"] == "elementwise" and isinstance(r["ranks"], list)})
    out.append("Mamba2 N=2 state bytes per layer by S: " + ", ".join(
        f"S={s}: {get('Mamba2', 2, seq=s)['ranks'][0]['state_bytes_sent_per_layer']} sent" for s in lens))
    return out


if __name__ == "__main__":
    main()
