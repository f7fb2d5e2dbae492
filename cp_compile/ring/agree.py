"""Checks that every rank of the CP group calls the ring op the same way.

Ranks that pass different shapes or options to the ring would post transfers of
different sizes or in different patterns: at best a transport error, at worst a hang
or silently wrong numbers. So every call runs one small all-gather of its metadata
(shapes, dtype, causal, scale, layout, rotation, kernel, padding, window, mask,
document ids' shape and dtype, the mods' key, the mod buffers' shapes, the positions
table's shape and a fingerprint of its bytes: a per-batch layout must be the same table
on every rank):
every rank then sees every rank's arguments, and if they differ *every* rank raises
the same ``ValueError`` listing them, before any K/V moves.

Why every call and not only the first with new arguments: whether to skip must be
the same decision on every rank, and a rank cannot know without asking whether its
peers' arguments are new. (A per-process "already verified" cache let a rank repeat
old arguments and skip the check while a peer with new ones waited in it: a hang,
seen in the test suite.) The cost is one all-gather of ~40 int64 per ring call,
next to N K/V transfers.

:func:`check_device` refuses inputs on a device the group's backend cannot move.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..group import CPGroup
from ..options import LOAD_BALANCES, ROTATES
from .faults import collective_hop, wait_hop

Tensor = torch.Tensor

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# (field name, number of int64 slots) of the metadata row, in order
_FIELDS: Tuple[Tuple[str, int], ...] = (
    ("q shape", 4), ("k shape", 4), ("v shape", 4), ("dtype", 1), ("causal", 1), ("scale", 1),
    ("load_balance", 1), ("rotate", 1), ("kernel", 1), ("padding (valid length)", 1),
    ("sliding window", 1), ("attn_mask given", 1), ("doc_ids shape", 2), ("doc_ids dtype", 1), ("mods key", 1),
    ("mask_buffers shapes", 1), ("score_buffers shapes", 1), ("positions table shape", 2),
    ("positions table", 1),
)
_NO_TENSOR = -1  # a shape slot when the tensor is not given


def check_device(group: CPGroup, device: torch.device) -> None:
    """Raise if the group's backend has no transport for tensors on ``device``."""
    if group.pg is None or group.size == 1:
        return
    try:
        group.pg._get_backend(device)
    except RuntimeError:
        backend = dist.get_backend(group.pg)
        supported = sorted({d.type for d in getattr(group.pg, "_device_types", [])})
        raise ValueError(
            f"cp_compile.ring_attention: q, k, v are on {device} but the CP group's backend ({backend!r}) "
            f"moves tensors on {', '.join(supported) or 'other devices'} only. Fix: move q, k, v to "
            f"{' or '.join(supported) or 'a supported device'}, or create the group with a backend for "
            f"{device.type} (nccl for cuda, gloo for cpu)."
        ) from None


def _code(value: str) -> int:
    return zlib.crc32(value.encode())


def _scale_bits(scale: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(scale)))[0]


def _buffers_code(buffers: Optional[Sequence[Tensor]]) -> int:
    """One int for the count, shapes and dtypes of a list of buffers (-1: none given)."""
    if buffers is None:
        return _NO_TENSOR
    return _code(";".join(f"{tuple(t.shape)}{t.dtype}" for t in buffers))


def _table_code(table: Optional[Tensor]) -> Tuple[int, int, int]:
    """(rows, columns, crc32 of dtype and bytes) of a positions table, -1s when none is given.
    One pass over N·c int64 (8 bytes a token), once per ring call."""
    if table is None:
        return (_NO_TENSOR,) * 3
    shape = (tuple(table.shape) + (_NO_TENSOR,) * 2)[:2]
    data = table.detach().to("cpu").contiguous()
    return (*shape, zlib.crc32(data.reshape(-1).view(torch.uint8).numpy().tobytes(), _code(str(data.dtype))))


