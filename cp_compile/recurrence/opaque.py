"""A registered Python kernel as one opaque op of the compiled graphs: run for real, never traced.

The kernels of the field are Triton or CUDA code behind a Python function (flash-linear-attention's
``fused_recurrent_gla``, mamba_ssm's scans). Neither Dynamo nor AOTAutograd can run them on fake
tensors ("Cannot access data pointer of Tensor"), and ring_cp must see each call as one node whose
arguments it can narrow to a run. So :func:`graph_function` gives the kernel a stand-in with the
same signature that Dynamo puts in the graph as one node (``allow_in_graph``), substituted for the
kernel wherever a model calls it (``torch._dynamo.substitute_in_graph``); the stand-in calls one
custom op::

    model: o, h = fused_recurrent_gla(q, k, v, gk=g, output_final_state=True)
    Dynamo graph: fused_recurrent_gla'(q, k, v, gk=g, output_final_state=True)   # one node, named args
    AOT graph:    cp_compile::recurrent_kernel("fla...fused_recurrent_gla", call, [q, k, v, g]) -> [o, h]
    backward:     cp_compile::recurrent_kernel_backward(..., [q, k, v, g], [do, dh]) -> [dq, dk, dv, dg]

Shapes come from ``fake`` (a function of the kernel's arguments returning tensors of the result's
shapes and dtypes; default: the kernel itself, which serves a kernel written in torch ops). The
backward runs the kernel again under autograd on the saved inputs and asks autograd for the input
gradients (the kernel's own backward: what eager would run, at the price of a second forward).
Non-tensor arguments travel as a registered call signature (``call``), since a custom op takes only
tensors and fixed types.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

Tensor = torch.Tensor

_KERNELS: Dict[str, Tuple[Callable, Callable]] = {}  # kernel name -> (kernel, fake)
_CALLS: Dict[str, Dict[str, Any]] = {}  # call key -> {parameter: ("tensor", index) | ("value", v)}
_NONES: Dict[str, Tuple[Optional[bool], ...]] = {}  # call key -> which results are None (None: a lone tensor)
_GRAPH_FNS: Dict[Callable, Callable] = {}  # kernel -> its graph function (made once: Dynamo keeps it)


def graph_function(kernel: Callable, fake: Optional[Callable] = None) -> Callable:
    """The function the compiled graphs call in place of ``kernel`` (see the module docstring);
    made once per kernel, ``fake`` updated on each call."""
    name = f"{getattr(kernel, '__module__', '')}.{getattr(kernel, '__qualname__', repr(kernel))}"
    _KERNELS[name] = (kernel, fake or kernel)
    if kernel in _GRAPH_FNS:
        return _GRAPH_FNS[kernel]
    signature = inspect.signature(kernel)

    def in_graph(*args: Any, **kwargs: Any) -> Any:
        tensors, call = _pack(signature, args, kwargs)
        return _unpack(call, recurrent_kernel(name, call, tensors))

    in_graph.__signature__ = signature  # type: ignore[attr-defined]
    in_graph.__name__, in_graph.__qualname__ = kernel.__name__, kernel.__qualname__
    in_graph.__doc__ = kernel.__doc__
    torch._dynamo.allow_in_graph(in_graph)

    def substitute(*args: Any, **kwargs: Any) -> Any:
        return in_graph(*args, **kwargs)

    torch._dynamo.substitute_in_graph(kernel, skip_signature_check=True)(substitute)
    _GRAPH_FNS[kernel] = in_graph
    return in_graph


def _pack(signature: inspect.Signature, args: tuple, kwargs: dict) -> Tuple[List[Tensor], str]:
    """The call's tensors in parameter order and the key of its non-tensor arguments."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    tensors: List[Tensor] = []
    call: Dict[str, Any] = {}
    for name, value in bound.arguments.items():
        if isinstance(value, Tensor):
            call[name] = ("tensor", len(tensors))
            tensors.append(value)
        else:
            call[name] = ("value", value)
    key = repr(sorted(call.items()))
    _CALLS.setdefault(key, call)
    return tensors, key


