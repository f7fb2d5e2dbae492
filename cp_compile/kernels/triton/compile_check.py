"""Compile the Triton kernels for a real NVIDIA GPU without one (Triton -> PTX -> cubin).

    python -m cp_compile.kernels.triton.compile_check --arch 90 --dtype bf16

Triton ships ptxas, so the whole GPU toolchain runs on a CPU-only machine. This is
how CI checks that the kernels obey the GPU's rules (tl.dot tile shapes, dtypes,
control flow, shared memory), which the interpreter does not enforce. It must run
*without* ``TRITON_INTERPRET`` (the interpreter replaces the compiler).
"""

from __future__ import annotations

import argparse
import os
from typing import Dict, List

DTYPE_NAMES = ("bf16", "fp16", "fp32")
_PTRS = {
    "_fwd_step": {"Q": "DT", "K": "DT", "V": "DT", "ACC": "fp32", "M": "fp32", "L": "fp32", "QPOS": "i32",
                  "KPOS": "i32", "QDOC": "i32", "KDOC": "i32", "COUNTER": "i32"},
    "_finalize": {"ACC": "fp32", "M": "fp32", "L": "fp32", "OUT": "DT", "LSE": "fp32"},
    "_bwd_dkdv": {"Q": "DT", "K": "DT", "V": "DT", "DO": "DT", "LSE": "fp32", "DELTA": "fp32", "DK": "fp32",
                  "DV": "fp32", "QPOS": "i32", "KPOS": "i32", "QDOC": "i32", "KDOC": "i32"},
    "_bwd_dq": {"Q": "DT", "K": "DT", "V": "DT", "DO": "DT", "LSE": "fp32", "DELTA": "fp32", "DQ": "fp32",
                "QPOS": "i32", "KPOS": "i32", "QDOC": "i32", "KDOC": "i32", "COUNTER": "i32"},
}
_FLOATS = ("scale",)


def _signature(fn, kernel: str, consts: Dict[str, object], dtype: str) -> Dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in _PTRS[kernel]:
            sig[name] = "*" + _PTRS[kernel][name].replace("DT", dtype)
        else:
            sig[name] = "fp32" if name in _FLOATS else "i32"
    return sig


def compile_all(arch: int = 90, dtype: str = "bf16", head_dim: int = 128, group: int = 4,
                causal: bool = True, block_m: int = 64, block_n: int = 64, docs: bool = False) -> List[dict]:
    """Compile every kernel for ``sm_<arch>``; one record (name, shared bytes) per kernel.
    ``docs``: the packed-document variant (document ids masked in the kernel)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile_check needs the real compiler: unset TRITON_INTERPRET.")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from . import bwd, fwd
    from .configs import padded_head_dim

    d = padded_head_dim(head_dim)
    tiles = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=d)
    jobs = {
        "_fwd_step": (fwd._fwd_step, dict(GROUP=group, CAUSAL=causal, DOCS=docs, COUNT=False, INTERP=False, **tiles)),
        "_finalize": (fwd._finalize, dict(INTERP=False, BLOCK_R=32, BLOCK_D=d)),
        "_bwd_dkdv": (bwd._bwd_dkdv, dict(GROUP=group, CAUSAL=causal, DOCS=docs, INTERP=False, **tiles)),
        "_bwd_dq": (bwd._bwd_dq, dict(GROUP=group, CAUSAL=causal, DOCS=docs, COUNT=False, INTERP=False, **tiles)),
    }
    records = []
    for name, (fn, consts) in jobs.items():
        src = ASTSource(fn, _signature(fn, name, consts, dtype),
                        constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=4, num_stages=2))
        records.append(dict(kernel=name, arch=arch, dtype=dtype, docs=docs, shared_bytes=compiled.metadata.shared,
                            cubin_bytes=len(compiled.asm["cubin"])))
    return records


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (80 = A100, 90 = H100)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="bf16")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--group", type=int, default=4, help="query heads per K/V head")
    p.add_argument("--docs", action="store_true", help="the packed-document variant")
    args = p.parse_args(argv)
    for r in compile_all(args.arch, args.dtype, args.head_dim, args.group, docs=args.docs):
        print(f"{r['kernel']:10} sm_{r['arch']} {r['dtype']}{' docs' if r['docs'] else ''}: cubin {r['cubin_bytes']} B, shared memory {r['shared_bytes']} B")


if __name__ == "__main__":
    main()
