"""Options of cp_compile, validated once with errors that name the fix.

:class:`RingOptions` holds the knobs of the ring attention op; the backend's
graph-level options are :class:`cp_compile.backend.BackendOptions`. Both are frozen
dataclasses, so an options object can be hashed into compile caches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

LOAD_BALANCES: Tuple[str, ...] = ("zigzag", "striped", "contiguous")
ROTATES: Tuple[str, ...] = ("p2p", "allgather")


def check_choice(what: str, value: object, choices: Tuple[str, ...]) -> str:
    """Return ``value`` if it is one of ``choices``; raise a ValueError naming them otherwise."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(
            f"cp_compile: unknown {what} {value!r}. Fix: use one of {', '.join(map(repr, choices))}."
        )
    return value


def check_timeout(value: object) -> Optional[float]:
    """Return ``value`` as seconds (> 0) or None; raise a ValueError naming the fix otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"cp_compile: timeout must be a positive number of seconds or None, got {value!r}. "
            "Fix: e.g. timeout=300, or None for the process group's own timeout."
        )
    return float(value)


@dataclass(frozen=True)
class RingOptions:
    """How the ring attention op runs.

    Attributes:
        load_balance: token-to-rank layout: ``"zigzag"`` (default; balanced causal
            work), ``"striped"`` (token i on rank i mod N) or ``"contiguous"``.
        rotate: ``"p2p"`` (default) passes K/V around the ring with double-buffered
            async send/recv; ``"allgather"`` gathers all K/V once (N x the K/V memory,
            fewer and larger transfers).
        kernel: local block kernel: ``"auto"`` (``"triton"`` on CUDA when Triton is
            installed, else ``"aten"``), ``"aten"``, ``"triton"``, ``"reference"``
            (fp32 plain PyTorch, for tests) or any name registered with
            :func:`cp_compile.kernels.register_kernel`.
        timeout: seconds every wait of the ring may take before it raises
            :class:`cp_compile.ring.faults.RingCommError` naming the peer, the step and
            the direction; ``None`` (default): the process group's own timeout
            (``init_process_group(timeout=...)``, 30 min unless set).
    """

    load_balance: str = "zigzag"
    rotate: str = "p2p"
    kernel: str = "auto"
    timeout: Optional[float] = None

    def __post_init__(self) -> None:
        check_choice("load_balance", self.load_balance, LOAD_BALANCES)
        check_choice("rotate", self.rotate, ROTATES)
        check_timeout(self.timeout)
        # Kernel names are checked against the live registry (custom kernels may be
        # registered at run time): see cp_compile.kernels.get_kernel.
        if not isinstance(self.kernel, str):
            raise ValueError(f"cp_compile: kernel must be a name (str), got {self.kernel!r}.")