def metadata(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, load_balance: str,
             rotate: str, kernel: str, valid_len: int, window: int = -1,
             attn_mask: Optional[Tensor] = None, *, doc_ids: Optional[Tensor] = None, mods: str = "",
             mask_buffers: Optional[Sequence[Tensor]] = None,
             score_buffers: Optional[Sequence[Tensor]] = None,
             positions: Optional[Tensor] = None) -> Tuple[int, ...]:
    """This call's arguments as a row of ints (see ``_FIELDS``)."""
    dtype = _DTYPES.index(q.dtype) if q.dtype in _DTYPES else 100 + _code(str(q.dtype)) % 1000
    docs = (_NO_TENSOR, _NO_TENSOR, _NO_TENSOR) if doc_ids is None else (
        *(tuple(doc_ids.shape) + (_NO_TENSOR,) * 2)[:2], _code(str(doc_ids.dtype)))
    return (
        *q.shape, *k.shape, *v.shape, dtype, int(bool(causal)), _scale_bits(scale),
        LOAD_BALANCES.index(load_balance), ROTATES.index(rotate), _code(kernel), int(valid_len),
        int(window), int(attn_mask is not None), *docs, _code(mods) if mods else _NO_TENSOR,
        _buffers_code(mask_buffers), _buffers_code(score_buffers), *_table_code(positions),
    )


def _decode(name: str, vals: Sequence[int], own_kernel: str, own_code: int) -> Any:
    """A readable value of one field (for the error message)."""
    if name.endswith("shape"):
        return "none" if vals[0] == _NO_TENSOR else tuple(vals)
    (x,) = vals
    if name == "dtype":
        return _DTYPES[x] if x < len(_DTYPES) else "another dtype"
    if name == "causal":
        return bool(x)
    if name == "scale":
        return struct.unpack("<d", struct.pack("<q", x))[0]
    if name == "load_balance":
        return LOAD_BALANCES[x]
    if name == "rotate":
        return ROTATES[x]
    if name == "kernel":
        return repr(own_kernel) if x == own_code else "another kernel"
    if name in ("doc_ids dtype", "mods key", "positions table") or name.endswith("buffers shapes"):
        return "none" if x == _NO_TENSOR else f"#{x:08x}"  # a code: equal codes, equal values
    return x


def _differences(rows: List[Tuple[int, ...]], kernel: str) -> List[str]:
    """One 'field: rank 0 X, rank 1 Y' line per field that is not the same on every rank."""
    lines, at = [], 0
    for name, width in _FIELDS:
        vals = [row[at:at + width] for row in rows]
        if any(v != vals[0] for v in vals):
            per_rank = ", ".join(f"rank {r} {_decode(name, v, kernel, _code(kernel))}" for r, v in enumerate(vals))
            lines.append(f"{name}: {per_rank}")
        at += width
    return lines


def check_same_call(meta: Tuple[int, ...], group: CPGroup, device: torch.device, kernel: str) -> None:
    """Raise ``ValueError`` on every rank if the ranks' ``meta`` rows differ."""
    if group.pg is None or group.size == 1:
        return
    mine = torch.tensor(meta, dtype=torch.int64, device=device)
    rows = torch.empty(group.size * len(meta), dtype=torch.int64, device=device)
    work = dist.all_gather_single(rows, mine, group=group.pg, async_op=True)
    wait_hop(collective_hop(work, group, "argument check", "all-gathering every rank's ring op arguments", step=-1))
    table = [tuple(r) for r in rows.view(group.size, len(meta)).cpu().tolist()]
    diffs = _differences(table, kernel)
    if diffs:
        raise ValueError(
            "cp_compile.ring_attention: the ranks of the CP group called the ring op with different "
            f"arguments: {'; '.join(diffs)}. Fix: every rank must pass its own shard of the same global "
            "sequence (same batch, heads, head dim, length and dtype) and the same options (causal, scale, "
            "load_balance, rotate, kernel, window, masks, doc_ids, mods, and the same whole positions table, "
            "e.g. built on every rank from the same document lengths); with the ring_cp backend or "
            "@context_parallel every rank passes the same full batch."
        )
