"""Document-aware sequence layout for packed documents, and the work model that measures it.

With packed documents (attention only inside a document, causal inside) query ``q``
of a document starting at ``s`` sees exactly ``q - s + 1`` keys. Global zig-zag
(:func:`cp_compile.sequence.rank_positions`) balances one causal triangle over the
ranks, not many: a rank whose positions fall in the tails of long documents gets far
more visible (query, key) pairs than one that holds their heads.

:func:`document_positions` builds a layout per packing (pure, no process group):

* **long documents** (length >= ``2 N * min_chunk``) are zig-zagged across the ranks
  with *mirrored* chunks: rank r gets a head chunk and the tail chunk at the same
  distance from the document's end (rank 0 the outermost pair, as
  TransformerEngine's THD format does with 2N chunks). Token offsets ``o`` and
  ``L - 1 - o`` see ``o + 1`` and ``L - o`` keys, ``L + 1`` together, so a rank's share
  of ``n`` tokens of a long document costs ``n (L + 1) / 2`` pairs whatever ``n`` is: the
  long documents are a fluid that can fill any token count at a known cost.
* **short documents** are kept whole (one rank, no cross-rank pieces, so no ring step
  but the local one touches them; at kernel-tile granularity a whole document is far
  cheaper than 2N slivers). They are placed greedily, most work-displacing first, on
  the rank whose final work is predicted highest (each short token displaces a long
  token of average cost ``p``), as long as the rank has room (``c = S / N`` tokens).
  A short document that fits nowhere whole is split at the room left (the rest goes
  on, as a piece with its offset into the document).
* the long documents then fill every rank up to exactly ``c`` tokens: each in turn is
  shared in proportion to what every rank still needs (integer shares by largest
  remainder), so each is spread over every rank and every ring step gets an even part
  of it. The longest one is the *corrector*: its head and tail chunks are sized per
  rank (not mirrored) so that every rank's total lands on S-wide work / N: a rank
  taking ``a`` head and ``n - a`` tail tokens costs an amount linear in ``a``, solved
  directly, so the only error left is integer rounding (about one token's key count
  per rank). If no document is long, the longest one plays that part. Every rank
  holds exactly ``S / N`` tokens; positions per rank are sorted increasing, as the
  ring requires. ``S`` must divide by ``N`` (pad the packing with a padding document
  otherwise).
* ``min_chunk`` trades balance for kernel efficiency: larger keeps more documents
  whole (fewer, larger fragments: fewer partly masked tiles), smaller gives the
  corrector and the greedy finer pieces. ``min_chunk=None`` picks the largest of
  :data:`MIN_CHUNKS` whose predicted per-rank and per-step balance are within the
  tolerance.

A single document of length divisible by 2N gives exactly global zig-zag.

Work model (no attention is computed): :func:`token_work` (visible keys per query),
:func:`rank_work` (per-rank visible pairs), :func:`step_pairs` (per (rank, ring step)
pairs, the rectangles of rank r's queries against the block of rank (r - t) mod N, as
benchmark 2 counts them), :func:`step_tiles` (the same at kernel-tile granularity: a
``block_m`` x ``block_n`` tile of local rows costs its whole area if any pair in it is
visible, as a tile-skipping kernel does), :func:`imbalance` (busiest / idlest) and
:func:`sync_makespan` (sum over steps of the slowest rank: a synchronous ring).
:func:`lengths_from_doc_ids` turns one row of the ring op's ``doc_ids`` into lengths, and
:func:`layout_table` stacks a layout into the (N, S/N) table the ring takes as ``positions=``.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from .sequence import rank_positions

Tensor = torch.Tensor
MIN_CHUNKS = (512, 256, 128, 64, 32, 16, 1)  # min_chunk=None tries these, largest first
Piece = Tuple[int, int]  # (first global position, length): a contiguous run of one document


def _check_lengths(doc_lengths: Sequence[int], world_size: int) -> List[int]:
    """Validated document lengths (zero-length documents dropped)."""
    if world_size < 1:
        raise ValueError(f"cp_compile: document_positions needs world_size >= 1, got {world_size}.")
    lengths = [int(x) for x in doc_lengths]
    bad = [x for x in lengths if x < 0]
    if bad:
        raise ValueError(f"cp_compile: document_positions got negative document lengths {bad[:4]}. "
                         "Fix: pass the token count of each packed document, in sequence order.")
    total = sum(lengths)
    if total == 0 or total % world_size:
        raise ValueError(
            f"cp_compile: document_positions: the packed sequence has {total} tokens, which {world_size} ranks "
            f"cannot hold in equal shares. Fix: pad the packing to a positive multiple of {world_size} tokens "
            "(e.g. append a padding document).")
    return lengths


def document_positions(doc_lengths: Sequence[int], world_size: int, *, min_chunk: Optional[int] = None,
                       tolerance: float = 0.05) -> List[Tensor]:
    """Per-rank global positions of a document-aware layout (see the module docstring).

    doc_lengths: token count of each packed document in sequence order (sum S, a
    multiple of ``world_size``). min_chunk: a document of length >= 2N * min_chunk is
    zig-zagged over every rank, a shorter one stays whole on one rank (1: zig-zag
    nearly everything). None (default) tries :data:`MIN_CHUNKS` from the largest (the
    fewest fragments: cheapest for a tile-skipping kernel) and keeps the first whose
    predicted busiest / idlest rank work and synchronous-ring makespan (in visible
    pairs, :func:`rank_work`, :func:`step_pairs`) are both within ``1 + tolerance`` of
    perfect; if none is, the one with the smallest makespan.
    Returns ``world_size`` int64 tensors of shape (S/N,), each sorted increasing,
    together a partition of range(S).
    """
    lengths = _check_lengths(doc_lengths, world_size)
    if world_size == 1:
        return [torch.arange(sum(lengths))]
    if min_chunk is not None:
        return _build(lengths, world_size, max(1, int(min_chunk)))
    best: Tuple[float, List[Tensor]] = (float("inf"), [])
    for chunk in MIN_CHUNKS:
        layout = _build(lengths, world_size, chunk)
        steps = step_pairs(lengths, layout)  # (N, N)
        ideal = float(steps.sum()) / world_size
        span = sync_makespan(steps) / ideal if ideal > 0 else 1.0
        if span <= 1 + tolerance and imbalance(steps.sum(1).tolist()) <= 1 + tolerance:
            return layout
        best = min(best, (span, layout), key=lambda x: x[0])
    return best[1]


def layout_table(doc_lengths: "Sequence[int] | Tensor", world_size: int, *, min_chunk: Optional[int] = None,
                 tolerance: float = 0.05) -> Tensor:
    """(N, S/N) int64: :func:`document_positions` stacked, the table the ring takes as ``positions=``
    (``cp_compile.ring_attention``, ``cp_compile.shard`` / ``unshard`` / ``positions``).

    ``doc_lengths``: document lengths in sequence order, or a (B|1, S) integer ``doc_ids`` tensor.
    One table serves the whole batch, so for B > 1 rows packed differently the documents are
    the pieces between the union of every row's boundaries (exact for every row; balanced for
    their common refinement). Build it on every rank from the same data: ranks must pass the
    same table.
    """
    if isinstance(doc_lengths, Tensor) and doc_lengths.dim() == 2 and doc_lengths.shape[0] > 1:
        ids = doc_lengths.cpu()
        cut = (ids[:, 1:] != ids[:, :-1]).any(0)  # (S - 1,) a boundary in some row
        doc_lengths = lengths_from_doc_ids(torch.cat([cut.new_zeros(1), cut]).long().cumsum(0))
    elif isinstance(doc_lengths, Tensor):
        doc_lengths = lengths_from_doc_ids(doc_lengths)
    layout = document_positions(doc_lengths, world_size, min_chunk=min_chunk, tolerance=tolerance)
    return torch.stack(layout)  # (N, S/N)


def _build(lengths: List[int], world_size: int, min_chunk: int) -> List[Tensor]:
    """The layout for one ``min_chunk`` (lengths checked, world_size >= 2)."""
    c = sum(lengths) // world_size
    docs = [(s, n) for s, n in zip(_starts(lengths), lengths) if n > 0]
    long_docs = [d for d in docs if d[1] >= 2 * world_size * min_chunk]
    if not long_docs:
        long_docs = [max(docs, key=lambda d: d[1])]  # the filler: the longest document
    long_set = set(long_docs)
    short = [d for d in docs if d not in long_set]
    p = sum(n * (n + 1) / 2 for _, n in long_docs) / sum(n for _, n in long_docs)  # pairs per long token
    pieces, used = _place_short(short, world_size, c, p)
    long_docs.sort(key=lambda d: d[1])  # ascending: the last, longest, is the corrector
    shares = _share_long([n for _, n in long_docs], [c - u for u in used])
    for (start, n), share in zip(long_docs[:-1], shares[:-1]):
        for r, piece_list in enumerate(_mirrored(start, n, share)):
            pieces[r].extend(piece_list)
    cum = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(token_work(lengths), 0)])  # (S + 1,)
    fixed = [sum(int(cum[s + n] - cum[s]) for s, n in pcs) for pcs in pieces]
    goal = int(cum[-1]) / world_size
    start, n = long_docs[-1]
    for r, piece_list in enumerate(_asymmetric(start, n, shares[-1], [goal - f for f in fixed])):
        pieces[r].extend(piece_list)
    return [torch.sort(torch.cat([torch.arange(s, s + n) for s, n in pcs if n > 0]))[0] for pcs in pieces]


def _starts(lengths: List[int]) -> List[int]:
    out, acc = [], 0
    for n in lengths:
        out.append(acc)
        acc += n
    return out


def _place_short(short: List[Piece], world: int, c: int,
                 p: float) -> Tuple[List[List[Piece]], List[int]]:
    """Short documents onto ranks: (pieces per rank, tokens used per rank).

    A short document of n tokens on a rank replaces n long tokens (about ``p`` pairs
    each), so it changes the rank's final work by n (n + 1) / 2 - p n (<= 0). The most
    negative go first, each on the rank predicted busiest that has room.
    """
    pieces: List[List[Piece]] = [[] for _ in range(world)]
    used = [0] * world
    score = [0.0] * world  # predicted final work, minus a constant
    for start, n in sorted(short, key=lambda d: d[1] * ((d[1] + 1) / 2 - p)):
        offset = 0
        while offset < n:
            left = n - offset
            fits = [r for r in range(world) if used[r] + left <= c]
            if fits:
                r, take = max(fits, key=lambda i: (score[i], -used[i])), left
            else:  # nowhere whole: the rank with the most room takes what fits
                r = min(range(world), key=lambda i: used[i])
                take = c - used[r]
            pieces[r].append((start + offset, take))
            pairs = (offset + take) * (offset + take + 1) / 2 - offset * (offset + 1) / 2
            used[r] += take
            score[r] += pairs - p * take
            offset += take
    return pieces, used


def _share_long(long_lengths: List[int], need: List[int]) -> List[List[int]]:
    """Integer shares [document][rank] of the long documents, filling ``need`` exactly.

    Each document in turn is shared in proportion to what each rank still needs
    (largest-remainder rounding, never above the need), so every long document is
    spread over every rank with room and each ring step gets an even part of it; the
    last one takes exactly what is left.
    """
    rem = list(need)
    out = []
    for n in long_lengths:
        left = sum(rem)  # >= n: the long documents fill exactly the room the short ones left
        share = [n * x // left for x in rem]
        frac = [n * x % left for x in rem]
        for r in sorted(range(len(rem)), key=lambda i: (-frac[i], i))[: n - sum(share)]:
            share[r] += 1
        rem = [x - s for x, s in zip(rem, share)]
        out.append(share)
    return out


def _asymmetric(start: int, length: int, share: List[int], target: List[float]) -> List[List[Piece]]:
    """Rank r's share of the corrector document as a head and a tail chunk sized to cost ``target[r]`` pairs.

    With ``h``/``t`` tokens already taken from the front/back, a rank taking ``a`` head and
    ``n - a`` tail tokens costs ``a (h + n - L + t) + n (L - t) - n (n - 1) / 2`` pairs: linear
    in ``a``, so the head size is solved for directly (clamped to [0, n]). The ranks
    needing the largest correction go outermost (widest range); the innermost takes
    the middle run, and hits its target too when the others do (the total is fixed).
    """
    order = sorted((r for r in range(len(share)) if share[r] > 0),
                   key=lambda r: -abs(target[r] - share[r] * (length + 1) / 2))
    out: List[List[Piece]] = [[] for _ in share]
    head = tail = 0
    excess = 0.0  # pairs the ranks placed so far got above their targets (integer rounding, clamping)
    for i, r in enumerate(order[:-1]):
        n = share[r]
        slope = head + n - length + tail  # < 0 unless this rank takes everything left
        base = n * (length - tail) - n * (n - 1) / 2  # cost with a = 0 (all n tokens at the tail)
        goal = target[r] - excess / (len(order) - i)  # spread earlier misses over the ranks still to place
        a = min(max(n // 2 if slope == 0 else round((goal - base) / slope), 0), n)
        excess += a * slope + base - target[r]
        out[r] = [(start + head, a), (start + length - tail - (n - a), n - a)]
        head, tail = head + a, tail + n - a
    if order:
        out[order[-1]] = [(start + head, length - head - tail)]
    return out


def _mirrored(start: int, length: int, share: List[int]) -> List[List[Piece]]:
    """Rank r's share of one document as a head chunk and the mirrored tail chunk, rank 0 outermost.

    An odd share's extra token goes to whichever side (head or tail) is behind, so the
    head and tail offsets never differ by more than one token.
    """
    head = tail = 0  # tokens taken from the front / from the back so far
    out = []
    for n in share:
        small, big = n // 2, n - n // 2
        a, b = (big, small) if head < tail else (small, big)
        out.append([(start + head, a), (start + length - tail - b, b)])
        head, tail = head + a, tail + b
    return out


def lengths_from_doc_ids(doc_ids: Tensor) -> List[int]:
    """Document lengths, in order, of a (S,) or (1, S) integer document-id tensor (the ring op's ``doc_ids``).

    Each document must be one contiguous run of its id (as ``doc_ids_from_cu_seqlens``
    and ``doc_ids_from_position_ids`` build them): an id that comes back after another
    would make the mask join the two runs, which this layout does not model.
    """
    ids = doc_ids.reshape(-1) if doc_ids.dim() == 1 or doc_ids.shape[0] == 1 else None
    if ids is None or ids.numel() == 0 or ids.dtype.is_floating_point:
        raise ValueError(
            f"cp_compile: lengths_from_doc_ids takes one non-empty integer row of document ids, got shape "
            f"{tuple(doc_ids.shape)} and dtype {doc_ids.dtype}. Fix: pass doc_ids[b] of one packed sequence.")
    ids = ids.cpu()
    _, counts = torch.unique_consecutive(ids, return_counts=True)
    if counts.numel() != torch.unique(ids).numel():
        raise ValueError(
            "cp_compile: lengths_from_doc_ids: some document id occurs in two separate runs, so its tokens "
            "would attend across the documents between them. Fix: give every packed document its own id "
            "(e.g. cp_compile.doc_ids_from_cu_seqlens).")
    return counts.tolist()


# ---------------------------------------------------------------- work model
def doc_starts(doc_lengths: Sequence[int]) -> Tensor:
    """(S,) int64: the first position of each position's document."""
    lengths = torch.tensor([int(x) for x in doc_lengths], dtype=torch.int64)
    first = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(first, lengths)


def token_work(doc_lengths: Sequence[int]) -> Tensor:
    """(S,) int64: how many keys each query sees (causal, same document): q - start(q) + 1."""
    starts = doc_starts(doc_lengths)
    return torch.arange(starts.numel()) - starts + 1


def rank_work(doc_lengths: Sequence[int], layout: Sequence[Tensor]) -> List[int]:
    """Visible (query, key) pairs of each rank's query rows, over the whole ring."""
    w = token_work(doc_lengths)
    return [int(w[p].sum()) for p in layout]


def _held(starts: Tensor, layout: Sequence[Tensor]) -> Tensor:
    """(N, S + 1) int64: ``held[s, x]`` = how many of rank s's positions are below x.

    Rank s's local key rows visible to query q (causal, same document) are then the
    run ``[held[s, start(q)], held[s, q + 1])``: positions are sorted, so the keys in
    [start(q), q] are consecutive local rows.
    """
    world = len(layout)
    owner = torch.empty(starts.numel(), dtype=torch.int64)  # (S,) which rank holds each position
    for r, pos in enumerate(layout):
        owner[pos] = r
    held = torch.zeros(world, starts.numel() + 1, dtype=torch.int64)
    held[:, 1:] = torch.cumsum(torch.nn.functional.one_hot(owner, world).T, 1)
    return held


def step_pairs(doc_lengths: Sequence[int], layout: Sequence[Tensor]) -> Tensor:
    """(N, N) int64 [rank, step]: visible pairs of rank r's queries against the block of rank (r - t) mod N."""
    starts, world = doc_starts(doc_lengths), len(layout)
    held = _held(starts, layout)
    out = torch.zeros(world, world, dtype=torch.int64)
    for r, q in enumerate(layout):
        per_src = (held[:, q + 1] - held[:, starts[q]]).sum(1)  # (N,) keys in [start(q), q] per source rank
        out[r] = per_src[[(r - t) % world for t in range(world)]]
    return out


def step_tiles(doc_lengths: Sequence[int], layout: Sequence[Tensor], block_m: int = 128,
               block_n: int = 64) -> Tensor:
    """(N, N) int64 [rank, step]: pairs a tile-skipping kernel computes at each ring step.

    The rectangle (rank r's local rows x the visiting block's local rows) is cut into
    ``block_m`` x ``block_n`` tiles; a tile with any visible pair costs its whole area
    (masked pairs included), one with none costs nothing.
    """
    starts, world = doc_starts(doc_lengths), len(layout)
    held = _held(starts, layout)
    out = torch.zeros(world, world, dtype=torch.int64)
    for r, q in enumerate(layout):
        lo, hi = held[:, starts[q]], held[:, q + 1]  # (N, c): each query's visible key rows per source
        for t in range(world):
            src = (r - t) % world
            out[r, t] = _tile_cost(lo[src], hi[src], q.numel(), layout[src].numel(), block_m, block_n)
    return out


def _tile_cost(lo: Tensor, hi: Tensor, lq: int, lk: int, bm: int, bn: int) -> int:
    """Area of the tiles touched when query row i sees key rows [lo_i, hi_i) (a contiguous run)."""
    rows = torch.nonzero(hi > lo).flatten()
    if rows.numel() == 0:
        return 0
    nqt, nkt = -(-lq // bm), -(-lk // bn)
    cover = torch.zeros(nqt, nkt + 1, dtype=torch.int64)  # difference array of touched key tiles per query tile
    qt = rows // bm
    cover.index_put_((qt, lo[rows] // bn), torch.ones_like(qt), accumulate=True)
    cover.index_put_((qt, (hi[rows] - 1) // bn + 1), -torch.ones_like(qt), accumulate=True)
    touched = torch.cumsum(cover, 1)[:, :nkt] > 0  # (nqt, nkt)
    height = torch.clamp(lq - torch.arange(nqt) * bm, max=bm)  # partial last tiles count their real size
    width = torch.clamp(lk - torch.arange(nkt) * bn, max=bn)
    return int((touched * height[:, None] * width[None, :]).sum())


def imbalance(per_rank: Sequence[float]) -> float:
    """Busiest / idlest rank (inf if some rank has nothing to do)."""
    lo, hi = min(per_rank), max(per_rank)
    return float(hi) / float(lo) if lo > 0 else float("inf")


def sync_makespan(steps: Tensor) -> int:
    """Sum over ring steps of the slowest rank's work: a synchronous ring's time, in pairs."""
    return int(steps.max(0).values.sum())


def zigzag_layout(seq_len: int, world_size: int) -> List[Tensor]:
    """Global zig-zag positions of every rank (:func:`cp_compile.sequence.rank_positions`)."""
    return [rank_positions(seq_len, world_size, r, "zigzag") for r in range(world_size)]
