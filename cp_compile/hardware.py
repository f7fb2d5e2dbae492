"""Hardware profiles: what the planner (``cp-compile plan``) and ``strategy="auto"`` price a run on.

A :class:`Hardware` is one accelerator and its links: ``gbps`` between the ``node_gpus`` devices of a
node (NVLink), ``inter_gbps`` between nodes (InfiniBand; ``None``: the same as ``gbps``, one flat
network). A CP group's ranks are numbered node by node, so a Ulysses group of at most ``node_gpus``
consecutive ranks stays inside a node, and a ring over more ranks than a node has crosses nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional


@dataclass(frozen=True)
class Hardware:
    """One device and its links (GB/s = 1e9 B/s per device in ONE direction)."""

    name: str
    tflops: float  # dense bf16/fp16 tensor-core TFLOP/s (no sparsity)
    gbps: float  # GB/s per device in one direction, between devices of one node
    hbm_gib: float  # device memory in GiB
    node_gpus: int = 8  # devices per node (the reach of ``gbps``)
    inter_gbps: Optional[float] = None  # GB/s per device between nodes; None: ``gbps`` (one flat network)

    def link_gbps(self, span: int) -> float:
        """The bandwidth of a group of ``span`` consecutive ranks: inside a node, or across nodes."""
        if span <= self.node_gpus or self.inter_gbps is None:
            return self.gbps
        return self.inter_gbps

    def stride_gbps(self, stride: int, span: int) -> float:
        """The bandwidth of a group whose members are ``stride`` ranks apart, ``span`` ranks end to end
        (a ring group of the 2-D grid): inside a node only if all members are."""
        return self.link_gbps(stride * (span - 1) + 1)


HARDWARE: Dict[str, Hardware] = {
    # A100-SXM4-80GB datasheet: 312 TFLOP/s dense bf16; NVLink 3 600 GB/s total = 300 per direction; 80 GiB HBM2e
    "a100-nvlink": Hardware("a100-nvlink", 312.0, 300.0, 80.0),
    # H100-SXM5-80GB datasheet: 989 TFLOP/s dense bf16 (1979: sparse); NVLink 4 900 GB/s = 450 per direction
    "h100-nvlink": Hardware("h100-nvlink", 989.0, 450.0, 80.0),
    # H100-SXM5 across nodes: one ConnectX-7 InfiniBand NDR 400 Gb/s per GPU = 50 GB/s per direction
    "h100-ib": Hardware("h100-ib", 989.0, 50.0, 80.0),
    # H200-SXM datasheet: 989 TFLOP/s dense bf16, NVLink 4 450 GB/s per direction, 141 GB (1e9 B) = 131.3 GiB
    "h200-nvlink": Hardware("h200-nvlink", 989.0, 450.0, round(141e9 / 2**30, 1)),
    # DGX H100 nodes of 8: NVLink 450 GB/s per direction inside a node, one NDR 400 Gb/s NIC per GPU between nodes
    "h100-cluster": Hardware("h100-cluster", 989.0, 450.0, 80.0, node_gpus=8, inter_gbps=50.0),
    # this project's CI machine: 2 busy CPU cores (66-200 GFLOP/s fp32 matmul measured), gloo over loopback
    "cpu-gloo": Hardware("cpu-gloo", 0.1, 1.0, 24.0, node_gpus=64),
}


def default_hardware(device_type: str) -> Hardware:
    """The profile ``strategy="auto"`` prices a run on when none is given: an H100 cluster on CUDA,
    the CPU + gloo profile elsewhere."""
    return HARDWARE["h100-cluster" if device_type == "cuda" else "cpu-gloo"]


HW_FORM = "custom:TFLOPS,GBPS,HBM_GIB[,NODE_GPUS,INTER_GBPS]"


def parse_hardware(spec: str) -> Hardware:
    """A name of :data:`HARDWARE`, or :data:`HW_FORM` (GB/s per direction; without the last two: nodes of 8
    on one flat network); a ValueError naming the choices or the form otherwise."""
    if spec in HARDWARE:
        return HARDWARE[spec]
    if not isinstance(spec, str) or not spec.startswith("custom:"):
        raise ValueError(f"unknown hardware {spec!r}; choose one of {', '.join(HARDWARE)} or {HW_FORM}")
    try:
        v = [float(x) for x in spec[len("custom:"):].split(",")]
        ok = len(v) in (3, 5) and all(math.isfinite(x) and x > 0 for x in v)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"malformed hardware {spec!r}; expected {HW_FORM} with positive numbers, "
                         "e.g. custom:989,450,80 or custom:989,450,80,8,50")
    if len(v) == 3:
        return Hardware(spec, *v)
    if not v[3].is_integer():
        raise ValueError(f"malformed hardware {spec!r}: NODE_GPUS must be a whole number of devices, got {v[3]:g}, "
                         "e.g. custom:989,450,80,8,50")
    return Hardware(spec, v[0], v[1], v[2], node_gpus=int(v[3]), inter_gbps=v[4])
