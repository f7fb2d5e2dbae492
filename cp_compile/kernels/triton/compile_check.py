"""Compile the Triton kernels for a real NVIDIA GPU without one (Triton -> PTX -> cubin).

    python -m cp_compile.kernels.triton.compile_check --arch 90 --dtype bf16 [--docs] [--mods]

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
_BUF_TYPES = {"torch.int32": "i32", "torch.int64": "i64", "torch.float32": "fp32", "torch.float16": "fp16",
              "torch.bfloat16": "bf16", "torch.bool": "i1", "torch.float64": "fp64"}


def _signature(fn, kernel: str, consts: Dict[str, object], dtype: str, bufs: List[str]) -> Dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in _PTRS[kernel]:
            sig[name] = "*" + _PTRS[kernel][name].replace("DT", dtype)
        elif name.startswith("BUF"):
            sig[name] = "*" + bufs[int(name[3:])]
        else:
            sig[name] = "fp32" if name in _FLOATS else "i32"
    return sig


def demo_mods():
    """The mods the ``mods`` variant compiles: packed documents ANDed with a sliding window, and ALiBi
    under a soft-cap, reading an int64 (B, S) document-id buffer and fp32 per-head slopes."""
    import torch

    from ...ring.mods import Mods

    def mask_mod(b, h, q_idx, kv_idx, doc):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx - kv_idx < 256)

    def score_mod(score, b, h, q_idx, kv_idx, slopes):
        return 30.0 * torch.tanh((score + slopes[h] * (kv_idx - q_idx)) / 30.0)

    return Mods(mask_mod, score_mod, (torch.zeros(2, 4096, dtype=torch.int64),), (torch.ones(32),))


def _mod_consts(mods: bool):
    """(MASK_MOD, SCORE_MOD, SCORE_GRAD, BUF pointer types) of the plain or the ``mods`` variant."""
    if not mods:
        return None, None, None, ["i32"] * 4
    import torch

    from .mods import kernel_mods, N_SLOTS

    m = demo_mods()
    km = kernel_mods(m, torch.device("cpu"))
    types = [_BUF_TYPES[str(t.dtype)] for t in km.buffers(m, torch.device("cpu"), torch.zeros(1, dtype=torch.int32))]
    return km.mask, km.score, km.score_grad, types[:N_SLOTS]


def compile_all(arch: int = 90, dtype: str = "bf16", head_dim: int = 128, group: int = 4,
                causal: bool = True, block_m: int = 64, block_n: int = 64, docs: bool = False,
                mods: bool = False) -> List[dict]:
    """Compile every kernel for ``sm_<arch>``; one record (name, shared bytes) per kernel.
    ``docs``: the packed-document variant (document ids masked in the kernel); ``mods``: with the
    generated mask_mod / score_mod of :func:`demo_mods`."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile_check needs the real compiler: unset TRITON_INTERPRET.")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from . import bwd, fwd
    from .configs import padded_head_dim

    d = padded_head_dim(head_dim)
    mask_fn, score_fn, grad_fn, bufs = _mod_consts(mods)
    tiles = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=d, MASK_MOD=mask_fn)
    jobs = {
        "_fwd_step": (fwd._fwd_step, dict(GROUP=group, CAUSAL=causal, DOCS=docs, COUNT=False, INTERP=False,
                                          SCORE_MOD=score_fn, **tiles)),
        "_finalize": (fwd._finalize, dict(INTERP=False, BLOCK_R=32, BLOCK_D=d)),
        "_bwd_dkdv": (bwd._bwd_dkdv, dict(GROUP=group, CAUSAL=causal, DOCS=docs, INTERP=False, SCORE_GRAD=grad_fn,
                                          **tiles)),
        "_bwd_dq": (bwd._bwd_dq, dict(GROUP=group, CAUSAL=causal, DOCS=docs, COUNT=False, INTERP=False,
                                      SCORE_GRAD=grad_fn, **tiles)),
    }
    records = []
    for name, (fn, consts) in jobs.items():
        src = ASTSource(fn, _signature(fn, name, consts, dtype, bufs),
                        constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=4, num_stages=2))
        records.append(dict(kernel=name, arch=arch, dtype=dtype, docs=docs, mods=mods,
                            shared_bytes=compiled.metadata.shared, cubin_bytes=len(compiled.asm["cubin"])))
    return records


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (80 = A100, 90 = H100)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="bf16")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--group", type=int, default=4, help="query heads per K/V head")
    p.add_argument("--docs", action="store_true", help="the packed-document variant")
    p.add_argument("--mods", action="store_true", help="with a generated mask_mod and score_mod (demo_mods)")
    args = p.parse_args(argv)
    for r in compile_all(args.arch, args.dtype, args.head_dim, args.group, docs=args.docs, mods=args.mods):
        tags = "".join(f" {t}" for t in ("docs", "mods") if r[t])
        print(f"{r['kernel']:10} sm_{r['arch']} {r['dtype']}{tags}: cubin {r['cubin_bytes']} B, "
              f"shared memory {r['shared_bytes']} B")


if __name__ == "__main__":
    main()
