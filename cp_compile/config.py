"""Options of cp_compile, validated once with errors that name the fix.

:class:`RingOptions` holds the knobs of the ring attention op; the backend's
graph-level options are :class:`cp_compile.backend.BackendOptions`. Both are frozen
dataclasses, so an options object can be hashed into compile caches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

LOAD_BALANCES: Tuple[str, ...] = ("zigzag", "striped", "contiguous")
ROTATES: Tuple[str, ...] = ("p2p", "allgather")


def check_choice(what: str, value: object, choices: Tuple[str, ...]) -> str:
    """Return ``value`` if it is one of ``choices``; raise a ValueError naming them otherwise."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(
            f"cp_compile: unknown {what} {value!r}. Fix: use one of {', '.join(map(repr, choices))}."
        )
    return value


@dataclass(frozen=True)
class RingOptions:
    """How the ring attention op runs.

    Attributes:
        load_balance: token-to-rank layout: ``"zigzag"`` (default; balanced causal
            work), ``"striped"`` (token i on rank i mod N) or ``"contiguous"``.
        rotate: ``"p2p"`` (default) passes K/V around the ring with double-buffered
            async send/recv; ``"allgather"`` gathers all K/V once (N x the K/V memory,
            fewer and larger transfers).
        kernel: local block kernel: ``"auto"`` (aten), ``"aten"``, ``"reference"``
            (fp32 plain PyTorch, for tests) or any name registered with
            :func:`cp_compile.kernels.register_kernel`.
    """

    load_balance: str = "zigzag"
    rotate: str = "p2p"
    kernel: str = "auto"

    def __post_init__(self) -> None:
        check_choice("load_balance", self.load_balance, LOAD_BALANCES)
        check_choice("rotate", self.rotate, ROTATES)
        # Kernel names are checked against the live registry (custom kernels may be
        # registered at run time): see cp_compile.kernels.get_kernel.
        if not isinstance(self.kernel, str):
            raise ValueError(f"cp_compile: kernel must be a name (str), got {self.kernel!r}.")
