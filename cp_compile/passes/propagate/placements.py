"""The sequence-layout lattice of the rewrite, and how views move the sequence dim.

Every tensor value of a rewritten graph has one layout:

| layout          | meaning on each rank                                                  |
|-----------------|-----------------------------------------------------------------------|
| ``GLOBAL``      | the same full value on every rank (weights, positions, a gathered tensor, the loss) |
| ``Sharded(d, inner)`` | this rank's tokens along dim d, in load-balanced order. ``inner`` > 1 when d is a merged dim whose index is ``outer * (c * inner) + token * inner + rest`` (e.g. logits viewed (B*S, V): inner = 1; (B, S*H) would be inner = H) |
| ``Sharded(d, 1, window=(a, n))`` | a slice ``x[:, a:a+n]`` of a Sharded value (rules/getitem.py): global index i along d is the S-layout position p = i + a; this rank keeps its c rows at its positions (no copy); rows with p outside [a, a+n) are invalid (don't-care), masked by ``em.valid_mask`` like padding. Only the rules in ``registry.WINDOW_AWARE`` see one (the walk gathers it for any other) |
| ``Sharded(d, inner, chunk=C)`` | the sequence viewed in chunks of C tokens (``x.view(B, S // C, C, D)``): dim d holds this rank's chunks (global size S / C), in load-balanced order; each of the rank's runs is a whole number of chunks (``SeqIndex.chunk_refusal``). Only the rules in ``registry.CHUNK_AWARE`` see one (the walk gathers it for any other) |
| ``Local(d, token, rows)`` | rows along dim d are a data-dependent selection of this rank's tokens (``torch.where`` / ``nonzero`` on a Sharded mask, ``sort`` of Sharded expert ids: MoE routing), in no global order; ``token = (size, inner)`` when the values are indices into this rank's rows of a Sharded dim of that global size and inner; ``rows`` names the selection; d None: a per-rank summary of it (counts per expert) (rules/routing.py) |

One could tell a replicated value from a full-sequence one (``Replicated`` vs ``Full(d)``);
the rewrite does not need to (docs/design.md §6):
a Global value that meets a Sharded one in a broadcasting op must have size S (or
1) along the aligned dim in the original program, and size S there means "one entry
per position", so indexing it with this rank's positions is exactly right. No
guess about which ``arange`` or which ``[:S]`` slice is positional is ever made.
``Partial`` sums are all-reduced where they arise (see rules.py), so they never
flow between ops.
"""  # noqa: E501 (a Markdown table: its rows cannot wrap)

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import List, Optional, Sequence, Tuple, Union


@dataclass(frozen=True)
class Global:
    """Same full value on every rank."""


@dataclass(frozen=True)
class Sharded:
    """This rank's tokens along ``dim`` (see the module docstring for ``inner``)."""

    dim: int
    inner: int = 1
    window: Optional[Tuple[int, int]] = None  # (a, n): global index i along dim is S-layout position i + a
    chunk: int = 1  # tokens per entry along dim: > 1 when the dim indexes chunks of that many tokens

    def moved(self, dim: int) -> "Sharded":
        """The same tokens (and window, and chunking) along another dim."""
        return Sharded(dim, self.inner, self.window, self.chunk)


@dataclass(frozen=True)
class Local:
    """Rows along ``dim`` selected from this rank's tokens by data (see the module docstring)."""

    dim: Optional[int]  # None: a summary of the selection (histc counts, their cumsum), not rows
    token: Optional[Tuple[int, int]] = None  # (global size, inner) of the token dim the values index
    rows: str = ""  # the selection: the name of the node that made it (torch.where / nonzero / sort)
    whole: bool = False  # the selection is every local row, permuted (sort): it can be inverted


GLOBAL = Global()
Layout = Union[Global, Sharded, Local]


def _groups(in_shape: Sequence[int], out_shape: Sequence[int]) -> List[Tuple[range, range]]:
    """Split a view into groups of input dims and output dims with equal products.

    Size-1 dims form their own empty-product-neutral groups so they never glue
    unrelated dims together.
    """
    groups, i, j = [], 0, 0
    n_in, n_out = len(in_shape), len(out_shape)
    while i < n_in or j < n_out:
        if i < n_in and in_shape[i] == 1 and not (j < n_out and out_shape[j] == 1):
            groups.append((range(i, i + 1), range(j, j)))
            i += 1
            continue
        if j < n_out and out_shape[j] == 1 and not (i < n_in and in_shape[i] == 1):
            groups.append((range(i, i), range(j, j + 1)))
            j += 1
            continue
        i0, j0 = i, j
        p_in, p_out = in_shape[i] if i < n_in else 1, out_shape[j] if j < n_out else 1
        i, j = i + 1, j + 1
        while p_in != p_out:
            if p_in < p_out:
                p_in *= in_shape[i]
                i += 1
            else:
                p_out *= out_shape[j]
                j += 1
        groups.append((range(i0, i), range(j0, j)))
    return groups


def view_placement(in_shape: Sequence[int], out_shape: Sequence[int], src: Sharded, seq_len: int) -> Optional[Sharded]:
    """Where the sequence factor of ``src`` lands after viewing ``in_shape`` as ``out_shape``.

    Shapes are the *global* ones. The factor is ``seq_len / src.chunk`` entries (chunks of the
    sequence when ``src.chunk`` > 1). A view that splits it into (n, C) dims, ``x.view(B, S // C, C, D)``,
    lands in chunks of C tokens: ``Sharded(k, chunk=C)``; viewing chunks back with what follows them,
    ``y.view(B, S, D)``, lands in tokens again. Returns None when the view splits the factor any other
    way (not expressible per rank: the caller gathers).
    """
    units = seq_len // src.chunk
    for in_dims, out_dims in _groups(in_shape, out_shape):
        if src.dim not in in_dims:
            continue
        # Elements after the sequence factor within this group, in flattened order.
        inner_total = src.inner * prod(in_shape[d] for d in in_dims if d > src.dim)
        span_needed = units * inner_total
        after = 1
        for k in reversed(out_dims):
            if inner_total % after == 0 and (out_shape[k] * after) % span_needed == 0:
                return in_tokens(Sharded(k, inner_total // after, chunk=src.chunk))
            if after > inner_total and after % inner_total == 0 and out_shape[k] * (after // inner_total) == units:
                return Sharded(k, 1, chunk=src.chunk * (after // inner_total))  # (n, C, ...) with the entries split
            after *= out_shape[k]
        return None
    raise AssertionError(f"sequence dim {src.dim} not in view groups of {tuple(in_shape)} -> {tuple(out_shape)}")


def in_tokens(s: Sharded) -> Sharded:
    """Chunks merged with the C entries that follow each (index u·inner + r, inner = C·i'): tokens again."""
    if s.chunk > 1 and s.inner % s.chunk == 0:
        return Sharded(s.dim, s.inner // s.chunk)
    return s
