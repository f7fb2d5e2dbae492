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
  and one all-to-all of the per-block dK/dV at the end, summed in ring order.

Every rank posts the same operations in the same order, so the ring cannot hang on
mismatched collectives. K and V travel as two tensors (no packing copy); message
tags keep K/V hops and gradient hops apart.

Faults. Every wait is bounded: by ``RingGroup.timeout`` seconds when the op was
given one (``ring_attention(timeout=)``, ``RingCP(timeout=)``), else by the process
group's own timeout (``init_process_group(timeout=)``, 30 min by default), which
the backend enforces itself. A wait that times out or fails in the transport (a
peer process that exited resets its connections) raises :class:`RingCommError`
naming this rank, the peer it was waiting for, the ring step, the direction
(forward K/V, backward K/V or backward dK/dV) and the fix, instead of hanging or
surfacing a bare transport error.
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import traffic
from ..group import CPGroup
from .faults import Hop, collective_hop, comm_error, p2p_hop, wait_hop
from .plan import source_rank

Tensor = torch.Tensor

KV_TAG = 0
GRAD_TAG = 2


def _ring_exchange(sends: Sequence[Tensor], recvs: Sequence[Tensor], group: CPGroup, tag: int, step: int = 1) -> Hop:
    """Post send(sends[i] -> rank+1) and recv(recvs[i] <- rank-1); returns the pending :class:`Hop`.

    ``step``: the ring step that needs the received data (for error messages)."""
    nxt = (group.rank + 1) % group.size
    prv = (group.rank - 1) % group.size
    ops = []
    for i, (s, r) in enumerate(zip(sends, recvs)):
        ops.append(dist.P2POp(dist.isend, s, group=group.pg, tag=tag + i, group_peer=nxt))
        ops.append(dist.P2POp(dist.irecv, r, group=group.pg, tag=tag + i, group_peer=prv))
    kind = "dK/dV" if tag == GRAD_TAG else "K/V"
    traffic.add(f"ring {kind}", sum(t.numel() * t.element_size() for t in sends))
    try:
        works = dist.batch_isend_irecv(ops)
    except Exception as e:  # noqa: BLE001 - a dead peer can fail the post itself
        raise comm_error(group, kind, step, f"posting the {kind} hop (to rank {nxt}, from rank {prv})", prv, e) from e
    return p2p_hop(works, group, kind, step, len(sends))


def _wait(hop: Hop) -> None:
    """Wait for a transfer, bounded by the group's timeout (see :mod:`.faults`)."""
    wait_hop(hop)


def kv_blocks(k: Tensor, v: Tensor, group: CPGroup, rotate: str) -> Iterator[Tuple[int, int, Tensor, Tensor]]:
    """Yield ``(step, src, k_src, v_src)`` for steps 0..N-1; k, v: (B, H_kv, c, D) this rank's.

    With ``p2p`` the next block's transfer is in flight while the caller computes on
    the yielded one; at most two blocks are alive at once.
    """
    n, r = group.size, group.rank
    if rotate == "allgather":
        kv = torch.stack([k, v])  # (2, B, H_kv, c, D)
        flat = torch.empty((n * 2, *k.shape), dtype=k.dtype, device=k.device)
        traffic.add("ring K/V", (n - 1) * kv.numel() * kv.element_size())
        work = dist.all_gather_single(flat, kv, group=group.pg, async_op=True)
        _wait(collective_hop(work, group, "K/V", f"all-gathering the K/V blocks of ranks 0..{n - 1}", step=1))
        gathered = flat.view(n, 2, *k.shape)  # (N, 2, B, H_kv, c, D), rank-major
        for t in range(n):
            src = source_rank(r, t, n)
            yield t, src, gathered[src, 0], gathered[src, 1]
        return
    cur = (k.contiguous(), v.contiguous())
    for t in range(n):
        pending: Optional[Hop] = None
        if t < n - 1:
            nxt = (torch.empty_like(cur[0]), torch.empty_like(cur[1]))
            pending = _ring_exchange(cur, nxt, group, KV_TAG, step=t + 1)
        yield t, source_rank(r, t, n), cur[0], cur[1]
        if t < n - 1:
            _wait(pending)
            cur = nxt


class GradSink:
    """Collects each step's dK/dV contribution and returns this rank's full dK/dV.

    ``add(step, src, dk, dv)`` is called once per step in ring order with this rank's
    contribution (B, H_kv, c, D) to block ``src`` (``None`` for no contribution);
    ``finish()`` returns the sums over all ranks for this rank's own block.
    """

    def __init__(self, like: Tensor, dtype: torch.dtype, group: CPGroup, rotate: str) -> None:
        self.group, self.rotate = group, rotate
        self.shape, self.dtype, self.device = like.shape, dtype, like.device
        self._incoming: Optional[Tuple[Tensor, Tensor]] = None
        self._pending: Optional[Hop] = None
        self._sending: Optional[Tuple[Tensor, Tensor]] = None  # alive until its send completes
        if rotate == "allgather":
            self._blocks = torch.zeros((group.size, 2, *like.shape), dtype=dtype, device=like.device)

    def _zeros(self) -> Tensor:
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)

    def add(self, step: int, src: int, dk: Optional[Tensor], dv: Optional[Tensor]) -> None:
        if self.rotate == "allgather":
            if dk is not None:
                self._blocks[src, 0] += dk
                self._blocks[src, 1] += dv
            return
        if step == 0:
            acc = (dk if dk is not None else self._zeros(), dv if dv is not None else self._zeros())
        else:  # block src's accumulator, sent by rank-1 at its previous step: add in place
            _wait(self._pending)
            acc = self._incoming
            if dk is not None:
                acc[0].add_(dk)
                acc[1].add_(dv)
        self._sending = acc
        self._incoming = (torch.empty_like(acc[0]), torch.empty_like(acc[1]))
        self._pending = _ring_exchange(acc, self._incoming, self.group, GRAD_TAG, step=step + 1)

    def finish(self) -> Tuple[Tensor, Tensor]:
        if self.rotate == "allgather":
            return self._sum_in_ring_order()
        _wait(self._pending)
        self._sending = None
        assert self._incoming is not None
        return self._incoming

    def _sum_in_ring_order(self) -> Tuple[Tensor, Tensor]:
        """All-to-all the per-block contributions, then add them in the order the p2p
        accumulator visits the ranks (r, r+1, ..., r-1), so both rotations give the
        same bits (a reduce-scatter would add in the backend's own order)."""
        n, r = self.group.size, self.group.rank
        recv = torch.empty_like(self._blocks)  # recv[j]: rank j's contribution to this rank's block
        traffic.add("ring dK/dV", (n - 1) * recv[0].numel() * recv.element_size())
        work = dist.all_to_all_single(recv, self._blocks, group=self.group.pg, async_op=True)
        _wait(collective_hop(work, self.group, "dK/dV", "the all-to-all of the dK/dV contributions", step=n))
        acc = recv[r].clone()  # (2, B, H_kv, c, D)
        for t in range(1, n):
            acc.add_(recv[(r + t) % n])
        return acc[0], acc[1]
