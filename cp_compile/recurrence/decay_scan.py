"""The scan hidden in a decay matrix: ``exp(segsum(a)) @ x`` is ``y_i = exp(a_i) ⊙ y_{i-1} + x_i``.

Chunked state-space models (Mamba2's SSD, written as in the paper's reference and in every
Hugging Face Mamba2 hybrid) carry their state from chunk to chunk with a matrix over the chunks::

    a = F.pad(A_cumsum[..., -1], (1, 0))                   # (B, H, n + 1) each chunk's log decay, 0 first
    W = exp(segsum(a))                    # (B, H, n + 1, n + 1) W[i, j] = exp(a_{j+1} + … + a_i), j ≤ i
    y = einsum("bhzc,bchpn->bzhpn", W, cat([h0, S], 1))     # (B, n + 1, H, P, N) the state entering each chunk
    states, final = y[:, :-1], y[:, -1]

A lower-triangular matrix ``exp(Σ_{j<k≤i} a_k)`` applied along a dim is the diagonal linear
recurrence ``y_i = exp(a_i) y_{i-1} + x_i``: :mod:`cp_compile.passes.normalize.decay_scans` finds such
products and replaces them by one :class:`DecayScan` call, which carries the state-passing contract
(:mod:`.spec`) like a folded loop does, so each rank scans only its own chunks::

    scan(a (…, n, …), x (…, n, …), initial_state=h0 (x without dim d))
        -> (E (…, n, …): E_0 = h0, E_k = exp(a_{k-1}) ⊙ E_{k-1} + x_{k-1};  final E_n)

``E`` is the exclusive form (the state *entering* each step, what the SSD reads); the inclusive ``y``
is ``exp(a) ⊙ E + x``. ``a`` broadcasts against ``x``.
"""

from __future__ import annotations

from typing import Tuple

import torch

from .spec import RecurrenceSpec

Tensor = torch.Tensor


class DecayScan:
    """``(E, final) = scan(a, x, initial_state, homogeneous)`` along ``dim`` (see the module docstring)."""

    def __init__(self, dim: int, tokens_per_entry: int = 1) -> None:
        self.dim = dim
        self.tokens_per_entry = tokens_per_entry  # a scan over chunks of the sequence: the chunk size
        self.__name__ = self.__qualname__ = f"decay_scan_dim{dim}"
        self.recurrence_spec = RecurrenceSpec(
            target=self, seq_args={"a": dim, "x": dim}, outputs={0: dim}, initial_state="initial_state",
            final_state=1, transition="elementwise", homogeneous="homogeneous")

    def __call__(self, a: Tensor, x: Tensor, initial_state: Tensor, homogeneous: bool = False) -> Tuple[Tensor, Tensor]:
        """a (…, n, …) log decays, x (…, n, …) drives, initial_state: x's shape without ``dim``
        (or broadcastable to it). Returns the n entering states stacked along ``dim``, and the last."""
        d = self.dim
        h = initial_state.to(torch.result_type(x, initial_state)).expand(*self._state(x))
        decay = torch.exp(a)
        entering = []
        for k in range(x.shape[d]):  # the chunks of one run: few, each an elementwise step
            entering.append(h)
            step = decay.select(d, k) * h
            h = step if homogeneous else step + x.select(d, k)
        out = torch.stack(entering, d) if entering else x.new_zeros(x.shape)
        return out, h

    def _state(self, x: Tensor) -> Tuple[int, ...]:
        return tuple(s for i, s in enumerate(x.shape) if i != self.dim)

    def __repr__(self) -> str:
        return f"DecayScan(dim={self.dim})"


def is_decay_scan(target: object) -> bool:
    return isinstance(target, DecayScan)


__all__ = ["DecayScan", "is_decay_scan"]
