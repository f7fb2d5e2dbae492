"""``transformers.Trainer`` on a DP x CP mesh (``cp_compile.recipes.hf_trainer.RingCPTrainer``).

examples/hf_trainer.py runs under ``torch.distributed.run`` (the Trainer and accelerate read
their rank from torchrun's environment) on 2 ranks (dp=1, cp=2) and 4 ranks (dp=2, cp=2): a
tiny Hugging Face Llama, 5 AdamW steps, 2 sequences of 64 tokens per step whatever the mesh,
the Trainer's seeded random sampler, labels with ~10% ignored. The losses the Trainer logs
(``logging_steps=1``) must equal the stock Trainer's in one process on the same data (fp32,
1e-5 relative per step), with both attentions the ring and no gather fallback. Without the
re-dealing of batches over dp the CP ranks of a replica would get different sequences (checked
on accelerate's shard objects directly, no process group), and the options that cannot be
exact under the Trainer are refused naming the fix.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "examples", "hf_trainer.py")
TOL = 1e-5


def _env() -> dict:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([REPO, os.path.join(REPO, "examples"), env.get("PYTHONPATH", "")])
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _run(cmd: list) -> dict:
    """Run ``cmd`` (the example); its last stdout line is rank 0's JSON result."""
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def one_process() -> dict:
    return _run([sys.executable, SCRIPT, "--single"])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_trainer_losses_equal_one_process(one_process: dict, world: int) -> None:
    got = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
                SCRIPT, "--cp", "2"])
    ref = one_process["losses"]
    assert len(got["losses"]) == len(ref) == 5, (got, ref)
    errs = [abs(a - b) / abs(b) for a, b in zip(got["losses"], ref)]
    assert max(errs) <= TOL, (errs, got["losses"], ref)
    # one graph (the whole model), both Llama layers' attention the ring, nothing gathered
    assert (got["graphs"], got["rings"], got["fallbacks"]) == (1, 2, 0), got
    assert got["ddp"] == "DistributedDataParallel", got  # accelerate's own DDP over every rank


def _batches(dp: int, cp: int, batch: int = 1, n: int = 8) -> list:
    """What each rank of a (dp, cp) run draws: accelerate's loader for world = dp*cp, re-dealt over dp."""
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader

    from cp_compile.recipes.hf_trainer import shard_loader_over_dp

    out = []
    for rank in range(dp * cp):
        loader = prepare_data_loader(DataLoader(list(range(n)), batch_size=batch), num_processes=dp * cp,
                                     process_index=rank, put_on_device=False)
        shard_loader_over_dp(loader, dp, rank // cp)  # mesh (dp, cp): cp is the inner dim
        out.append([b.tolist() for b in loader])
    return out


def test_cp_ranks_of_a_replica_draw_the_same_batches() -> None:
    per_rank = _batches(dp=2, cp=2)
    assert per_rank[0] == per_rank[1] == [[0], [2], [4], [6]], per_rank
    assert per_rank[2] == per_rank[3] == [[1], [3], [5], [7]], per_rank  # as rank 1 of a 2-process run
    assert _batches(dp=1, cp=2, batch=2) == [[[0, 1], [2, 3], [4, 5], [6, 7]]] * 2


def test_a_dispatching_loader_is_refused_naming_the_fix() -> None:
    from cp_compile.recipes.hf_trainer import shard_loader_over_dp

    with pytest.raises(ValueError, match="dispatch_batches': False"):
        shard_loader_over_dp(object(), 2, 0)


@pytest.mark.parametrize("kwargs,fix", [
    ({"cp_options": {"grad_sync": "none"}}, "drop grad_sync"),
    ({"args_backend": "inductor_mode"}, "cp_options={'inner'"),
    ({"cp_options": {"mesh": None}}, "RingCPTrainer\\(mesh=...\\)"),
])
def test_options_the_trainer_cannot_make_exact_are_refused(kwargs: dict, fix: str) -> None:
    import torch

    from cp_compile.recipes.hf_trainer import RingCPTrainer

    args = None
    if kwargs.pop("args_backend", None):
        from types import SimpleNamespace
        args = SimpleNamespace(torch_compile=True, torch_compile_backend="inductor", torch_compile_mode="max-autotune")
    with pytest.raises(ValueError, match=fix):
        RingCPTrainer(model=torch.nn.Linear(2, 2), args=args, mesh=None, **kwargs)
