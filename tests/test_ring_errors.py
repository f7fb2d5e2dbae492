"""Bad input to ``cp_compile.ring_attention``: the right exception, naming the problem and the fix.

Single process (the pytest process never initialises torch.distributed): tensor checks
(api.py ``_check_tensors``), option checks (config.py / kernels ``get_kernel``) and the
group check (_group.py). On 2 ranks: unsplittable sequence lengths, a wrong ``group``
object, a DeviceMesh without a 'cp' dim, unknown kernels — every rank must raise (no
hang), and the group must still work afterwards. Plus: a kernel registered under a
custom name is used by the ring and listed by ``kernel_names()``.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

import cp_compile
from cp_compile.kernels import get_kernel, kernel_names, register_kernel
from cp_compile.kernels.reference import ReferenceKernel

B, H, HKV, S, D = 2, 4, 2, 8, 16


def qkv(*, q_shape=(B, H, S, D), k_shape=(B, HKV, S, D), v_shape=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(*q_shape, generator=g).to(dtype)
    k = torch.randn(*k_shape, generator=g).to(dtype)
    v = torch.randn(*(v_shape or k_shape), generator=g).to(dtype)
    return q, k, v


def expect(exc_type, fn, *fragments):
    """Run fn; it must raise exc_type whose message contains every fragment (case-sensitive)."""
    with pytest.raises(exc_type) as info:
        fn()
    msg = str(info.value)
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in message: {msg!r}"
    return msg


@pytest.fixture(autouse=True)
def _no_process_group():
    assert not (dist.is_available() and dist.is_initialized()), "the pytest process must not init a group"


# --------------------------------------------------------------------------- single process: tensors


def test_dtype_mismatch():
    q, k, v = qkv()
    expect(ValueError, lambda: cp_compile.ring_attention(q, k.to(torch.bfloat16), v),
           "cp_compile.ring_attention", "dtypes differ", "torch.float32", "torch.bfloat16",
           "Fix: cast them to one dtype")


def test_device_mismatch_meta():
    q, k, v = qkv()
    expect(ValueError, lambda: cp_compile.ring_attention(q, k.to("meta"), v),
           "different devices", "cpu", "meta", "Fix: move them to one device")


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_three_dim_input(which):
    q, k, v = qkv()
    args = {"q": q, "k": k, "v": v}
    args[which] = args[which][0]  # drop the batch dim
    expect(ValueError, lambda: cp_compile.ring_attention(**args),
           f"{which} has shape {tuple(args[which].shape)}", "expected 4 dims (B, H, S_local, D)")


def test_non_tensor_input():
    q, k, v = qkv()
    expect(ValueError, lambda: cp_compile.ring_attention(q, k.tolist(), v), "k must be a Tensor", "list")


def test_integer_dtype():
    q, k, v = qkv()
    expect(ValueError, lambda: cp_compile.ring_attention(q.to(torch.int64), k.to(torch.int64), v.to(torch.int64)),
           "q has dtype torch.int64", "expected a floating-point dtype")


def test_batch_mismatch():
    q, k, v = qkv(k_shape=(B + 1, HKV, S, D))
    expect(ValueError, lambda: cp_compile.ring_attention(q, k, v),
           f"q {(B, H, S, D)} and k {(B + 1, HKV, S, D)}", "must agree on batch (dim 0) and head dim (dim 3)")


def test_head_dim_mismatch():
    q, k, v = qkv(k_shape=(B, HKV, S, D + 8))
    expect(ValueError, lambda: cp_compile.ring_attention(q, k, v),
           "must agree on batch (dim 0) and head dim (dim 3)")


def test_kv_shape_mismatch():
    q, k, v = qkv(v_shape=(B, HKV, S, D + 8))
    expect(ValueError, lambda: cp_compile.ring_attention(q, k, v),
           f"k {(B, HKV, S, D)} and v {(B, HKV, S, D + 8)} must have the same shape")


def test_local_length_mismatch():
    q, k, v = qkv(k_shape=(B, HKV, S - 2, D))
    expect(ValueError, lambda: cp_compile.ring_attention(q, k, v),
           f"q has {S} local tokens but k has {S - 2}", "Fix: shard q, k and v with one layout")


@pytest.mark.parametrize("h,hkv", [(4, 3), (3, 2), (2, 4)])
def test_heads_not_divisible(h, hkv):
    q, k, v = qkv(q_shape=(B, h, S, D), k_shape=(B, hkv, S, D))
    expect(ValueError, lambda: cp_compile.ring_attention(q, k, v),
           f"q has {h} heads, not a multiple of k's {hkv} heads", "H % H_kv == 0")


# --------------------------------------------------------------------------- single process: options


@pytest.mark.parametrize(
    "option,value,choices",
    [
        ("load_balance", "diagonal", "'zigzag', 'striped', 'contiguous'"),
        ("load_balance", None, "'zigzag', 'striped', 'contiguous'"),
        ("rotate", "ring", "'p2p', 'allgather'"),
    ],
)
def test_unknown_option(option, value, choices):
    q, k, v = qkv()
    expect(ValueError, lambda: cp_compile.ring_attention(q, k, v, **{option: value}),
           f"unknown {option} {value!r}", f"Fix: use one of {choices}")


def test_unknown_kernel():
    q, k, v = qkv()
    msg = expect(ValueError, lambda: cp_compile.ring_attention(q, k, v, kernel="flash9"),
                 "unknown kernel 'flash9'", "register_kernel")
    for name in ("'auto'", "'aten'", "'reference'"):
        assert name in msg, msg


def test_kernel_not_a_string():
    q, k, v = qkv()
    expect(ValueError, lambda: cp_compile.ring_attention(q, k, v, kernel=3), "kernel must be a name (str)")


def test_kernel_does_not_support_device():
    # all of q, k, v on 'meta': the tensor checks pass, the aten kernel refuses the device
    q, k, v = (t.to("meta") for t in qkv())
    expect(ValueError, lambda: cp_compile.ring_attention(q, k, v),
           "kernel 'aten': does not support torch.float32 on meta", "Fix: use kernel='reference'")


def test_register_kernel_errors():
    class Auto(ReferenceKernel):
        name = "auto"

    expect(ValueError, lambda: register_kernel(Auto()), "'auto' is reserved")
    expect(ValueError, lambda: register_kernel(ReferenceKernel()),
           "a kernel named 'reference' is already registered", "pass replace=True")
    assert get_kernel("reference", torch.device("cpu"), torch.float32).name == "reference"


@pytest.mark.parametrize("group", [object(), "cp"], ids=["object", "str"])
def test_group_without_process_group(group):
    q, k, v = qkv()
    expect(RuntimeError, lambda: cp_compile.ring_attention(q, k, v, group=group),
           "torch.distributed is not initialised", "torch.distributed.init_process_group", "group=None")


def test_tensor_errors_come_before_group_errors():
    # the local checks fire first, whatever the group argument
    q, k, v = qkv()
    expect(ValueError, lambda: cp_compile.ring_attention(q, k.double(), v, group=object()), "dtypes differ")


# --------------------------------------------------------------------------- 2 ranks


def _catch(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - report the type to the parent
        return (type(e).__name__, str(e))
    return None


def _errors_rank_fn():
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    g = torch.Generator().manual_seed(1)

    def local(s_local, h=4, hkv=2, d=16):
        return (torch.randn(1, h, s_local, d, generator=g), torch.randn(1, hkv, s_local, d, generator=g),
                torch.randn(1, hkv, s_local, d, generator=g))

    q3, k3, v3 = local(3)  # global length 6: zigzag on 2 ranks needs a multiple of 4
    out["zigzag_s3"] = _catch(lambda: cp_compile.ring_attention(q3, k3, v3, causal=True))
    q1, k1, v1 = local(1)  # global length 2
    out["zigzag_s1"] = _catch(lambda: cp_compile.ring_attention(q1, k1, v1, load_balance="zigzag"))
    q8, k8, v8 = local(8)
    out["unknown_kernel"] = _catch(lambda: cp_compile.ring_attention(q8, k8, v8, kernel="flash9"))
    out["group_object"] = _catch(lambda: cp_compile.ring_attention(q8, k8, v8, group=object()))
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    out["mesh_no_cp"] = _catch(lambda: cp_compile.ring_attention(q8, k8, v8, group=mesh))
    # odd local lengths are fine for striped / contiguous (S = 6 divides by N = 2)
    for lb in ("striped", "contiguous"):
        out[f"{lb}_s3_ok"] = _catch(lambda lb=lb: cp_compile.ring_attention(q3, k3, v3, causal=True, load_balance=lb))
    # after all that, the group still works: the collectives stayed in step (no hang)
    ref = cp_compile.ring_attention(q8, k8, v8, causal=True)
    cp_mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "cp"))
    out["mesh_cp_equal"] = torch.equal(cp_compile.ring_attention(q8, k8, v8, causal=True, group=cp_mesh), ref)
    out["pg_equal"] = torch.equal(cp_compile.ring_attention(q8, k8, v8, causal=True, group=dist.group.WORLD), ref)
    return out


def test_errors_on_two_ranks(ranks):
    results = ranks.run(2, _errors_rank_fn, timeout=180)
    assert len(results) == 2
    for r, res in enumerate(results):
        for key in ("zigzag_s3", "zigzag_s1"):
            assert res[key] is not None, f"rank {r}: {key} did not raise"
            typ, msg = res[key]
            assert typ == "ValueError", (r, key, res[key])
            s = 6 if key == "zigzag_s3" else 2
            assert f"sequence length {s} cannot be split by the 'zigzag' layout over 2 ranks" in msg, msg
            assert re.search(r"positive multiple of 4\b", msg), msg
            assert "Fix: pad the sequence to a multiple of 4" in msg, msg
        assert res["unknown_kernel"] is not None, f"rank {r}: unknown kernel did not raise"
        assert res["unknown_kernel"][0] == "ValueError" and "unknown kernel 'flash9'" in res["unknown_kernel"][1]
        assert res["group_object"] == (
            "TypeError", "cp_compile: group must be None, a ProcessGroup or a DeviceMesh, got object."
        ), res["group_object"]
        typ, msg = res["mesh_no_cp"]
        assert typ == "ValueError" and "none named 'cp'" in msg and "Fix: pass mesh['cp']" in msg, msg
        assert res["striped_s3_ok"] is None and res["contiguous_s3_ok"] is None, res
        assert res["mesh_cp_equal"] and res["pg_equal"], res


# --------------------------------------------------------------------------- custom kernel


class _CountingReference:
    """A trivial wrapper around the reference kernel, counting its calls."""

    name = "test_counting_reference"

    def __init__(self):
        self.inner = ReferenceKernel()
        self.calls = {"forward": 0, "backward": 0}

    def supports(self, device, dtype):
        return self.inner.supports(device, dtype)

    def forward(self, q, k, v, *, causal, scale):
        self.calls["forward"] += 1
        return self.inner.forward(q, k, v, causal=causal, scale=scale)

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        self.calls["backward"] += 1
        return self.inner.backward(dout, q, k, v, out, lse, causal=causal, scale=scale)


def _custom_kernel_rank_fn():
    from cp_compile.ring.plan import step_segments

    kern = _CountingReference()
    register_kernel(kern, replace=True)  # replace: the worker may have registered it in an earlier run
    n, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(7)
    full = [torch.randn(2, h, 16, 24, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4)]
    res = {"names": kernel_names()}
    grads = {}
    for name in (kern.name, "reference"):
        ql, kl, vl, dol = (cp_compile.shard(t, 2).float() for t in full)
        ql, kl, vl = (t.requires_grad_() for t in (ql, kl, vl))
        o = cp_compile.ring_attention(ql, kl, vl, causal=True, kernel=name)
        o.backward(dol)
        grads[name] = (o.detach(), ql.grad, kl.grad, vl.grad)
    res["equal_to_reference"] = all(torch.equal(a, b) for a, b in zip(grads[kern.name], grads["reference"]))
    res["calls"] = dict(kern.calls)
    res["expected_calls"] = sum(
        len(step_segments("zigzag", True, n, rank, (rank - t) % n, 8)) for t in range(n)
    )
    return res


def test_custom_kernel_registered_and_used(ranks):
    results = ranks.run(2, _custom_kernel_rank_fn, timeout=180)
    for r, res in enumerate(results):
        assert _CountingReference.name in res["names"] and res["names"][0] == "auto", res["names"]
        assert res["equal_to_reference"], f"rank {r}: the wrapper changed the numbers"
        # one forward and one backward call per planned rectangle (zigzag causal on 2 ranks: 2)
        assert res["expected_calls"] == 2
        assert res["calls"] == {"forward": res["expected_calls"], "backward": res["expected_calls"]}, res["calls"]
