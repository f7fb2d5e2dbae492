"""Moving K/V blocks and their gradients between CP ranks.

Two strategies, same block order (so the merge order, and hence the numbers, are
identical):

* ``p2p`` — the ring. At step t rank r holds the block of rank (r - t) mod N. The
  transfer for step t+1 (send the current block to r+1, receive the next from r-1)
  is posted *before* step t's compute and waited *after* it (double buffering). In
  the backward, each block's dK/dV accumulator travels behind its K/V: rank r adds
  its contribution and forwards it; after N hops it is back at its owner. The hop
  of step t is in flight during step t+1's compute.
* ``allgather`` — one all-gather of every K/V block up front (N x the K/V memory),
  and one reduce-scatter of the per-block dK/dV at the end.

Every rank posts the same operations in the same order, so the ring cannot hang on
mismatched collectives. K and V travel packed as one (2, B, H_kv, c, D) buffer.
"""

from __future__ import annotations

from typing import Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from .._group import CPGroup
from .plan import source_rank

Tensor = torch.Tensor

KV_TAG = 0
GRAD_TAG = 1


def _ring_exchange(send: Tensor, recv: Tensor, group: CPGroup, tag: int) -> List[dist.Work]:
    """Post send(send -> rank+1) and recv(recv <- rank-1); returns the pending works."""
    nxt = (group.rank + 1) % group.size
    prv = (group.rank - 1) % group.size
    ops = [
        dist.P2POp(dist.isend, send, group=group.pg, tag=tag, group_peer=nxt),
        dist.P2POp(dist.irecv, recv, group=group.pg, tag=tag, group_peer=prv),
    ]
    return dist.batch_isend_irecv(ops)


def _wait(works: List[dist.Work]) -> None:
    for w in works:
        w.wait()


def kv_blocks(kv: Tensor, group: CPGroup, rotate: str) -> Iterator[Tuple[int, int, Tensor]]:
    """Yield ``(step, src, kv_src)`` for steps 0..N-1; kv: (2, B, H_kv, c, D) this rank's block.

    With ``p2p`` the next block's transfer is in flight while the caller computes on
    the yielded one.
    """
    n, r = group.size, group.rank
    if rotate == "allgather":
        flat = torch.empty((n * kv.shape[0], *kv.shape[1:]), dtype=kv.dtype, device=kv.device)
        dist.all_gather_single(flat, kv.contiguous(), group=group.pg)
        gathered = flat.view(n, *kv.shape)  # (N, 2, B, H_kv, c, D), rank-major
        for t in range(n):
            src = source_rank(r, t, n)
            yield t, src, gathered[src]
        return
    cur = kv.contiguous()
    for t in range(n):
        pending: List[dist.Work] = []
        if t < n - 1:
            nxt = torch.empty_like(cur)
            pending = _ring_exchange(cur, nxt, group, KV_TAG)
        yield t, source_rank(r, t, n), cur
        if t < n - 1:
            _wait(pending)
            cur = nxt


class GradSink:
    """Collects each step's dK/dV contribution and returns this rank's full dK/dV.

    ``add(step, src, dkv)`` is called once per step in ring order with this rank's
    contribution (2, B, H_kv, c, D) to block ``src``; ``finish()`` returns the sum
    over all ranks of the contributions to this rank's own block.
    """

    def __init__(self, shape: torch.Size, dtype: torch.dtype, device: torch.device, group: CPGroup, rotate: str) -> None:
        self.group, self.rotate = group, rotate
        self._incoming: Optional[Tensor] = None
        self._pending: List[dist.Work] = []
        self._sending: Optional[Tensor] = None  # kept alive until its send completes
        if rotate == "allgather":
            self._blocks = torch.zeros((group.size, *shape), dtype=dtype, device=device)  # (N, 2, B, H_kv, c, D)

    def add(self, step: int, src: int, dkv: Tensor) -> None:
        if self.rotate == "allgather":
            self._blocks[src] += dkv
            return
        if step > 0:  # the accumulator for block src, sent by rank-1 at its previous step
            _wait(self._pending)
            dkv = dkv + self._incoming
        self._sending = dkv.contiguous()
        self._incoming = torch.empty_like(self._sending)
        self._pending = _ring_exchange(self._sending, self._incoming, self.group, GRAD_TAG)

    def finish(self) -> Tensor:
        if self.rotate == "allgather":
            own = torch.empty_like(self._blocks[0])
            dist.reduce_scatter_single(own, self._blocks.flatten(0, 1), group=self.group.pg)
            return own
        _wait(self._pending)
        self._sending = None
        assert self._incoming is not None
        return self._incoming