def _arguments(call: str, tensors: List[Tensor]) -> Dict[str, Any]:
    return {n: tensors[v] if kind == "tensor" else v for n, (kind, v) in _CALLS[call].items()}


def _results(call: str, out: Any, like: Tensor) -> List[Tensor]:
    """A kernel's result as the op's list of tensors (an absent result as an empty placeholder)."""
    if isinstance(out, Tensor):
        _NONES[call] = (None,)
        return [out]
    _NONES[call] = tuple(o is None for o in out)
    return [like.new_empty(0) if o is None else o for o in out]


def _unpack(call: str, out: List[Tensor]) -> Any:
    nones = _NONES[call]
    if nones == (None,):
        return out[0]
    return tuple(None if none else o for o, none in zip(out, nones))


@torch.library.custom_op("cp_compile::recurrent_kernel", mutates_args=())
def recurrent_kernel(kernel: str, call: str, tensors: List[Tensor]) -> List[Tensor]:
    """Run registered ``kernel`` on ``tensors`` and the non-tensor arguments of ``call``."""
    fn = _KERNELS[kernel][0]
    return [o.clone() if any(o is t for t in tensors) else o  # never return an input (custom op rule)
            for o in _results(call, fn(**_arguments(call, tensors)), tensors[0])]


@recurrent_kernel.register_fake
def _recurrent_kernel_fake(kernel: str, call: str, tensors: List[Tensor]) -> List[Tensor]:
    fake = _KERNELS[kernel][1]
    return [torch.empty_like(o) for o in _results(call, fake(**_arguments(call, tensors)), tensors[0])]


@torch.library.custom_op("cp_compile::recurrent_kernel_backward", mutates_args=())
def recurrent_kernel_backward(kernel: str, call: str, tensors: List[Tensor], grads: List[Tensor]) -> List[Tensor]:
    """The input gradients of one call: the kernel rerun under autograd, ``grads`` its results' gradients
    (empty: none); zeros for an input the results do not depend on."""
    fn = _KERNELS[kernel][0]
    with _autograd_on():
        xs = [t.detach().requires_grad_(t.is_floating_point()) for t in tensors]
        out = _results(call, fn(**_arguments(call, xs)), xs[0])
        pairs = [(o, g) for o, g in zip(out, grads) if o.requires_grad and g.numel()]
        wanted = [x for x in xs if x.requires_grad]
        found = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True) \
            if pairs else [None] * len(wanted)
    by_input = dict(zip(map(id, wanted), found))
    return [torch.zeros_like(x) if by_input.get(id(x)) is None else by_input[id(x)] for x in xs]


_AUTOGRAD_KEYS = [getattr(torch._C.DispatchKey, k) for k in (
    "ADInplaceOrView", "AutogradFunctionality", "AutogradOther", "AutogradCPU", "AutogradCUDA", "AutogradXPU",
    "AutogradMPS", "AutogradPrivateUse1", "AutogradMeta", "AutogradNestedTensor") if hasattr(torch._C.DispatchKey, k)]


@contextlib.contextmanager
def _autograd_on() -> Iterator[None]:
    """Autograd back on inside an op's implementation, which the dispatcher runs below autograd (its
    keys excluded, which ``torch.enable_grad`` alone does not undo), to run the kernel's own backward."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        if exclude.has(key):
            exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


@recurrent_kernel_backward.register_fake
def _recurrent_kernel_backward_fake(kernel: str, call: str, tensors: List[Tensor], grads: List[Tensor]) -> List[Tensor]:
    return [torch.empty_like(t) for t in tensors]


def _setup(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.kernel, ctx.call, tensors = inputs
    ctx.save_for_backward(*tensors)


def _backward(ctx: Any, grads: List[Optional[Tensor]]) -> tuple:
    tensors = list(ctx.saved_tensors)
    grads = [tensors[0].new_empty(0) if g is None else g for g in grads]
    found = recurrent_kernel_backward(ctx.kernel, ctx.call, tensors, grads)
    return None, None, [g if t.is_floating_point() else None for g, t in zip(found, tensors)]


recurrent_kernel.register_autograd(_backward, setup_context=_setup)


__all__ = ["graph_function", "recurrent_kernel", "recurrent_kernel_backward"]
