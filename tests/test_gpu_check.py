"""benchmarks/gpu_check.py, the one command prepared for a first GPU, run here under the Triton
interpreter at tiny shapes so that it works first time there: every case and column is produced,
the errors are within tolerance, and a kernel that is 10% off is a FAIL row."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import gpu_check  # noqa: E402

from cp_compile.kernels.triton import TritonKernel  # noqa: E402


@pytest.mark.slow
def test_the_gpu_check_runs_every_case_under_the_interpreter(tmp_path) -> None:
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--tiny", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    rows = record["rows"]
    assert len(rows) == 2 * 2 * 1 * 3 and record["ok"], rows
    assert {(r["dtype"], r["form"]) for r in rows} == {(d, f) for d in ("bfloat16", "float16")
                                                       for f in gpu_check.FORMS}
    for r in rows:
        tol = 3e-2 if r["dtype"] == "bfloat16" else 5e-3
        assert 0 <= r["worst"] <= tol and r["error_ring_out"] <= tol, r
        assert all(r[f"tflops_{n}"] > 0 for n in ("triton_fwd", "triton_bwd", "sdpa_fwd", "sdpa_bwd")), r
    assert record["args"]["tiny"] is True and record["device"] == "cpu (interpreter)", record["args"]


class OffTriton(TritonKernel):
    def finalize(self, state, dtype):
        out, lse = super().finalize(state, dtype)
        return out * 1.1, lse


def test_a_kernel_that_is_off_is_a_fail_row() -> None:
    row = gpu_check.case(OffTriton(), torch.bfloat16, 16, 64, "causal", gpu_check.TINY, torch.device("cpu"), 1)
    assert not row["ok"] and row["error_out"] > 5e-2 and row["error_ring_out"] > 5e-2, row
