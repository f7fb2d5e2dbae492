"""cp_compile: context parallelism for unmodified PyTorch transformers.

Public API: the ``ring_cp`` torch.compile backend (:class:`RingCP`,
``backend="ring_cp"``), the training-step decorator :func:`context_parallel`, :func:`ring_attention` (exact attention over a sequence
split across a context-parallel group), :func:`shard` / :func:`unshard` /
:func:`positions` (load-balanced sequence layouts).
"""

from .backend import BackendOptions, RingCP
from .options import RingOptions
from .layout import positions, shard, unshard
from .ring import ring_attention
from .step import context_parallel

__version__ = "0.1.0"

__all__ = ["BackendOptions", "RingCP", "RingOptions", "context_parallel", "positions", "ring_attention", "shard", "unshard", "__version__"]
