"""Under ``inputs="full"``: refuse CP ranks that were given different batches.

Every rank of the CP group is meant to pass the *same* full batch: the rewritten
graph takes this rank's share of each sequence input and computes one global loss
from all ranks' shares. A data loader that gives each rank its own batch (what a
``DistributedSampler`` over all ranks does by default) breaks that silently: rank r
keeps rank r's tokens of *its* batch, and the "global" loss is a mix of the ranks'
batches, with no error anywhere.

Before (2 CP ranks, a sampler over every rank)::

    rank 0: model(input_ids=batch_a)  -> loss of tokens 0-15, 48-63 of batch_a
    rank 1: model(input_ids=batch_b)     and tokens 16-47 of batch_b: one mixed loss

After :func:`guard_same_batch` wraps the compiled graph, each call first fingerprints
every per-token input (those the graph shards, and those it keeps whole and indexes by
this rank's positions, such as labels that never reach attention; see
:func:`cp_compile.backend.compiler.batch_inputs`) on its device (one pass over its bytes,
no copy to the host, no Python loop), and all-gathers one row per rank over the CP group
(42 int64: the inputs' count, names, shapes and fingerprints, :func:`describe`). One
collective per call, before the graph runs and so before any ring transfer. Every rank
sees every rank's row and takes the same decision: if any differ, every rank raises
:class:`~cp_compile.errors.BatchMismatchError` naming the input and the fix, and no rank
is left waiting in a collective::

    rank 0: model(input_ids=batch_a)  -> BatchMismatchError: ... 'input_ids' (ranks [1] differ
    rank 1: model(input_ids=batch_b)     from rank 0 in contents) ... Fix: ... DistributedSampler(...)

The fingerprint (:func:`fingerprint`) is the sum, in int64 with wrap-around, of each
element's bytes read as an integer times an odd pseudo-random weight of its position
(splitmix64 of the row-major index). Integer sums are exact in any order, so equal
tensors give equal fingerprints on every device and kernel; a single changed element
always changes it (an odd weight is invertible mod 2^64), and a permutation changes it
unless the weights collide (~2^-64). Not a cryptographic hash: it catches loader
mistakes, not adversaries.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from ..errors import BatchMismatchError
from ..group import CPGroup
from ..ring.faults import RingGroup, collective_hop, wait_hop

Tensor = torch.Tensor

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # bytes -> an integer dtype
_MIX = (0x9E3779B97F4A7C15 - (1 << 64), 0xBF58476D1CE4E5B9 - (1 << 64), 0x94D049BB133111EB - (1 << 64))
_CACHE_ELEMENTS = 1 << 22  # position weights up to this many elements (32 MiB) are kept between calls
MAX_INPUTS, SHAPE_DIMS = 8, 4  # inputs described one by one, dims shown of each shape
ROW = 2 + MAX_INPUTS * (SHAPE_DIMS + 1)  # int64 per rank in the all-gather (42)

FIX = ("Fix: give every CP rank of a data-parallel replica the same batch, e.g. a sampler over the DP "
       "dimension only (DistributedSampler(num_replicas=dp_size, rank=dp_rank)); or declare pre-sharded "
       "inputs with inputs='local' (each rank passes its own cp_compile.shard).")


def position_weights(numel: int, device: torch.device) -> Tensor:
    """(numel,) int64: an odd, pseudo-random weight per row-major position (splitmix64 of the index)."""
    z = torch.arange(numel, dtype=torch.int64, device=device) * _MIX[0]
    z = (z ^ (z >> 30)) * _MIX[1]
    z = (z ^ (z >> 27)) * _MIX[2]
    return (z ^ (z >> 31)) | 1


def fingerprint(x: Tensor, weights: Tensor) -> Tensor:
    """() int64: the position-weighted sum of ``x``'s elements read as integers (any dtype, any
    strides, no copy of ``x``). ``weights``: :func:`position_weights` of ``x.numel()`` elements."""
    x = x.detach()
    if x.is_complex():
        x = torch.view_as_real(x)  # (..., 2) of its real dtype
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=x.device)
    as_int = x.view(_INT_OF_SIZE[x.element_size()])  # the same bytes (bool -> uint8, float32 -> int32, ...)
    return (as_int * weights.view(x.shape)).sum(dtype=torch.int64)  # int64, wraps around


def guard_same_batch(compiled: Callable, group: CPGroup, inputs: Sequence[Tuple[int, str]],
                     timeout: Any = None) -> Callable:
    """``compiled`` that first checks, on every call, that every CP rank was given the same
    values of ``inputs``, and raises :class:`BatchMismatchError` on every rank if not.

    ``inputs``: (position among the compiled graph's flat arguments, forward() argument name) of
    each per-token input. An input that requires a gradient is skipped: it is an activation of
    earlier code (eager code before a graph break, a DDPOptimizer piece), not data from a loader,
    and its last bits may differ between ranks where that code is nondeterministic (GPU atomics).
    Which inputs are checked depends only on the program, so it is the same on every rank.
    ``timeout``: seconds the collective may take (``None``: the process group's own)."""
    ring_group = RingGroup(group.pg, group.rank, group.size, timeout=timeout, phase="forward")
    cache: Dict[torch.device, Tensor] = {}

    def run(*args: Any, **kwargs: Any) -> Any:
        tensors = [(args[i], name) for i, name in inputs
                   if i < len(args) and isinstance(args[i], Tensor) and not args[i].requires_grad]
        if tensors and not any(_is_fake(t) for t, _ in tensors):
            check_same_batch(tensors, ring_group, cache)
        return compiled(*args, **kwargs)

    return run


def check_same_batch(tensors: List[Tuple[Tensor, str]], group: RingGroup,
                     cache: Dict[torch.device, Tensor]) -> None:
    """One all-gather of every rank's :func:`describe` row of ``tensors``; raise on every rank if the
    rows differ. ``cache``: per device, the longest position weights so far (at most _CACHE_ELEMENTS),
    kept between calls: any shorter input uses a prefix, so changing lengths do not grow it."""
    prints = []
    for t, _ in tensors:
        weights = cache.get(t.device)
        if weights is None or weights.numel() < t.numel():
            weights = position_weights(t.numel(), t.device)
            if t.numel() <= _CACHE_ELEMENTS:
                cache[t.device] = weights
        prints.append(fingerprint(t, weights[:t.numel()]).to(tensors[0][0].device))  # a prefix: the same weights
    rows = gather_rows(describe(tensors, torch.stack(prints)), group).cpu()  # (N, ROW): one row per rank
    if bool((rows != rows[0]).any()):
        raise BatchMismatchError(_message([name for _, name in tensors], rows))


def describe(tensors: List[Tuple[Tensor, str]], prints: Tensor) -> Tensor:
    """(ROW,) int64 on ``prints``' device: the number of inputs, a crc32 of their names, then per input
    its shape (SHAPE_DIMS dims, -1 padded; a longer shape: the crc32 of it in the last) and, last, the
    fingerprints ``prints`` (K,); inputs past MAX_INPUTS share the last slot (a crc32 of their shapes,
    a weighted sum of their fingerprints). A fixed length, so ranks that compiled different graphs still
    meet in one all-gather of one size (and are told apart by the first two numbers)."""
    shapes: List[int] = []
    for j, (t, _) in enumerate(tensors[:MAX_INPUTS]):
        dims = list(t.shape) if j < MAX_INPUTS - 1 or len(tensors) == MAX_INPUTS else \
            [_crc(";".join(str(tuple(u.shape)) for u, _ in tensors[j:]))]
        shapes += (dims + [-1] * SHAPE_DIMS)[:SHAPE_DIMS] if len(dims) <= SHAPE_DIMS else \
            dims[:SHAPE_DIMS - 1] + [_crc(str(tuple(dims)))]
    shapes += [-1] * (SHAPE_DIMS * MAX_INPUTS - len(shapes))
    if prints.numel() > MAX_INPUTS:  # the rest, weighted by their order: (MAX_INPUTS,)
        rest = prints[MAX_INPUTS - 1:] * (2 * torch.arange(prints.numel() - MAX_INPUTS + 1, device=prints.device) + 1)
        prints = torch.cat([prints[:MAX_INPUTS - 1], rest.sum().view(1)])
    head = torch.tensor([len(tensors), _crc(",".join(n for _, n in tensors)), *shapes], dtype=torch.int64)
    return torch.cat([head.to(prints.device), prints, prints.new_zeros(MAX_INPUTS - prints.numel())])


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


def gather_rows(mine: Tensor, group: RingGroup) -> Tensor:
    """(N, L) int64: every rank's ``mine`` (L,), rank-major; the guard's one collective."""
    rows = torch.empty(group.size * mine.numel(), dtype=torch.int64, device=mine.device)
    work = dist.all_gather_single(rows, mine, group=group.pg, async_op=True)
    wait_hop(collective_hop(work, group, "batch check", "all-gathering every rank's batch fingerprints", step=-1))
    return rows.view(group.size, mine.numel())


def _message(names: List[str], rows: Tensor) -> str:
    """The error: which inputs differ between which ranks, why it matters, and the fix."""
    if bool((rows[:, :2] != rows[0, :2]).any()):  # another number or set of inputs: another graph
        diffs = [f"the ranks compiled different graphs (rank 0's checks inputs {names}; ranks "
                 f"{[r for r in range(rows.shape[0]) if not torch.equal(rows[r, :2], rows[0, :2])]} other ones)"]
    else:
        diffs = []
        for j in range(min(len(names), MAX_INPUTS)):
            name = names[j] if j < MAX_INPUTS - 1 or len(names) == MAX_INPUTS else ", ".join(names[j:])
            at = 2 + j * SHAPE_DIMS
            shapes = [tuple(d for d in r if d != -1) for r in rows[:, at:at + SHAPE_DIMS].tolist()]  # per rank
            prints = rows[:, 2 + SHAPE_DIMS * MAX_INPUTS + j]  # (N,)
            differ = [r for r in range(rows.shape[0]) if shapes[r] != shapes[0] or prints[r] != prints[0]]
            if differ:
                what = ("shapes " + ", ".join(f"rank {r} {s}" for r, s in enumerate(shapes))
                        if len(set(shapes)) > 1 else "contents")
                diffs.append(f"'{name}' (ranks {differ} differ from rank 0 in {what})")
    return (
        f"cp_compile: the ranks of the CP group were given different batches: {'; '.join(diffs)}. With "
        "inputs='full' every CP rank must pass the same whole batch: each rank computes its share of the "
        "sequence and the loss is summed over the ranks, so different batches would give one loss mixed "
        f"from all of them, silently. {FIX} (check_batch=False turns this check off.)"
    )


def _is_fake(t: Tensor) -> bool:
    """Fake or meta tensors (DDPOptimizer runs each compiled piece on fake tensors at compile time):
    no bytes to compare."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or t.is_meta
