"""cp_compile: context parallelism for unmodified PyTorch transformers.

Public API (this module): the ``ring_cp`` torch.compile backend (:class:`RingCP`,
``backend="ring_cp"``, options :class:`BackendOptions`), the training-step decorator
:func:`context_parallel`, :func:`ring_attention` (exact attention over a sequence split
across a context-parallel group, options :class:`RingOptions`), and :func:`shard` /
:func:`unshard` / :func:`positions` (the load-balanced sequence layouts), and
:func:`doc_ids_from_cu_seqlens` / :func:`doc_ids_from_position_ids` (document ids of
packed sequences, for ``ring_attention(doc_ids=...)``) and :func:`layout_table` (a
document-aware layout, for ``ring_attention(positions=...)`` and ``shard(positions=...)``), and
:func:`register_recurrence` / :func:`unregister_recurrence` (a recurrent kernel's state contract, so
ring_cp runs it on each rank's share of the sequence by state passing).

The package, one screen (docs/design.md explains each part)::

    cp_compile/
      options.py, errors.py      typed options (Literal choices) and the exceptions
      sequence.py, group.py      sequence layouts over ranks; resolving the CP group
      document_layout.py              a layout balanced over packed documents, and its work model
      step.py                    @context_parallel: a whole training step
      graph_ops.py               the collectives a rewritten graph calls (all-reduce, gather, ...)
      backend/                   what Dynamo calls: RingCP, rewrite_for_cp, the per-graph record,
                                 its cost counts, overlap scheduling, AOT cache, run-time guards
      passes/                    the FX passes, in order (passes/__init__.py): attention forms ->
                                 find attention + masks/ -> sequence inputs/origins -> rewrite
                                 (emitter, rules/ table, rule oracle, row selection) -> repropagate
      ring/                      the ring attention op: custom ops (with SDPA's autocast rule), loops,
                                 comm, plan, merge, faults
      kernels/                   block kernels: aten (CPU/CUDA), reference, triton (GPU)
      recurrence/                recurrent kernels: the registration API, state passing's math
      tools/                     the cp-compile CLI: explain, dump, plan (nothing at run time)
      recipes/                   ring_cp inside training frameworks, imported on use: blocks
                                 (compile_blocks: each block compiled on its own, the sequence
                                 sharded between blocks), hf_trainer (RingCPTrainer,
                                 transformers.Trainer on a DP x CP mesh)
"""

from .backend.compiler import BackendOptions, RingCP
from .options import RingOptions
from .sequence import positions, shard, unshard
from .ring import doc_ids_from_cu_seqlens, doc_ids_from_position_ids, ring_attention
from .step import context_parallel
from .document_layout import layout_table
from .recurrence import register_recurrence, unregister_recurrence
from .warn_once import reset_warnings

__version__ = "0.1.0"

__all__ = ["BackendOptions", "RingCP", "RingOptions", "context_parallel", "doc_ids_from_cu_seqlens",
           "doc_ids_from_position_ids", "layout_table", "positions", "register_recurrence", "reset_warnings",
           "ring_attention", "shard", "unregister_recurrence", "unshard", "__version__"]
