"""The ring loops for kernels that fuse the merge (:class:`cp_compile.kernels.base.StepKernel`).

Same ring as :mod:`.loops` (same block order, same communication), but the kernel
sees each visiting block whole, with the global positions of this rank's queries
and of the block's keys, and keeps every accumulator in fp32 across steps:

* forward: ``state = new_state(q)``; per step ``forward_step(q, k_src, v_src, state,
  q_pos, k_pos)``; then ``finalize``. Nothing is rounded to the input dtype until
  the very end.
* backward: Δ once; per step ``backward_step`` adds into a local fp32 dQ and into a
  fresh fp32 dK/dV for the visiting block, which the :class:`.comm.GradSink` sends
  on to the block's owner.

Steps the plan lists as fully masked, or wholly outside a sliding window, are not
launched at all; inside a launched step the kernel skips the masked tiles itself.

Packed documents (``spec.doc_ids``: (B|1, S) ids over the whole sequence, in global
position order): each step hands the kernel this rank's and the visiting block's ids,
cut by global positions (:class:`BlockDocs`), and the kernel keeps only pairs of equal
id. A step in which no query shares a document with a key it may see (by causality and
padding) is not launched; inside a step the kernel skips the tiles whose document
ranges do not meet.

FlexAttention ``mask_mod`` / ``score_mod`` (``spec.mods``) go to a kernel with ``supports_mods`` (the
Triton one compiles them into its step kernels, :mod:`cp_compile.kernels.triton.mods`), which checks them
once, before the first step (:func:`_mods_kw`); a mod it cannot translate is refused there, naming the
op and the fix. Every step the layout plans runs: the mask_mod masks inside the kernel.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from ..group import CPGroup
from .comm import GradSink, kv_blocks
from .masking import BlockPositions, MaskSpec, any_visible
from .documents import padded_ids

Tensor = torch.Tensor
NO_LIMIT = 2**31 - 1  # no padding: every key position is below this
_INT32 = torch.iinfo(torch.int32)


class BlockDocs:
    """Document ids of every rank's block, cut from the whole ``doc_ids`` by global positions:
    ``docs(rank)`` is (B|1, c) int32 contiguous on the device (for the kernels), and
    :meth:`meet` decides on the CPU whether a step has any pair in a shared document."""

    def __init__(self, doc_ids: Tensor, pos: BlockPositions, batch: int, valid_len: int) -> None:
        s = pos.c * pos.group.size
        whole = doc_ids.detach()
        whole = whole.unsqueeze(0) if whole.dim() == 1 else whole
        short = whole.dim() == 2 and valid_len >= 0 and valid_len <= whole.shape[1] < s
        if whole.dim() != 2 or whole.shape[0] not in (1, batch) or not (whole.shape[1] == s or short):
            raise ValueError(
                f"cp_compile: doc_ids has shape {tuple(doc_ids.shape)}; the ring takes one document id per "
                f"global position, (B|1, S) = ({batch} or 1, {s}). Fix: pass the whole sequence's document "
                "ids (not this rank's shard), e.g. cp_compile.doc_ids_from_cu_seqlens(cu_seqlens, S)."
            )
        if whole.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cp_compile: doc_ids must be int32 or int64, got {whole.dtype}. "
                             "Fix: pass doc_ids.to(torch.int32).")
        cpu = padded_ids(whole, s)  # (B|1, S) int64; padding positions (>= valid_len) carry the last id
        if cpu.numel() and (int(cpu.min()) < _INT32.min or int(cpu.max()) > _INT32.max):
            raise ValueError("cp_compile: the Triton kernels take document ids in the int32 range. "
                             "Fix: renumber the documents 0, 1, 2, ... (e.g. torch.unique(..., return_inverse=True)).")
        self.pos, self._cpu = pos, cpu  # (B|1, S) int64
        self._dev = cpu.to(device=pos.device, dtype=torch.int32)  # (B|1, S) int32
        self._blocks: Dict[int, Tensor] = {}

    def __call__(self, rank: int) -> Tensor:
        if rank not in self._blocks:
            self._blocks[rank] = self._dev.index_select(1, self.pos(rank)).contiguous()
        return self._blocks[rank]  # (B|1, c) int32

    def meet(self, rank: int, src: int, causal: bool, limit: int) -> bool:
        """Whether a query of ``rank`` and a key of block ``src`` below ``limit`` share a document
        (with, when causal, the key at or before the query). Exact; O(c log c) per batch row."""
        q_pos, k_pos = self.pos.cpu(rank), self.pos.cpu(src)  # (c,) int64
        k_pos = k_pos[k_pos < limit]  # (c_valid,)
        q_doc, k_doc = self._cpu[:, q_pos], self._cpu[:, k_pos]  # (B|1, c), (B|1, c_valid)
        return any(_shared_document(q_doc[b], k_doc[b], q_pos, k_pos, causal) for b in range(len(self._cpu)))


def _shared_document(q_doc: Tensor, k_doc: Tensor, q_pos: Tensor, k_pos: Tensor, causal: bool) -> bool:
    """Whether some query (ids q_doc, positions q_pos, (c,)) and key (k_doc, k_pos) share a document
    and, when causal, the earliest key of the document is at or before its latest query."""
    if k_doc.numel() == 0:
        return False
    ids, inv = torch.unique(torch.cat([q_doc, k_doc]), return_inverse=True)
    n = ids.numel()
    last_q = torch.full((n,), -1, dtype=torch.int64).scatter_reduce_(0, inv[: len(q_doc)], q_pos, "amax")
    first_k = torch.full((n,), NO_LIMIT, dtype=torch.int64).scatter_reduce_(0, inv[len(q_doc):], k_pos, "amin")
    seen = (first_k <= last_q) if causal else (first_k < NO_LIMIT) & (last_q >= 0)
    return bool(seen.any())


def _step_runs(causal: bool, group: CPGroup, src: int, valid_len: int, pos: BlockPositions, window: int,
               docs: Optional[BlockDocs] = None) -> bool:
    """Whether any (query, key) pair of the step against block ``src`` may be visible (exact but for
    a window together with documents, where a step may run and find nothing). The plan is
    ``pos.segments``: by layout, or by positions for a table."""
    if not pos.segments(causal, src, valid_len):
        return False
    if window > 0 and not any_visible(pos.cpu(group.rank), pos.cpu(src), window):
        return False
    return docs is None or docs.meet(group.rank, src, causal, valid_len if valid_len >= 0 else NO_LIMIT)


def _window(spec: MaskSpec) -> int:
    """The kernels' ``window`` argument, after refusing what the fused kernels cannot mask."""
    if spec.attn_mask is not None:
        raise ValueError(
            "cp_compile: the Triton kernels take no explicit attn_mask (they mask by position). "
            "Fix: use kernel='aten' (CPU) or 'reference', or express the mask as causal / a sliding window."
        )
    return spec.window if spec.window > 0 else NO_LIMIT


