"""``cp-compile doctor``: versions, the kernel "auto" runs per dtype and mask form, a 2-rank ring smoke;
each line ok or FAIL with the fix, exit code 1 on any FAIL."""

from __future__ import annotations

import pytest
import torch

from cp_compile.kernels.aten import AtenKernel
from cp_compile.tools.cli import main
from cp_compile.tools.doctor import smoke


class OffKernel(AtenKernel):
    """aten with its outputs 5% too large, checked on the CPU (a stand-in for a broken GPU kernel)."""

    name = "off_standin"
    self_check_devices = ("cpu",)

    def forward(self, q, k, v, *, causal, scale, mask=None):
        out, lse = super().forward(q, k, v, causal=causal, scale=scale, mask=mask)
        return out * 1.05, lse


@pytest.mark.slow
def test_doctor_prints_versions_kernels_and_a_passing_ring_smoke(capsys) -> None:
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("ok    torch 2.13.0"), out
    assert "ok    cpu float32: full, causal, causal+window, documents -> aten" in out, out
    assert "ok    cpu float64: full, causal, causal+window, documents -> aten" in out, out
    [smoke_line] = [line for line in out if "ring smoke" in line]
    assert smoke_line.startswith("ok    ring smoke: 2 ranks on gloo") and "of SDPA" in smoke_line, smoke_line


def test_doctor_fails_a_kernel_that_fails_its_self_check_and_names_the_fallback(capsys, monkeypatch) -> None:
    import cp_compile
    import cp_compile.kernels as kernels

    kernels.register_kernel(OffKernel(), replace=True)
    monkeypatch.setattr(kernels, "auto_kernel_name", lambda device: "off_standin")
    try:
        assert main(["doctor", "--no-smoke"]) == 1
    finally:
        cp_compile.reset_warnings()
    out = capsys.readouterr().out.splitlines()
    fails = [line for line in out if line.startswith("FAIL  cpu float32 causal+window -> off_standin")]
    assert len(fails) == 1, out
    assert "head dim 64: out differs from the math" in fails[0] and "runs this case on 'aten'" in fails[0], fails
    assert not any("ring smoke" in line for line in out), "--no-smoke runs no smoke"


def test_a_smoke_with_no_answer_in_time_is_a_fail_with_the_fix() -> None:
    line = smoke(world=2, timeout=0.01)  # (the ranks cannot even import torch in 10 ms)
    assert not line.ok and "gave no answer" in str(line) and "(fix: check that 127.0.0.1 ports" in str(line), line


def test_the_self_checked_line_reads_every_dtype_on_the_device() -> None:
    from cp_compile.tools.doctor import kernel_lines

    names = [line.what.split(":")[0] for line in kernel_lines(torch.device("cpu"))]
    assert names == ["cpu float32", "cpu bfloat16", "cpu float16", "cpu float64"], names
