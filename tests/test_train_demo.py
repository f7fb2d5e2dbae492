"""examples/train_demo.py end to end, tiny: CP training on 2 gloo ranks tracks the
single-process losses (the demo's own comparison, parsed from its output)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--seq-len", "64", "--steps", "2", "--dim", "32", "--ffn", "64", "--vocab", "128"]


@pytest.mark.slow
def test_train_demo_runs_and_losses_match():
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "examples", "train_demo.py"), *TINY],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = re.search(r"^max relative loss difference: (\S+)$", proc.stdout, re.MULTILINE)
    assert m, proc.stdout
    assert float(m.group(1)) <= 1e-4, proc.stdout
    assert re.search(r"^\s+2\s+\S+\s+\S+\s+\S+$", proc.stdout, re.MULTILINE), proc.stdout  # a row per step
