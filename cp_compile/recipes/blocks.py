"""Each transformer block compiled on its own (torchtitan style), the sequence sharded between blocks.

Before (exact, no option, but every block all-gathers its (B, S, D) output and the next block
takes its tokens again)::

    for block in model.layers:
        block.compile(backend="ring_cp")
    loss = model(input_ids, labels)              # every rank passes the FULL batch

After (exact; one gather, in the last block's graph)::

    cp_compile.recipes.compile_blocks(model.layers)      # ring_cp options as keywords
    loss = model(input_ids, labels)              # unchanged: every rank passes the FULL batch

:func:`compile_blocks` gives each block the ``ring_cp`` options of its position in the stack:

============  ==================================  =========================================
position      options                             what crosses its boundary
============  ==================================  =========================================
first         ``inputs="full", outputs="local"``  takes the embedding output whole, returns
                                                  this rank's shard (no gather)
middle        ``inputs="local", outputs="local"`` shard in, shard out
last          ``inputs="local", outputs="full"``  shard in; gathers its output in its graph
only one      ``inputs="full", outputs="full"``   what ``block.compile(backend="ring_cp")`` does
============  ==================================  =========================================

The eager code around the blocks (embedding, final norm, head, loss) sees whole tensors, as
without CP. Gradients stay exact by the contract of :mod:`cp_compile.graph_ops`: the last
block's gathered output scales its gradient by 1/N and reduce-scatters it (each rank's rows get
their full gradient), a shard's gradient is complete on its rank, and the first block
all-reduces the gradient of its whole input, so the eager embedding gets the full gradient.

The other arguments of a block (RoPE ``cos``/``sin``, ``position_ids``: computed once, whole, by
the model's eager forward and passed to every block) must be shards too in a block that takes a
shard: the block's own code combines them with the hidden state. So a block with
``inputs="local"`` runs an eager step before its compiled graph: every tensor argument other
than the hidden state (the first positional argument) with exactly one dim of the whole length
S = N x the hidden state's local length is replaced by :func:`cp_compile.shard` of it along
that dim (same group and layout, so the positions are the ones the graph of the first block
took; a differentiable argument's gradient is summed over the group, as the graph does for a
whole input). An argument with two such dims (an (S, S) attention mask) is refused: the ring
needs it whole. The hidden state's sequence dim and the shards' are marked dynamic
(``torch._dynamo.mark_dynamic``), which ``inputs="local"`` needs (the graph sees the local
length and rewrites the symbol as N x it); only those dims are symbolic, so a local length
equal to a model size (a head dim) is not specialized.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence

import torch
import torch.nn as nn

from ..backend.compiler import RingCP
from ..graph_ops import grad_all_reduce
from ..group import resolve_group
from ..options import BackendOptions
from ..sequence import check_seq_len, shard

# Options compile_blocks chooses per position; a user value would break the chain.
_PER_POSITION = ("inputs", "outputs")


def block_options(index: int, count: int) -> Dict[str, str]:
    """The ``inputs`` / ``outputs`` options of block ``index`` of ``count`` (table above)."""
    if not 0 <= index < count:
        raise IndexError(f"cp_compile: block {index} of a stack of {count}")
    return {"inputs": "full" if index == 0 else "local", "outputs": "full" if index == count - 1 else "local"}


def compile_blocks(blocks: Sequence[nn.Module], *, seq_dim: int = 1, fullgraph: bool = True,
                   **ring_cp_options: Any) -> List[RingCP]:
    """Compile each block of ``blocks`` (in call order) in place with ``ring_cp``, the sequence
    sharded from the first block's input to the last block's output.

    ``blocks``: the transformer blocks the model calls one after the other on the hidden state,
    each exactly once per forward (``model.layers``). ``seq_dim``: the sequence dim of the hidden
    state (the first positional argument of a block), 1 for (B, S, D). ``fullgraph``: passed to
    ``torch.compile`` (a graph break inside a block would hand a shard to a piece that cannot
    tell it from the whole sequence). ``ring_cp_options``: :class:`~cp_compile.BackendOptions`
    but ``inputs`` / ``outputs``, which are chosen per position (module docstring).

    Returns the backend of each block (the middle blocks share one), to inspect
    (``backend.graphs``, ``backend.records``). The model's forward is unchanged; every rank
    passes the whole batch. The sequence length must divide by 2N (zig-zag) or N.
    """
    blocks = list(blocks)
    if not blocks:
        raise ValueError("cp_compile: compile_blocks got no blocks. Fix: pass the model's blocks, e.g. model.layers.")
    if any(not isinstance(b, nn.Module) for b in blocks):
        kinds = sorted({type(b).__name__ for b in blocks if not isinstance(b, nn.Module)})
        raise TypeError(f"cp_compile: compile_blocks takes nn.Module blocks, got {kinds}.")
    if len({id(b) for b in blocks}) != len(blocks):
        raise ValueError("cp_compile: compile_blocks got the same block twice: each position needs its own "
                         "options. Fix: pass each block once, in the order the model calls them.")
    fixed = sorted(set(ring_cp_options) & set(_PER_POSITION))
    if fixed:
        raise ValueError(f"cp_compile: compile_blocks chooses {fixed} for each block from its position (first: "
                         "inputs='full', outputs='local'; middle: local, local; last: local, full). Fix: leave "
                         f"{fixed} out; for other options per block, compile each block yourself.")
    backends: Dict[tuple, RingCP] = {}
    out: List[RingCP] = []
    for i, block in enumerate(blocks):
        opts = block_options(i, len(blocks))
        key = (opts["inputs"], opts["outputs"])
        if key not in backends:
            backends[key] = RingCP(**ring_cp_options, **opts)
        backend = backends[key]
        block.compile(backend=backend, fullgraph=fullgraph)  # sets block._compiled_call_impl, what Module calls
        if len(blocks) > 1:
            block._compiled_call_impl = _checked_call(block._compiled_call_impl, backend, seq_dim,
                                                      local=opts["inputs"] == "local")
        out.append(backend)
    return out


def _checked_call(compiled: Callable, backend: RingCP, seq_dim: int, local: bool) -> Callable:
    """``compiled`` (a block's compiled call) behind a check of the sequence length (a shard cannot carry
    the padding ring_cp adds to a length that does not split) and, for a ``local`` block, the eager
    step of the module docstring."""
    opts = backend.options

    def call(*args: Any, **kwargs: Any) -> Any:
        if not args or not isinstance(args[0], torch.Tensor):
            raise TypeError("cp_compile: compile_blocks needs the hidden state as a block's first positional "
                            f"argument (a tensor), got {type(args[0]).__name__ if args else 'none'}.")
        hidden = args[0]
        group = resolve_group(opts.mesh)
        if group.size == 1:
            return compiled(*args, **kwargs)
        dim = seq_dim % hidden.dim()
        seq_len = hidden.shape[dim] * (group.size if local else 1)
        check_seq_len(seq_len, group.size, opts.load_balance)
        if not local:
            return compiled(*args, **kwargs)
        torch._dynamo.mark_dynamic(hidden, dim)
        args = (hidden,) + tuple(_to_shard(a, f"#{j}", seq_len, group.name, opts) for j, a in enumerate(args[1:], 1))
        kwargs = {k: _to_shard(v, repr(k), seq_len, group.name, opts) for k, v in kwargs.items()}
        return compiled(*args, **kwargs)

    return call


def _to_shard(x: Any, where: str, seq_len: int, group_name: str, opts: BackendOptions) -> Any:
    """The eager step for one argument ``x`` (named ``where`` in errors) of a ``local`` block: a tensor with
    exactly one dim of the whole length ``seq_len`` -> this rank's shard of it along that dim, marked
    dynamic there; tuples and lists element by element; anything else unchanged."""
    if isinstance(x, (tuple, list)):
        return type(x)(_to_shard(v, f"{where}[{j}]", seq_len, group_name, opts) for j, v in enumerate(x))
    if not isinstance(x, torch.Tensor):
        return x
    dims = [d for d in range(x.dim()) if x.shape[d] == seq_len]
    if not dims:
        return x
    if len(dims) > 1:
        raise ValueError(
            f"cp_compile: block argument {where} {tuple(x.shape)} has {len(dims)} dims of the sequence "
            f"length {seq_len} (an attention mask?): a block that takes this rank's shard cannot take it "
            "whole, and the ring needs it whole. Fix: let attention be causal without a mask "
            "(is_causal=True; Hugging Face skips the mask for a causal batch without padding), or "
            "compile each block with block.compile(backend='ring_cp') (full inputs, one gather a block).")
    if x.requires_grad:  # its share of the gradient is this rank's rows: sum the shares, as the graph does
        x = grad_all_reduce(x, group_name)
    part = shard(x, dims[0], group=opts.mesh, load_balance=opts.load_balance)
    torch._dynamo.mark_dynamic(part, dims[0])
    return part
