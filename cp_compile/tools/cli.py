"""The ``cp-compile`` command. Subcommands: ``plan`` (below), ``dump`` and ``explain`` (graph_commands.py).

``plan`` sizes a context-parallel run on paper, from the formulas below (docs/design.md §1).
Notation: c = S/N tokens per GPU, h = hidden, H query heads, H_kv KV heads, d = h/H,
b = bytes per element, F = dense FLOP/s, B = link bytes/s in ONE direction (the ring
sends to rank r+1 and receives from rank r-1 at once, so each block uses one direction).

* Ring step, forward, one layer: compute 4·f·c²·d·H FLOPs (q·Kᵀ and P·V, 2 FLOPs per
  multiply-add); transfer K and V of the KV heads only, 2·c·d·H_kv·b bytes. f is the
  fraction of (query, key) pairs a step computes: 1 non-causal; ½ causal zig-zag /
  striped; 1 causal contiguous (the ring waits for its busiest rank). Overlap is
  complete when compute ≥ transfer, i.e. c ≥ (b/2)·(H_kv/H)·(1/f)·F/B. docs/design.md §1's
  c ≥ (b/2)·F/B is the MHA (H_kv = H), non-causal case with B counted in both
  directions (600 GB/s A100, 900 GB/s H100), which gives its ≈520 / ≈1.1k tokens.
* Backward: flash-attention backward does 5 matmuls (10·f·c²·d·H FLOPs); K, V (b bytes)
  and the travelling fp32 dK/dV accumulators (4 bytes) move: 2·c·d·H_kv·(b+4) bytes,
  so c ≥ ((b+4)/5)·(H_kv/H)·(1/f)·F/B.
* Memory per GPU = model states + micro_batch·c·(L·act + logits + ring):
  model states 16 B/param with AdamW (bf16/fp16 weights 2 + grads 2, fp32 master 4 and
  moments 4+4; fp32: 4+4+4+4), 2·b B/param (weights + grads) with ``--no-optimizer``,
  divided by N with ``--fsdp`` (states sharded over the same GPUs). act = 34·h·(b/2) B per
  token per layer: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models", 16-bit sbh(34 + 5as/h) without the 5as/h score term, which flash
  attention never stores. logits = V·(b+4) B per token (logits + fp32 copy for the loss).
  ring = 2 KV blocks (2·2·d·H_kv·b), 2 fp32 dK/dV accumulators (2·2·d·H_kv·4) and the
  fp32 out/dQ (4·h), per token. Max S solves total(S) ≤ HBM (linear in S), rounded down
  to the layout's multiple (2N zig-zag, N otherwise).
* Links: a hardware profile has ``gbps`` inside a node of ``node_gpus`` devices and
  ``inter_gbps`` between nodes (cp_compile.hardware). A ring over N consecutive ranks uses
  B = ``Hardware.link_gbps(N)``: the node link when N ≤ node_gpus (or the profile has no
  inter-node link), else the inter-node one, since the ring waits for its slowest hop.
* Strategies (``--strategy``, cp_compile.tools.plan_strategies): ring, Ulysses (all-to-all of
  heads over the N GPUs) and 2-D (Ulysses over u GPUs of a node x ring over r = N/u), each
  priced by the one cost model cp_compile.ulysses.cost (bytes sent, time, memory per GPU
  per attention layer per training step; formulas in its docstring and docs/design.md §1).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from .doctor import add_doctor_parser, cmd_doctor
from .graph_commands import add_dump_parser, add_explain_parser, cmd_dump, cmd_explain
from .plan_strategies import CHOICES, degree_error, missing_strategies, strategy_costs, strategy_lines
from ..hardware import HARDWARE, HW_FORM, Hardware
from ..hardware import parse_hardware as _parse_hardware
from ..options import LOAD_BALANCES
from ..ulysses.cost import AttentionShape


@dataclass(frozen=True)
class Model:
    """A decoder-only transformer (Llama layout: GQA attention, SwiGLU MLP, untied lm_head)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def params(self) -> int:
        """Embedding + lm_head + per layer (q, k, v, o, gate/up/down, 2 norms) + final norm."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * self.ffn + 2 * h
        return 2 * self.vocab * h + self.layers * per_layer + h


MODELS: Dict[str, Model] = {
    "llama-8b": Model("llama-8b", 32, 4096, 32, 8, 14336, 128256),  # Llama 3.1 8B config.json
    "llama-70b": Model("llama-70b", 80, 8192, 64, 8, 28672, 128256),  # Llama 3.1 70B config.json
}

DTYPE_BYTES: Dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}
GIB = 2**30
RECOMMEND = {  # causal -> (layout, why)
    True: ("zigzag", "causal: zig-zag gives every rank the same work each step, contiguous leaves the last rank "
                     "~2N x the first's; striped balances too but needs a diagonal mask every step"),
    False: ("any", "non-causal: every rank computes all c x c pairs each step whatever the layout, so all "
                   "balance; contiguous is the simplest (no input permutation)"),
}
MODEL_FORM = "custom:LAYERS,HIDDEN,HEADS,KV_HEADS[,FFN[,VOCAB]]"


def _custom_fields(spec: str, what: str, names: List[str], form: str, example: str,
                   cast: Callable[[str], float], sizes: range) -> list:
    """The numbers of a ``custom:...`` spec, or an argparse error naming the choices or the form."""
    if not spec.startswith("custom:"):
        raise argparse.ArgumentTypeError(f"unknown {what} {spec!r}; choose one of {', '.join(names)} or {form}")
    try:
        v = [cast(x) for x in spec[len("custom:"):].split(",")]
        ok = len(v) in sizes and all(math.isfinite(x) and x > 0 for x in v)
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"malformed {what} {spec!r}; expected {form} with positive numbers, "
                                         f"e.g. {example}")
    return v


def parse_model(spec: str) -> Model:
    """A name from MODELS or ``custom:LAYERS,HIDDEN,HEADS,KV_HEADS[,FFN[,VOCAB]]``
    (FFN defaults to 3.5·HIDDEN rounded up to a multiple of 256, VOCAB to 128256)."""
    if spec in MODELS:
        return MODELS[spec]
    v = _custom_fields(spec, "model", list(MODELS), MODEL_FORM, "custom:32,4096,32,8", int, range(4, 7))
    layers, hidden, heads, kv = v[:4]
    if hidden % heads or heads % kv:
        raise argparse.ArgumentTypeError(f"model {spec!r}: HIDDEN must divide by HEADS and HEADS by KV_HEADS")
    ffn = v[4] if len(v) > 4 else -(-7 * hidden // 2 // 256) * 256
    return Model(spec, layers, hidden, heads, kv, ffn, v[5] if len(v) > 5 else 128256)


def parse_hardware(spec: str) -> Hardware:
    """argparse type: :func:`cp_compile.hardware.parse_hardware`, its error as argparse's."""
    try:
        return _parse_hardware(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_int(text: str) -> int:
    """argparse type: an integer ≥ 1."""
    value = int(text) if text.strip().lstrip("+").isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def overlap_threshold(tflops: float, gbps: float, bytes_per_elem: float, heads: int = 1, kv_heads: int = 1,
                      work_fraction: float = 1.0, flops_per_pair: float = 4.0) -> float:
    """Smallest c with flops_per_pair·f·c²·d·H / F ≥ 2·c·d·H_kv·b / B: 4 and b forward, 10 and b+4
    backward (fp32 dK/dV travel too). The defaults (MHA, non-causal, forward) give docs/design.md §1's (b/2)·F/B."""
    return 2 * bytes_per_elem * kv_heads / heads / (flops_per_pair * work_fraction) * tflops * 1e3 / gbps


@dataclass(frozen=True)
class RingStep:
    """One ring step of one layer on one GPU (forward or backward)."""

    flops: float
    bytes: float
    compute_s: float
    transfer_s: float
    threshold: float  # smallest c whose compute hides the transfer


@dataclass(frozen=True)
class Plan:
    """Everything ``plan`` prints. Times in seconds, memory in bytes, per GPU."""

    seq_len: int  # after padding to the layout's multiple (2N zig-zag, N otherwise)
    c: int  # tokens per GPU
    work_fraction: float  # f: share of the c x c (query, key) pairs a ring step computes
    fwd: RingStep
    bwd: RingStep
    states_bytes: float
    act_bytes: float
    logits_bytes: float
    ring_bytes: float
    total_bytes: float
    hbm_bytes: float
    max_seq_len: int  # 0: nothing fits
    recommended: str
    reason: str
    margin: float  # c / forward threshold: ≥ 1 means the forward transfer hides behind compute


def ring_step(model: Model, hw: Hardware, c: int, f: float, flops_per_pair: float, bytes_per_elem: float,
              micro_batch: int = 1, gbps: Optional[float] = None) -> RingStep:
    """One ring step of one layer: flops_per_pair·f·c²·d·H FLOPs, 2·c·d·H_kv·bytes_per_elem bytes over a
    link of ``gbps`` (default: the node link, ``hw.gbps``)."""
    gbps = hw.gbps if gbps is None else gbps
    flops = flops_per_pair * f * c * c * model.head_dim * model.heads * micro_batch
    nbytes = 2 * c * model.head_dim * model.kv_heads * bytes_per_elem * micro_batch
    return RingStep(flops, nbytes, flops / (hw.tflops * 1e12), nbytes / (gbps * 1e9), overlap_threshold(
        hw.tflops, gbps, bytes_per_elem, model.heads, model.kv_heads, f, flops_per_pair))


def plan_numbers(model: Model, hw: Hardware, seq_len: int, gpus: int, dtype: str = "bf16",
                 load_balance: str = "zigzag", causal: bool = True, micro_batch: int = 1,
                 optimizer: bool = True, fsdp: bool = False) -> Plan:
    """The numbers of a CP run (formulas in the module docstring); pure."""
    b, d, Hkv, h = DTYPE_BYTES[dtype], model.head_dim, model.kv_heads, model.hidden
    unit = 2 * gpus if load_balance == "zigzag" else gpus
    c = -(-seq_len // unit) * unit // gpus  # S padded to the layout's multiple, as the backend does
    f = 0.5 if causal and load_balance != "contiguous" else 1.0
    link = hw.link_gbps(gpus)  # the ring's slowest hop: across nodes once it spans more than one
    fwd, bwd = (ring_step(model, hw, c, f, k, e, micro_batch, link) for k, e in ((4.0, b), (10.0, b + 4)))
    states = model.params * ((16 if optimizer else 2 * b) / (gpus if fsdp else 1))
    act_tok, logit_tok = model.layers * 34 * h * b / 2, model.vocab * (b + 4)
    ring_tok = 2 * (2 * d * Hkv) * b + 2 * (2 * d * Hkv) * 4 + 4 * h  # 2 KV blocks, 2 fp32 dK/dV, out/dQ
    per_tok, hbm = micro_batch * (act_tok + logit_tok + ring_tok), hw.hbm_gib * GIB  # B per local token
    max_s = int(max(0.0, (hbm - states) / per_tok) * gpus) // unit * unit
    tok = micro_batch * c  # local tokens
    return Plan(c * gpus, c, f, fwd, bwd, states, tok * act_tok, tok * logit_tok, tok * ring_tok,
                states + c * per_tok, hbm, max_s, *RECOMMEND[causal], c / fwd.threshold)


def format_plan(p: Plan, a: argparse.Namespace) -> str:
    """Human-readable report of ``p``, computed from the ``plan`` arguments ``a``."""
    model, hw, gpus, causal = a.model, a.hardware, a.gpus, a.causal
    g = lambda x: f"{x / GIB:8.2f} GiB"  # noqa: E731
    _t = lambda sec: f"{sec * 1e3:.3g} ms" if sec >= 1e-3 else f"{sec * 1e6:.3g} us"  # noqa: E731
    fix = "more GPUs or a shorter S" if a.fsdp else "more GPUs, --fsdp or a shorter S"
    fits = "fits" if p.total_bytes <= p.hbm_bytes else f"DOES NOT FIT (fix: {fix})"
    padded = "" if p.seq_len == a.seq_len else f" (padded from {a.seq_len})"
    lines = [
        f"model     {model.name}: {model.params / 1e9:.2f}B params, {model.layers} layers, hidden {model.hidden}, "
        f"{model.heads} heads / {model.kv_heads} KV heads (head dim {model.head_dim})",
        f"hardware  {gpus} x {hw.name}: {hw.tflops:g} TFLOP/s dense, {_links(hw)}, {hw.hbm_gib:g} GiB HBM",
        f"run       S = {p.seq_len}{padded}, c = S/N = {p.c} tokens per GPU, {a.dtype}, "
        f"{'causal' if causal else 'non-causal'}, {a.load_balance}, micro-batch {a.micro_batch}",
        "memory per GPU",
        f"  model states {g(p.states_bytes)}",
        f"  activations  {g(p.act_bytes)}  (34·h·b/2 B/token/layer: Korthikanti et al. 2022, flash attn)",
        f"  logits       {g(p.logits_bytes)}  (vocab·(b+4) B per token)",
        f"  ring buffers {g(p.ring_bytes)}  (2 KV blocks + 2 fp32 dK/dV accumulators + fp32 out/dQ)",
        f"  total        {g(p.total_bytes)} of {p.hbm_bytes / GIB:g} GiB: {fits}",
        f"ring step, per layer (f = {p.work_fraction:g} of the c x c pairs computed per step; ring over {gpus} GPUs "
        f"at {hw.link_gbps(gpus):g} GB/s)",
        *(f"  {name:9} compute {st.flops / 1e12:.3g} TFLOP = {_t(st.compute_s)}, transfer {st.bytes / 2**20:.3g} "
          f"MiB = {_t(st.transfer_s)}: {'transfer hidden' if st.compute_s >= st.transfer_s else 'transfer-bound'}"
          for name, st in (("forward", p.fwd), ("backward", p.bwd))),
        f"overlap   c >= {p.fwd.threshold:.0f} tokens (forward; backward {p.bwd.threshold:.0f}): "
        f"margin c / threshold = {p.margin:.2f}x",
        f"max sequence length that fits on {gpus} GPUs: "
        + (f"S = {p.max_seq_len}" if p.max_seq_len else "none (model states fill HBM; try --fsdp or more GPUs)"),
        f"load balance: recommended {p.recommended} ({p.reason})",
    ]
    if causal and a.load_balance == "contiguous":
        lines.append(f"warning: causal contiguous is ~{(gpus - 0.5) / (gpus / 2):.2f}x slower than zigzag")
    return "\n".join(lines)


def _links(hw: Hardware) -> str:
    if hw.inter_gbps is None:
        return f"{hw.gbps:g} GB/s per direction"
    return f"{hw.gbps:g} GB/s per direction inside nodes of {hw.node_gpus}, {hw.inter_gbps:g} between nodes"


def attention_shape(model: Model, seq_len: int, dtype: str, causal: bool, micro_batch: int) -> AttentionShape:
    """One attention layer of ``model`` as cp_compile.ulysses.cost prices it (``seq_len``: S padded)."""
    return AttentionShape(micro_batch, model.heads, model.kv_heads, model.head_dim, seq_len, DTYPE_BYTES[dtype],
                          causal)


def cmd_plan(args: argparse.Namespace) -> int:
    """``cp-compile plan``: print the plan and the strategies' comparison; 0 on success."""
    p = plan_numbers(args.model, args.hardware, args.seq_len, args.gpus, args.dtype, args.load_balance,
                     args.causal, args.micro_batch, args.optimizer, args.fsdp)
    shape = attention_shape(args.model, p.seq_len, args.dtype, args.causal, args.micro_batch)
    costs = strategy_costs(shape, args.gpus, args.hardware, args.strategy, args.ulysses_degree)
    missing = missing_strategies(costs, args.gpus) if args.strategy == "all" else []
    lines = [format_plan(p, args), *strategy_lines(costs, shape, args.hardware, missing)]
    if args.causal and args.load_balance == "contiguous":
        lines.append("note      the strategy table prices a balanced causal layout (zig-zag / striped: half the pairs "
                     "per ring step); a causal contiguous ring waits for its busiest rank (warning above)")
    print("\n".join(lines))
    return 0


def check_plan(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit 2 (argparse) naming the fix when ``--strategy`` / ``--ulysses-degree`` do not fit ``--gpus``."""
    error = degree_error(args.gpus, args.strategy, args.ulysses_degree, args.hardware)
    if error:
        parser.error(error)


PLAN_EXAMPLES = """examples:
  cp-compile plan --model llama-8b --seq-len 131072 --gpus 8 --hardware h100-nvlink
  cp-compile plan --model llama-70b --seq-len 1048576 --gpus 64 --hardware h100-ib --fsdp
  cp-compile plan --model custom:32,4096,32,8 --seq-len 65536 --gpus 4 --hardware custom:989,450,80 --no-causal
  cp-compile plan --model llama-8b --seq-len 131072 --gpus 16 --hardware h100-cluster --strategy 2d --ulysses-degree 4
  cp-compile plan --model llama-8b --seq-len 524288 --gpus 32 --hardware custom:989,450,80,8,50
"""


def build_parser() -> argparse.ArgumentParser:
    """The ``cp-compile`` parser; ``args.command`` is a key of COMMANDS."""
    parser = argparse.ArgumentParser(prog="cp-compile", description="Context parallelism for PyTorch: tools.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=PLAN_EXAMPLES)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    plan = sub.add_parser("plan", help="memory, ring overlap and max sequence length of a CP run",
                          description=__doc__, epilog=PLAN_EXAMPLES,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    plan.add_argument("--model", required=True, type=parse_model, metavar="MODEL",
                      help=f"{' | '.join(MODELS)} | {MODEL_FORM}")
    plan.add_argument("--seq-len", required=True, type=positive_int, metavar="S", help="total sequence length")
    plan.add_argument("--gpus", required=True, type=positive_int, metavar="N", help="GPUs in the CP group")
    plan.add_argument("--hardware", required=True, type=parse_hardware, metavar="HW",
                      help=f"{' | '.join(HARDWARE)} | {HW_FORM} (GB/s per direction)")
    plan.add_argument("--dtype", choices=tuple(DTYPE_BYTES), default="bf16")
    plan.add_argument("--load-balance", choices=[lb for lb in LOAD_BALANCES if lb != "documents"], default="zigzag",
                      help="a fixed layout (documents: the layout depends on each batch, so no plan)")
    plan.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True, help="causal attention")
    plan.add_argument("--micro-batch", type=positive_int, default=1, metavar="B")
    plan.add_argument("--no-optimizer", dest="optimizer", action="store_false",
                      help="drop fp32 master weights and AdamW moments (keep weights + grads: 2·b B/param)")
    plan.add_argument("--fsdp", action="store_true", help="shard model states over the N GPUs (FSDP/ZeRO-3)")
    plan.add_argument("--strategy", choices=CHOICES, default="all",
                      help="the CP strategies to compare: ring, ulysses (all-to-all of heads over the N GPUs), 2d "
                           "(Ulysses over u GPUs x ring over N/u), or all (default)")
    plan.add_argument("--ulysses-degree", type=positive_int, default=None, metavar="U",
                      help="u of the 2d strategy, a divisor of N with 1 < u < N (default: the GPUs of a node when "
                           "that divides N and is < N, else N's largest proper divisor)")
    add_dump_parser(sub)
    add_explain_parser(sub)
    add_doctor_parser(sub)
    return parser


COMMANDS: Dict[str, Callable[[argparse.Namespace], int]] = {"plan": cmd_plan, "dump": cmd_dump, "explain": cmd_explain,
                                                            "doctor": cmd_doctor}


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``cp-compile``; returns the exit code (argparse exits 2 on bad arguments)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "plan":
        check_plan(parser, args)
    return COMMANDS[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
