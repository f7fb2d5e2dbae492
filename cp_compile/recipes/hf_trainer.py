"""``transformers.Trainer`` context-parallel: :class:`RingCPTrainer`, a Trainer on a DP x CP mesh.

Under ``torchrun`` the stock Trainer needs three changes to run ``ring_cp``, and this class
makes them, nothing else::

    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))   # "cuda" on GPUs
    trainer = RingCPTrainer(model=model, args=args, train_dataset=ds, mesh=mesh)
    trainer.train()

1. **Compiling with options.** ``TrainingArguments(torch_compile_backend="ring_cp")`` does not
   reach ``torch.compile``: accelerate turns the name into its ``DynamoBackend`` enum and
   raises ``ValueError: 'RING_CP' is not a valid DynamoBackend``, and it has no place for the
   mesh. The model is compiled in place here (``model.compile(backend=RingCP(mesh=mesh,
   **cp_options))``: the module keeps its class, so the Trainer's introspection of
   ``forward`` and ``loss_type`` is unchanged), before the Trainer sees it.
   ``torch_compile=True`` / ``torch_compile_backend="ring_cp"`` in the arguments are accepted
   and taken over (``args.torch_compile`` is set to False so that accelerate does not compile;
   ``"inductor"``, what ``torch_compile=True`` alone fills in, counts as accepted: ring_cp's
   default inner compiler is Inductor). Any other backend, or a ``torch_compile_mode``, is
   refused naming ``cp_options={"inner": ...}``.
2. **The same batch on the CP ranks of one DP replica.** accelerate deals batches round-robin
   over all ``world_size`` ranks; the prepared loaders' shard (accelerate's
   ``BatchSamplerShard`` / ``IterableDatasetShard``) is re-pointed to deal them over the
   ``dp`` ranks: rank (d, c) gets what rank d of a ``dp``-process run would get. This holds
   for the train, eval and test loaders (CP ranks given different sequences would compute
   ring attention over a mix of both).
3. **Gradient averaging.** Nothing to change: with ``grad_sync="allreduce"`` (the default,
   required here) ``ring_cp`` sums the gradient over ``cp`` in the backward graph, so the CP
   ranks of one replica hold the same, full gradient, and the DDP that accelerate wraps around
   the model over the whole world averages identical copies over ``cp`` and the replicas over
   ``dp``: the DP mean. The Trainer's token-count loss scaling (``average_tokens_across_devices``)
   stays exact as well: it gathers the count of valid labels over all ranks (``cp`` times each
   replica's) and multiplies the loss by ``world_size``; the two factors of ``cp`` cancel.
   ``grad_sync="none"`` is refused: DDP's mean would leave ``1/cp`` of the gradient.

Each rank's loss is its DP replica's loss (every CP rank returns the same global value), so
the logged loss, the mean over all ranks, is the one-process loss of the global batch.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
import transformers

from ..backend.compiler import RingCP


def dp_coordinates(mesh: Any) -> Tuple[int, int]:
    """``(dp size, this rank's dp index)`` of ``mesh``: a 1-D mesh is all CP (one replica); a 2-D
    mesh has a dim named ``"cp"`` and the other dim is the data-parallel one."""
    import torch.distributed as dist

    names = tuple(mesh.mesh_dim_names or ())
    if mesh.size() != dist.get_world_size():
        raise ValueError(
            f"cp_compile: RingCPTrainer's mesh has {mesh.size()} ranks, the world {dist.get_world_size()}: the Trainer "
            "deals batches and averages gradients over every rank. Fix: a mesh over all ranks, "
            "init_device_mesh(device, (world // cp, cp), mesh_dim_names=('dp', 'cp')).")
    if mesh.ndim == 1:
        return 1, 0
    if mesh.ndim != 2 or "cp" not in names:
        raise ValueError(
            f"cp_compile: RingCPTrainer needs a 1-D CP mesh or a 2-D (dp, cp) mesh, got {mesh.ndim} dims named "
            f"{names}. Fix: init_device_mesh(device, (dp, cp), mesh_dim_names=('dp', 'cp')).")
    dp_dim = names[1 - names.index("cp")]
    return mesh.size(names.index(dp_dim)), mesh.get_local_rank(dp_dim)


def shard_loader_over_dp(loader: Any, dp_size: int, dp_rank: int) -> Any:
    """Make an accelerate-prepared ``loader`` deal its batches over ``dp_size`` replicas (this
    rank is replica ``dp_rank``) instead of over every rank; returns ``loader``."""
    from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard

    shards = [s for s in (getattr(loader, "batch_sampler", None), getattr(loader, "dataset", None))
              if isinstance(s, (BatchSamplerShard, IterableDatasetShard))]
    if not shards:
        raise ValueError(
            f"cp_compile: RingCPTrainer cannot re-deal the batches of a {type(loader).__name__} over the dp ranks "
            "(it needs accelerate's BatchSamplerShard or IterableDatasetShard; a DataLoaderDispatcher sends every "
            "rank a different slice). Fix: TrainingArguments(accelerator_config={'dispatch_batches': False}).")
    for shard in shards:
        shard.num_processes, shard.process_index = dp_size, dp_rank
    return loader


def _take_over_compile(args: Any) -> None:
    """Accept ``torch_compile=True, torch_compile_backend="ring_cp"`` and switch accelerate's own
    compile off (it cannot take the name); refuse any other backend, naming the fix."""
    if args is None or not args.torch_compile:
        return
    if args.torch_compile_backend not in ("ring_cp", "inductor") or args.torch_compile_mode is not None:
        raise ValueError(
            f"cp_compile: RingCPTrainer compiles the model with ring_cp itself; TrainingArguments asks for "
            f"torch_compile_backend={args.torch_compile_backend!r}, torch_compile_mode={args.torch_compile_mode!r}. "
            "Fix: leave torch_compile off (or torch_compile_backend='ring_cp'), and choose the compiler of the "
            "rewritten graph with cp_options={'inner': 'inductor' | 'aot_eager'}.")
    args.torch_compile, args.torch_compile_backend = False, None  # accelerate: DynamoBackend.NO


class RingCPTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` whose model runs context-parallel over ``mesh["cp"]`` and
    data-parallel over the mesh's other dim (module docstring: what changes and why it is exact).

    Args:
        mesh: a ``DeviceMesh`` over all ranks: 1-D (CP only) or 2-D with a dim named ``"cp"``.
        cp_options: further ``ring_cp`` options (``inner``, ``load_balance``, ``strict``, ...).
        Everything else: as ``transformers.Trainer``.
    """

    def __init__(self, model: Optional[torch.nn.Module] = None, args: Any = None, *rest: Any, mesh: Any,
                 cp_options: Optional[Dict[str, Any]] = None, **kwargs: Any) -> None:
        options = dict(cp_options or {})
        if options.get("grad_sync", "allreduce") != "allreduce":
            raise ValueError(
                "cp_compile: RingCPTrainer needs grad_sync='allreduce': the Trainer's DDP averages over every rank, "
                "which leaves 1/cp of the gradient when the CP ranks hold shares. Fix: drop grad_sync from cp_options.")
        if "mesh" in options:
            raise ValueError("cp_compile: pass the mesh as RingCPTrainer(mesh=...), not in cp_options.")
        if model is None:
            raise ValueError("cp_compile: RingCPTrainer needs model= (model_init is not supported).")
        _take_over_compile(args)
        self.cp_mesh = mesh
        self.dp_size, self.dp_rank = dp_coordinates(mesh)
        self.cp_backend = RingCP(mesh=mesh, **options)
        model.compile(backend=self.cp_backend)  # in place: the Trainer still sees the model's own class
        super().__init__(model, args, *rest, **kwargs)

    def get_train_dataloader(self) -> Any:
        """The Trainer's train loader, dealt over the dp ranks."""
        return shard_loader_over_dp(super().get_train_dataloader(), self.dp_size, self.dp_rank)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        """The Trainer's eval loader, dealt over the dp ranks."""
        return shard_loader_over_dp(super().get_eval_dataloader(eval_dataset), self.dp_size, self.dp_rank)

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        """The Trainer's test loader, dealt over the dp ranks."""
        return shard_loader_over_dp(super().get_test_dataloader(test_dataset), self.dp_size, self.dp_rank)