def _mods_kw(spec: MaskSpec, kernel, device: torch.device) -> dict:
    """The steps' ``mods=`` argument ({} without mods), after the kernel translated them: a mod it cannot run is
    refused here, before any collective, naming the op and the fix."""
    mods = getattr(spec, "mods", None)  # read with getattr: older MaskSpecs have no mods / doc_ids
    if mods is None or (getattr(mods, "mask_mod", None), getattr(mods, "score_mod", None)) == (None, None):
        return {}
    if not getattr(kernel, "supports_mods", False):
        raise ValueError(
            f"cp_compile: kernel {getattr(kernel, 'name', kernel)!r} takes no mask_mod / score_mod. "
            "Fix: use kernel='triton' (GPU), kernel='aten' on CPU or kernel='reference'."
        )
    kernel.check_mods(mods, device)
    return {"mods": mods}


def _block_docs(spec: MaskSpec, kernel, pos: BlockPositions, batch: int, valid_len: int) -> Optional[BlockDocs]:
    """The step document ids of ``spec.doc_ids`` (None without documents)."""
    doc_ids = getattr(spec, "doc_ids", None)
    if doc_ids is None:
        return None
    if not getattr(kernel, "supports_doc_ids", False):
        raise ValueError(f"cp_compile: kernel {getattr(kernel, 'name', kernel)!r} takes no document ids. "
                         "Fix: use kernel='triton' (GPU), 'aten' (CPU) or 'reference'.")
    return BlockDocs(doc_ids, pos, batch, valid_len)


def _doc_kw(docs: Optional[BlockDocs], rank: int, src: int) -> dict:
    return {} if docs is None else {"q_doc": docs(rank), "k_doc": docs(src)}


def ring_forward_fused(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, group: CPGroup,
                       load_balance: str, rotate: str, kernel, valid_len: int = -1,
                       spec: MaskSpec = MaskSpec(), positions: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """(out (B, H, c, D) in q.dtype, lse (B, H, c) fp32); arguments as :func:`.loops.ring_forward`."""
    c, window = q.shape[2], _window(spec)
    pos = BlockPositions(c, group, load_balance, q.device, positions)
    limit = valid_len if valid_len >= 0 else NO_LIMIT
    docs = _block_docs(spec, kernel, pos, q.shape[0], valid_len)
    mods = _mods_kw(spec, kernel, q.device)
    state = kernel.new_state(q)
    for _, src, k_src, v_src in kv_blocks(k, v, group, rotate):
        if _step_runs(causal, group, src, valid_len, pos, spec.window, docs):
            kernel.forward_step(q, k_src, v_src, state, pos(group.rank), pos(src), causal=causal, scale=scale,
                                kv_limit=limit, window=window, **_doc_kw(docs, group.rank, src), **mods)
    return kernel.finalize(state, q.dtype)


def ring_backward_fused(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
                        causal: bool, scale: float, group: CPGroup, load_balance: str, rotate: str, kernel,
                        valid_len: int = -1, spec: MaskSpec = MaskSpec(),
                        positions: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of this rank's shards in their input dtypes; arguments as :func:`.loops.ring_backward`."""
    c, window = q.shape[2], _window(spec)
    pos = BlockPositions(c, group, load_balance, q.device, positions)
    limit = valid_len if valid_len >= 0 else NO_LIMIT
    docs = _block_docs(spec, kernel, pos, q.shape[0], valid_len)
    mods = _mods_kw(spec, kernel, q.device)
    dlt = kernel.delta(dout, out)  # (B, H, c) fp32
    lse = lse.float().contiguous()
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # (B, H, c, D), stays local
    sink = GradSink(k, torch.float32, group, rotate)
    for step, src, k_src, v_src in kv_blocks(k, v, group, rotate):
        if not _step_runs(causal, group, src, valid_len, pos, spec.window, docs):
            sink.add(step, src, None, None)
            continue
        dk_src = torch.zeros(k.shape, dtype=torch.float32, device=k.device)  # (B, H_kv, c, D)
        dv_src = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        kernel.backward_step(dout, q, k_src, v_src, lse, dlt, (dq, dk_src, dv_src), pos(group.rank), pos(src),
                             causal=causal, scale=scale, kv_limit=limit, window=window,
                             **_doc_kw(docs, group.rank, src), **mods)
        sink.add(step, src, dk_src, dv_src)
    dk, dv = sink.finish()
    dq, dk, dv = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    if dk.untyped_storage().data_ptr() == dv.untyped_storage().data_ptr():
        dv = dv.clone()  # custom-op outputs must not alias each other
    return dq, dk, dv
