"""Pure-torch stand-ins of the field's recurrent kernels, with their signatures' state contract.

Each runs its recurrence step by step (the truth, not a fast form) and takes the state entering the
sequence and returns the state leaving it, the way flash-linear-attention's ``chunk_gla`` /
``chunk_gated_delta_rule`` and mamba_ssm's ``mamba_chunk_scan_combined`` do; tests register them
with :func:`cp_compile.register_recurrence` (:func:`registered`) and build small models on them.

    gla(q, k, v, g)            elementwise   h (B, H, K, V): h = exp(g_t)[..., None] * h + k_t v_tᵀ;  o_t = q_t h
    ssd(x, dt, A, B, C)        elementwise   h (B, H, P, N): h = exp(dt_t A) h + dt_t x_t B_tᵀ;       y_t = h C_t
    delta_rule(q, k, v, g, b)  matrix        h (B, H, K, V): h = exp(g_t) (I - b_t k_t k_tᵀ) h + b_t k_t v_tᵀ
    tanh_rnn(x, a)             serial        h (B, H, D):    h = tanh(a_t h + x_t);                  y_t = h
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Tuple

import torch

Tensor = torch.Tensor


def gla(q: Tensor, k: Tensor, v: Tensor, g: Tensor, initial_state: Optional[Tensor] = None,
        output_final_state: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    """Gated linear attention, (B, S, H, K) q/k/g (g a log decay), (B, S, H, V) v -> (B, S, H, V), h."""
    b, s, heads, dk = k.shape
    h = initial_state if initial_state is not None else k.new_zeros(b, heads, dk, v.shape[-1])
    outs = []
    for t in range(s):
        h = g[:, t].exp().unsqueeze(-1) * h + k[:, t].unsqueeze(-1) * v[:, t].unsqueeze(-2)  # (B, H, K, V)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], h))
    return torch.stack(outs, 1), (h if output_final_state else None)


def ssd(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, initial_state: Optional[Tensor] = None,
        return_final_states: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    """Mamba2's scalar-decay SSM: x (B, S, H, P), dt (B, S, H), A (H,), B/C (B, S, H, N) -> (B, S, H, P), h."""
    b, s, heads, p = x.shape
    h = initial_state if initial_state is not None else x.new_zeros(b, heads, p, B.shape[-1])
    outs = []
    for t in range(s):
        decay = (dt[:, t] * A).exp()[..., None, None]  # (B, H, 1, 1)
        h = decay * h + (dt[:, t, :, None] * x[:, t]).unsqueeze(-1) * B[:, t].unsqueeze(-2)  # (B, H, P, N)
        outs.append(torch.einsum("bhpn,bhn->bhp", h, C[:, t]))
    return torch.stack(outs, 1), (h if return_final_states else None)


def delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Optional[Tensor] = None,
               output_final_state: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    """The gated delta rule: q/k (B, S, H, K), v (B, S, H, V), g/beta (B, S, H) -> (B, S, H, V), h."""
    b, s, heads, dk = k.shape
    h = initial_state if initial_state is not None else k.new_zeros(b, heads, dk, v.shape[-1])
    outs = []
    for t in range(s):
        kt, bt = k[:, t], beta[:, t, :, None]  # (B, H, K), (B, H, 1)
        h = g[:, t].exp()[..., None, None] * h
        err = v[:, t] - torch.einsum("bhk,bhkv->bhv", kt, h)  # (B, H, V)
        h = h + (bt * kt).unsqueeze(-1) * err.unsqueeze(-2)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], h))
    return torch.stack(outs, 1), (h if output_final_state else None)


def tanh_rnn(x: Tensor, a: Tensor, h0: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """A nonlinear recurrence (not affine in h): x/a (B, S, H, D) -> (B, S, H, D), h (B, H, D)."""
    h = h0 if h0 is not None else x.new_zeros(x.shape[0], *x.shape[2:])
    outs = []
    for t in range(x.shape[1]):
        h = torch.tanh(a[:, t] * h + x[:, t])
        outs.append(h)
    return torch.stack(outs, 1), h


CONTRACTS = {
    "gla": dict(target=gla, seq_args={"q": 1, "k": 1, "v": 1, "g": 1}, outputs={0: 1}, initial_state="initial_state",
                final_state=1, final_state_flag="output_final_state", transition="elementwise", drive=("v",)),
    "ssd": dict(target=ssd, seq_args={"x": 1, "dt": 1, "B": 1, "C": 1}, outputs={0: 1}, initial_state="initial_state",
                final_state=1, final_state_flag="return_final_states", transition="elementwise", drive=("x",)),
    "delta_rule": dict(target=delta_rule, seq_args={"q": 1, "k": 1, "v": 1, "g": 1, "beta": 1}, outputs={0: 1},
                       initial_state="initial_state", final_state=1, final_state_flag="output_final_state",
                       transition="matrix", drive=("v",)),
    "tanh_rnn": dict(target=tanh_rnn, seq_args={"x": 1, "a": 1}, outputs={0: 1}, initial_state="h0", final_state=1,
                     transition="serial"),
}


@contextlib.contextmanager
def registered(*names: str) -> Iterator[list]:
    """The named stand-ins registered for the block (yields their specs), then forgotten (tests stay
    order-independent)."""
    import cp_compile

    specs = [cp_compile.register_recurrence(**CONTRACTS[n]) for n in names]
    try:
        yield specs
    finally:
        for spec in specs:
            cp_compile.unregister_recurrence(spec.target)
