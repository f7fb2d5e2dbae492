"""Bounded waits for the ring's transfers, and the error a failed one raises.

A ring op that waits for a peer which has died, raised, or is running different code
would otherwise hang until the transport gives up (the process group's timeout,
30 min by default) and then report a bare transport error. Here every wait of the
ring goes through :func:`wait_hop`:

* the limit is ``RingGroup.timeout`` seconds when the op was given one
  (``ring_attention(timeout=)``, ``RingCP(timeout=)``), counted from when the wait
  starts; ``None`` waits as long as the process group's own timeout
  (``init_process_group(timeout=)``), which gloo and NCCL enforce themselves;
* a timeout or a transport error (a peer process that exited resets its
  connections) raises :class:`RingCommError` naming this rank, the peer it was
  waiting for, the ring step, the direction (forward K/V, backward K/V, backward
  dK/dV) and the fix.

After such an error the process group is unusable (gloo closes the pairs it timed
out on): the job has to be restarted, as after any failed collective.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import List, Optional

import torch.distributed as dist

from ..group import CPGroup


class RingCommError(RuntimeError):
    """A ring transfer timed out or failed: a peer died, raised, or runs different code."""


@dataclass(frozen=True)
class RingGroup(CPGroup):
    """The CP group plus how one ring op call waits for its transfers.

    ``timeout``: seconds each wait may take (``None``: the process group's own timeout);
    ``phase``: ``"forward"`` or ``"backward"``, for error messages.
    """

    timeout: Optional[float] = None
    phase: str = "forward"


@dataclass
class Hop:
    """The pending works of one transfer and what each one is, for error messages.

    ``kind`` is what travels ("K/V", "dK/dV"); ``labels[i]`` describes ``works[i]``
    (e.g. "receiving the K/V block from rank 1") and ``peers[i]`` is the rank it waits for
    (``None``: any rank of a collective).
    ``step`` is the ring step that needs the data (``size`` for the last dK/dV hop,
    which brings each block's gradient home; ``-1`` for a check before the ring starts).
    """

    works: List[dist.Work]
    group: CPGroup
    kind: str  # "K/V", "dK/dV" or a collective's name
    step: int
    labels: List[str] = field(default_factory=list)
    peers: List[Optional[int]] = field(default_factory=list)


def p2p_hop(works: List[dist.Work], group: CPGroup, kind: str, step: int, n_pairs: int) -> Hop:
    """A :class:`Hop` for ``n_pairs`` (send to rank+1, recv from rank-1) pairs posted in that order."""
    what = {"K/V": "K/V block", "dK/dV": "dK/dV accumulator"}.get(kind, kind)
    nxt, prv = (group.rank + 1) % group.size, (group.rank - 1) % group.size
    if len(works) == 2 * n_pairs:  # one work per op (gloo)
        labels = [f"sending the {what} to rank {nxt}", f"receiving the {what} from rank {prv}"] * n_pairs
        peers: List[Optional[int]] = [nxt, prv] * n_pairs
    else:  # a coalesced backend returns one work for the whole batch (NCCL)
        labels = [f"exchanging the {what} with ranks {prv} (receive) and {nxt} (send)"] * len(works)
        peers = [prv] * len(works)
    return Hop(works, group, kind, step, labels, peers)


def collective_hop(work: Optional[dist.Work], group: CPGroup, kind: str, label: str, step: int = 0) -> Hop:
    """A :class:`Hop` for one collective over the whole group (``work`` from ``async_op=True``)."""
    works = [work] if work is not None else []
    return Hop(works, group, kind, step, [label] * len(works), [None] * len(works))


def group_timeout(group: CPGroup) -> Optional[float]:
    """The process group's own timeout in seconds, when its backend exposes it."""
    for device in getattr(group.pg, "_device_types", []):
        try:
            return group.pg._get_backend(device).options._timeout.total_seconds()
        except Exception:  # noqa: BLE001 - not every backend exposes its options
            continue
    return None


def wait_hop(hop: Hop) -> None:
    """Wait for every work of ``hop`` within the group's timeout; :class:`RingCommError` if not."""
    timeout = getattr(hop.group, "timeout", None)
    deadline = None if timeout is None else time.monotonic() + timeout
    for i, work in enumerate(hop.works):
        try:
            if deadline is None:
                done = work.wait()
            else:
                left = max(deadline - time.monotonic(), 1e-3)
                done = work.wait(timeout=timedelta(seconds=left))
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError, NCCL DistBackendError
            raise comm_error(hop.group, hop.kind, hop.step, hop.labels[i], hop.peers[i], e) from e
        if done is False:
            raise comm_error(hop.group, hop.kind, hop.step, hop.labels[i], hop.peers[i], None)


def comm_error(
    group: CPGroup, kind: str, step: int, label: str, peer: Optional[int], cause: Optional[BaseException]
) -> RingCommError:
    """The error for a transfer that failed (``cause``) or timed out (``cause`` None or a
    timeout error): who waited for whom, where, why, and the fix."""
    detail = str(cause).strip().splitlines()[0] if cause is not None else "the wait returned unfinished"
    if cause is None or "timed out" in detail.lower() or "timeout" in detail.lower():
        why = f"no answer within {_limit(group)}"
    else:
        why = f"the transfer failed ({detail})"
    who, whose = (f"rank {peer}", f"rank {peer}'s") if peer is not None else ("one of the other ranks", "that rank's")
    if step < 0:
        at = "the start of the ring"
    elif step < group.size:
        at = f"ring step {step} of {group.size}"
    else:
        at = f"the last hop (after ring step {group.size - 1})"
    return RingCommError(
        f"cp_compile.ring_attention ({getattr(group, 'phase', 'forward')} {kind}): rank {group.rank} of the CP "
        f"group gave up at {at} while {label}: {why}. {who[0].upper() + who[1:]} has most likely exited, raised "
        "an error, or is not running the same ring op (every rank must call it with the same shapes and options, "
        f"in the same order). Fix: look for {whose} own error in its log; if it is only slow (still compiling, "
        "loading data), raise the limit: ring_attention(..., timeout=SECONDS) or RingCP(timeout=SECONDS) "
        "(default: the process group's timeout, init_process_group(timeout=...))."
    )


def _limit(group: CPGroup) -> str:
    """The wait limit in force, for messages."""
    timeout = getattr(group, "timeout", None)
    if timeout is not None:
        return f"{timeout:g} s"
    pg = group_timeout(group)
    return f"{pg:g} s (the process group's timeout)" if pg is not None else "the process group's timeout"
