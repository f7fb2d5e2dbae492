"""The recurrence contract without a process group: what ``register_recurrence`` refuses, the math
state passing rests on, and what ``cp-compile explain`` says of a state-passed kernel.

The math: a run of a linear recurrence is one affine map of the state, ``h_out = M ∘ h_in + c``, where
``c`` is the run from a zero state and ``M`` the run with its drive zeroed from 1 (elementwise) or I
(matrix); composing the runs' maps in order gives the state entering each run. Checked here against
the stand-in kernels run on the whole sequence (tests/recurrent_kernels.py), in fp64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cp_compile
from cp_compile.recurrence.state_passing import apply_map
from recurrent_kernels import CONTRACTS, delta_rule, gla, registered, tanh_rnn

B, S, H, K, V, L = 2, 12, 2, 3, 4, 4  # L: a run's tokens; S / L = 3 runs


def _gla_args(gen: torch.Generator) -> dict:
    q, k = (torch.randn(B, S, H, K, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, S, H, V, generator=gen, dtype=torch.float64)
    g = -torch.rand(B, S, H, K, generator=gen, dtype=torch.float64)  # a log decay <= 0
    return {"q": q, "k": k, "v": v, "g": g}


def _delta_args(gen: torch.Generator) -> dict:
    a = _gla_args(gen)
    return {**a, "k": F.normalize(a["k"], dim=-1), "g": a["g"][..., 0],
            "beta": torch.rand(B, S, H, generator=gen, dtype=torch.float64)}


def _run(args: dict, j: int) -> dict:
    return {n: x[:, j * L:(j + 1) * L] for n, x in args.items()}


@pytest.mark.parametrize("kernel,make,kind", [(gla, _gla_args, "elementwise"), (delta_rule, _delta_args, "matrix")])
def test_run_summaries_compose_to_the_whole_sequence(kernel, make, kind) -> None:
    """Each run's (M, c) from the kernel alone, composed in order from h0, gives every run's entering
    state: the outputs from those states and the final state equal one run on the whole sequence."""
    args = make(torch.Generator().manual_seed(0))
    h0 = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    whole, h_whole = kernel(**args, initial_state=h0, output_final_state=True)
    h, outs = h0, []
    for j in range(S // L):
        run = _run(args, j)
        c = kernel(**run, initial_state=torch.zeros_like(h0), output_final_state=True)[1]
        probe = dict(run, v=torch.zeros_like(run["v"]) if kind == "elementwise" else run["v"].new_zeros(B, L, H, K))
        one = torch.ones_like(h0) if kind == "elementwise" else torch.eye(K, dtype=h0.dtype).expand(B, H, K, K)
        m = kernel(**probe, initial_state=one, output_final_state=True)[1]
        outs.append(kernel(**run, initial_state=h, output_final_state=True)[0])
        h = apply_map(kind, m, h, c)
    torch.testing.assert_close(torch.cat(outs, 1), whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h, h_whole, rtol=1e-12, atol=1e-12)


def test_padding_tokens_of_value_zero_are_the_identity_step() -> None:
    """The rule pads a run with each argument's pad value (0 by default): for a log-decay gate and a
    zero drive that step leaves the state as it is, so the final state of a padded run is exact."""
    args = _gla_args(torch.Generator().manual_seed(2))
    h0 = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    padded = {n: F.pad(x, (0, 0) * (x.dim() - 2) + (0, 3)) for n, x in args.items()}  # 3 zero tokens after S
    _, h = gla(**args, initial_state=h0, output_final_state=True)
    _, h_padded = gla(**padded, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(h_padded, h, rtol=0, atol=0)


@pytest.mark.parametrize("change,message", [
    ({"transition": "diagonal"}, "transition='diagonal'"),
    ({"seq_args": {"q": 1, "x": 1}}, "not parameters of the kernel"),
    ({"initial_state": "h"}, "not parameters of the kernel"),
    ({"final_state_flag": "return_state"}, "not parameters of the kernel"),
    ({"when": {"reverse": False}}, "not parameters of the kernel"),
    ({"drive": ()}, "needs drive="),
    ({"drive": ("initial_state",)}, "not in seq_args"),
    ({"outputs": {}}, "at least one per-token tensor"),
    ({"final_state": 0}, "both the final state and a per-token output"),
])
def test_a_contract_that_cannot_hold_is_refused_with_the_fix(change, message) -> None:
    fields = dict(CONTRACTS["gla"], **change)
    with pytest.raises(ValueError, match=message) as err:
        cp_compile.register_recurrence(**fields)
    assert "register_recurrence(gla)" in str(err.value)
    assert cp_compile.recurrence.recurrence_spec(gla) is None  # nothing registered by a refused call


def test_unregister_forgets_the_contract() -> None:
    with registered("gla"):
        assert cp_compile.recurrence.recurrence_spec(gla).transition == "elementwise"
    assert cp_compile.recurrence.recurrence_spec(gla) is None


class _Recurrent(torch.nn.Module):
    """Projections into the delta rule or the nonlinear RNN, no attention."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.inp = torch.nn.Linear(8, 5 * H * K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v, g, a = self.inp(x).view(x.shape[0], x.shape[1], 5, H, K).unbind(2)
        if self.kind == "tanh_rnn":
            o, hT = tanh_rnn(v, torch.sigmoid(a))
            return o.square().mean() + hT.square().mean()
        o, _ = delta_rule(q, F.normalize(k, dim=-1), v, -F.softplus(g[..., 0]), torch.sigmoid(a[..., 0]))
        return o.square().mean()


def _explain(kind: str, seq: int, world: int = 4):
    from cp_compile.tools.explain import explain_model
    from cp_compile.tools.explain_format import format_explain

    with registered(kind):
        report = explain_model(_Recurrent(kind), (torch.randn(2, seq, 8),), world_size=world)
    return report.ctx.record, format_explain(report)


def test_explain_names_the_state_passed_kernel_its_state_and_bytes() -> None:
    record, text = _explain("delta_rule", 16)
    assert not record.fallbacks and not record.attention
    assert len(record.recurrences) == 1 and "delta_rule at" in record.recurrences[0]
    assert "recurrences: 1 registered kernel call(s), 1 state-passed" in text
    # 4 ranks x 2 zig-zag runs of one (B, H, K, K) map and one (B, H, K, K) state (V = K here), fp32
    state = 2 * H * K * K
    assert f"state (2, {H}, {K}, {K}), 2 run(s) per rank, {4 * 2 * (state + state) * 4} B received" in text


def test_a_serial_kernel_whose_padded_final_state_is_read_is_gathered_with_a_warning(caplog) -> None:
    """A nonlinear step has no identity token to pad with: with S = 15 on 4 x 2 runs the final state
    would be wrong, so the kernel runs on the gathered sequence, said in a WARNING and by explain."""
    with caplog.at_level("WARNING", logger="cp_compile"):
        record, text = _explain("tanh_rnn", 15)
    assert not record.recurrences and len(record.fallbacks) == 1, record
    assert "no identity step to pad with" in record.fallbacks[0] and "multiple of 8" in record.fallbacks[0]
    assert "recurrences: 1 registered kernel call(s), 0 state-passed" in text
    assert "fallbacks: 1 op(s)" in text and "tanh_rnn at tests/test_recurrence_spec.py" in text
    assert "record: 0 of 1 recurrence(s) state-passed" in text
    assert any("no identity step to pad with" in r.getMessage() for r in caplog.records)
