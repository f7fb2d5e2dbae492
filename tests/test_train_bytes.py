"""examples/train_bytes.py end to end, tiny: 2 gloo ranks under torch.distributed.run
train on the standard library's bytes (finite, learning losses), and the --single
mode prints its JSON summary."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "examples", "train_bytes.py")
TINY = ["--seq-len", "256", "--dim", "32", "--layers", "1"]


def _env():
    env = dict(os.environ, MASTER_ADDR="127.0.0.1")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"):
        env.pop(k, None)
    return env


@pytest.mark.slow
def test_train_bytes_torchrun_two_ranks(tmp_path):
    plot = tmp_path / "loss.png"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         SCRIPT, *TINY, "--steps", "3", "--no-compare", "--plot", str(plot)],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=240,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    losses = [float(x) for x in re.findall(r"\]\s+\d+/3\s+loss (\S+)", proc.stdout)]
    assert len(losses) == 3, out
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0] or all(x < math.log(256) + 0.5 for x in losses), losses
    assert "context-parallel over 2 ranks" in proc.stdout, out
    assert re.search(r"this machine: fp32 matmul \d+ GFLOP/s per process", proc.stdout), out
    assert re.search(r"tok/s \(mean after step 1\) with fp32 matmul at \d+ GFLOP/s", proc.stdout), out
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "pip install matplotlib" in proc.stdout, out
    else:
        assert plot.exists(), out


@pytest.mark.slow
def test_train_bytes_single_prints_json():
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--single", "--steps", "2", *TINY],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(summary["losses"]) == 2 and all(math.isfinite(x) for x in summary["losses"]), summary
    assert summary["world_size"] == 1 and summary["seq_len"] == 256, summary
    assert summary["peak_mib"] >= 0, summary
    assert summary["matmul_gflops"] > 0, summary  # printed beside tokens/s, to scale them across machines
