"""Every zoo member (examples/zoo/) through ring_cp against one process, as a table.

    torchrun --standalone --nproc-per-node 2 examples/zoo_sweep.py [--members alibi,moe] [--seq-len 80]
                                                                   [--json out.json]

Each rank runs :func:`zoo.measure.measure` for each member (the checks of tests/test_zoo.py:
the model compiled unchanged with ``RingCP(inner="aot_eager")`` against the eager one-process
run on the whole sequence). Rank 0 prints one markdown row per member: the relative error of
the loss and of the worst parameter gradient, ring ops made / attention calls of the eager
run, the gather fallbacks (ops computed on the gathered sequence) and the sharded fraction of
activation bytes (worst over ranks), and whether a second call ran attention outside the ring
or built a tensor spanning the sequence twice. A member that raises prints its first error line.
Run it at 2 and 4 ranks for the zoo table of docs/zoo.md.
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

HEADER = ("| member | N | loss err | worst grad err | rings / attention | fallbacks | sharded | "
          "second call |\n|---|---|---|---|---|---|---|---|")


def _row(name: str, world: int, per_rank: list) -> str:
    if any(isinstance(r, str) for r in per_rank):
        return f"| {name} | {world} | error: {next(r for r in per_rank if isinstance(r, str))} | | | | | |"
    worst = lambda key: max(r[key] for r in per_rank)  # noqa: E731
    second = "clean" if not any(r["whole_attention"] or r["quadratic"] for r in per_rank) else "WHOLE/S² tensors"
    falls = sorted({f.split(":")[0] for r in per_rank for f in r["fallbacks"]})
    r0 = per_rank[0]
    return (f"| {name} | {world} | {worst('loss'):.1e} | {worst('grad'):.1e} | {r0['rings']} / {r0['attention']} | "
            f"{len(r0['fallbacks'])}{' (' + ', '.join(falls) + ')' if falls else ''} | "
            f"{min(r['sharded'] for r in per_rank):.0%} | {second} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", default="", help="comma-separated member names (default: all)")
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN)
    parser.add_argument("--json", default="", help="also write every rank's measurements (no records) here")
    a = parser.parse_args()
    dist.init_process_group("gloo")
    names = a.members.split(",") if a.members else list(members())
    world, rows, dump = dist.get_world_size(), [], {}
    for name in names:
        try:
            mine = measure(name, seq_len=a.seq_len)
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
                json.dump({"world": world, "members": dump}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
