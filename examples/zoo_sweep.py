"""Every zoo member (examples/zoo/) through ring_cp against one process, as a table.

    torchrun --standalone --nproc-per-node 2 examples/zoo_sweep.py [--members alibi,moe] [--seq-len 80]
                                                                   [--json out.json]
                                                                   [--strategy ulysses] [--ulysses-degree 2]

Each rank runs :func:`zoo.measure.measure` for each member (the checks of tests/test_zoo.py:
the model compiled unchanged with ``RingCP(inner="aot_eager")`` against the eager one-process
run on the whole sequence). Rank 0 prints one markdown row per member: the relative error of
the loss and of the worst parameter gradient, ring ops made / attention calls of the eager
run, the gather fallbacks (ops computed on the gathered sequence) and the sharded fraction of
activation bytes (worst over ranks), and whether a second call ran attention outside the ring
or built a tensor spanning the sequence twice. A member that raises prints its first error line.
Run it at 2 and 4 ranks for the zoo table of docs/zoo.md.

``--strategy`` / ``--ulysses-degree``: the backend's ``strategy`` / ``ulysses_degree`` options (the
default run is the ring's). The "strategy" column says what each member's attention got, read off
the rewritten graphs' ring ops (their description's ``strategy`` and ``ulysses``), with the number of
``seq_to_heads`` all-to-alls; an attention left on the ring under ``ulysses`` / ``2d`` is shown as
"RING" with the reason its record gives (a silent one says so).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zoo import SEQ_LEN, members  # noqa: E402
from zoo.measure import measure  # noqa: E402

HEADER = ("| member | N | strategy | loss err | worst grad err | rings / attention | fallbacks | sharded | "
          "second call |\n|---|---|---|---|---|---|---|---|---|")


def _strategy(r0: dict) -> str:
    """What the member's attention got: e.g. ``ulysses u=2 ×3 (12 a2a)``, or the ring ops left on the ring."""
    got = sorted(set(r0["strategies"]))
    text = ", ".join(f"{g} ×{r0['strategies'].count(g)}" for g in got) or "none"
    if r0["a2a"]:
        text += f" ({r0['a2a']} a2a)"
    if r0["not_applied"]:
        text += " RING: " + "; ".join(r0["not_applied"])[:160]
    return text


def _row(name: str, world: int, per_rank: list) -> str:
    if any(isinstance(r, str) for r in per_rank):
        return f"| {name} | {world} | | error: {next(r for r in per_rank if isinstance(r, str))} | | | | | |"
    worst = lambda key: max(r[key] for r in per_rank)  # noqa: E731
    second = "clean" if not any(r["whole_attention"] or r["quadratic"] for r in per_rank) else "WHOLE/S² tensors"
    falls = sorted({f.split(":")[0] for r in per_rank for f in r["fallbacks"]})
    r0 = per_rank[0]
    return (f"| {name} | {world} | {_strategy(r0)} | {worst('loss'):.1e} | {worst('grad'):.1e} | "
            f"{r0['rings']} / {r0['attention']} | "
            f"{len(r0['fallbacks'])}{' (' + ', '.join(falls) + ')' if falls else ''} | "
            f"{min(r['sharded'] for r in per_rank):.0%} | {second} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", default="", help="comma-separated member names (default: all)")
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN)
    parser.add_argument("--json", default="", help="also write every rank's measurements (no records) here")
    parser.add_argument("--strategy", default="ring", choices=("ring", "ulysses", "2d", "auto"),
                        help="the backend's strategy option (default: ring)")
    parser.add_argument("--ulysses-degree", type=int, default=None, help="the backend's ulysses_degree option")
    a = parser.parse_args()
    options = {} if a.strategy == "ring" else {"strategy": a.strategy}
    if a.ulysses_degree is not None:
        options["ulysses_degree"] = a.ulysses_degree
    dist.init_process_group("gloo")
    names = a.members.split(",") if a.members else list(members())
    world, rows, dump = dist.get_world_size(), [], {}
    for name in names:
        try:
            mine = measure(name, seq_len=a.seq_len, **options)
            mine = {k: v for k, v in mine.items() if k not in ("records", "explained")}
        except Exception as e:  # noqa: BLE001 - a row says what failed; the sweep goes on
            mine = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        per_rank = [None] * world
        dist.all_gather_object(per_rank, mine)
        rows.append(_row(name, world, per_rank))
        dump[name] = per_rank
        if dist.get_rank() == 0:
            print(rows[-1], flush=True)
    if dist.get_rank() == 0:
        print("\n" + HEADER + "\n" + "\n".join(rows))
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"world": world, "options": options, "members": dump}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
