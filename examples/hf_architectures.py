"""Every Hugging Face architecture through ring_cp against one process: one training step each,
and what came of it.

The architectures, their tiny configs, models and batches are ``examples/hf_configs.py``'s. On
every rank of a gloo group::

    result = run_architecture("llama")         # one training step, ring_cp vs one process
    outcome, message = classify(merge_ranks(every_ranks_result))   # "ring", ..., "crash"

"Exact" is ``examples/_exact.py``'s: :func:`_exact.grad_errors` with the float64 truth (a
gradient whose error against the fp32 one-process run exceeds TOL is within TOL exactly when
ring_cp is no further from the fp64 gradient than twice the fp32 one-process run), the
gradients that are zero in exact arithmetic decided from fp64, and the attention calls counted
by :class:`_exact.AttentionCount`. ``benchmarks/hf_sweep.py`` runs every architecture and writes
``docs/hf_sweep.md``; ``tests/test_hf_architectures.py`` keeps about 20 families in CI.
"""

from __future__ import annotations

import contextlib
import math
import re
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from _exact import TOL, ZERO_CEILING, AttentionCount, cp_compile_warnings, grad_errors, rel
from hf_configs import architecture, architectures, build_model, make_batch  # noqa: F401 - the sweep's entry points

OUTCOMES = ("ring", "ring + gathers", "sharded", "sharded + gathers", "no CP, warned", "refused", "wrong", "silent",
            "crash")
# Counted apart from the nine outcomes: the step fails without ring_cp (the model cannot be built,
# its one-process eager step fails, or compiling it fails without ring_cp as with it).
SKIPPED = ("not built", "reference failed", "compile fails without ring_cp")
ZERO_EXACT = 1e-10  # fp64 gradient norm <= this x the whole fp64 gradient norm: zero in exact arithmetic


def forget_warnings() -> None:
    """cp_compile warns once per process per source line (``_warned`` sets in its modules); a sweep
    runs many models in one process, so each starts with none warned yet."""
    for name, module in list(sys.modules.items()):
        warned = getattr(module, "_warned", None) if name.startswith("cp_compile") else None
        if isinstance(warned, set):
            warned.clear()
        elif isinstance(warned, bool):
            module._warned = False  # type: ignore[attr-defined]



# -- one architecture, on every rank -----------------------------------------------------------
def run_architecture(model_type: str, seq_len: int = 64, batch: int = 2, seed: int = 0) -> Dict[str, Any]:
    """One training step of ``model_type`` through ring_cp against one process, on this rank of an
    initialised process group (every rank passes the same whole batch).

    Builds the model from one seed three times: the eager fp32 reference (its attention calls
    counted by :class:`_exact.AttentionCount`), an fp64 copy (the truth, and which gradients are
    zero in exact arithmetic), and the copy compiled with ring_cp (``inner="aot_eager"``,
    ``fullgraph=False``). Returns plain numbers and strings for :func:`classify` (JSON-ready):
    ``status`` ("ran", "not built", "reference failed"), the loss and per-parameter gradient errors
    (:func:`_exact.grad_errors`), ``ring_ops`` against ``attentions``, the gathers, the unsplit
    attention, the cp_compile WARNINGs, and the exception of the CP run if any, with that of the same
    step compiled without ring_cp (``plain_compile``)."""
    import torch.distributed as dist

    torch._dynamo.reset()
    forget_warnings()
    start = time.time()
    _, head, class_name = architecture(model_type)
    result: Dict[str, Any] = {"model_type": model_type, "head": head, "class": class_name, "status": "ran",
                              "rank": dist.get_rank() if dist.is_initialized() else 0, "seq_len": seq_len}
    try:
        ref_model, cp_model = build_model(model_type, seed), build_model(model_type, seed)
    except Exception as e:  # noqa: BLE001 - reported, counted as skipped
        return {**result, "status": "not built", "error": error_line(e), "seconds": time.time() - start}
    result.update({"class": type(ref_model).__name__, "attn_implementation": ref_model.config._attn_implementation})
    eos = getattr(ref_model.config, "eos_token_id", None)
    inputs = make_batch(head, seq_len, batch, seed, eos[0] if isinstance(eos, list) else eos)
    try:
        ref_loss, attentions = _reference(ref_model, inputs, seed)
    except Exception as e:  # noqa: BLE001 - the one-process eager run itself fails: not ring_cp's doing
        return {**result, "status": "reference failed", "error": error_line(e), "seconds": time.time() - start}
    truth, zero_rule = _truth(model_type, inputs, seed)
    result.update(attentions=attentions, zero_rule=zero_rule, **_cp_run(cp_model, inputs, seed))
    cp_loss = result.pop("cp_loss")
    if result["cp_error"] and not result["cp_error"]["refused"]:  # is it ring_cp's, or torch.compile's?
        result["plain_compile"] = _plain_compile(model_type, inputs, seed)
    if result["cp_error"] is None:
        result.update(_compare(cp_model, ref_model, truth), loss_error=rel(cp_loss, ref_loss), ref_loss=ref_loss.item())
    return {**result, "seconds": time.time() - start}


def _loss(out: Any) -> Tensor:
    """``out.loss``; a ValueError if the head computed none."""
    loss = getattr(out, "loss", None)
    if not isinstance(loss, Tensor):
        raise ValueError(f"{type(out).__name__} has no loss: the head computes none from labels=")
    return loss


def _reference(model: nn.Module, inputs: Dict[str, Tensor], seed: int) -> Tuple[Tensor, int]:
    """Forward (its attention calls counted) and backward of the eager model on the whole batch."""
    torch.manual_seed(seed)  # any random op in the forward draws the same numbers in every run
    with AttentionCount() as count:
        loss = _loss(model(**inputs))
    if not torch.isfinite(loss):
        raise ValueError(f"the one-process loss is {loss.item()}")
    loss.backward()
    return loss.detach(), count.calls


def _truth(model_type: str, inputs: Dict[str, Tensor], seed: int) -> Tuple[Optional[Dict[str, Tensor]], str]:
    """The fp64 copy's parameter gradients (None where it failed) and which rule decides the
    gradients that are zero in exact arithmetic."""
    try:
        grads = _fp64_grads(model_type, inputs, seed)
    except Exception as e:  # noqa: BLE001 - fall back to the fp32 zeros, and say so
        return None, f"fp64 copy failed ({error_line(e)[:120]}): only exactly-zero fp32 gradients are zero"
    return {n: g for n, g in grads.items() if g is not None}, "fp64"


def _fp64_grads(model_type: str, inputs: Dict[str, Tensor], seed: int) -> Dict[str, Optional[Tensor]]:
    """The parameter gradients of the eager step in float64 (same weights, same batch)."""
    model = build_model(model_type, seed).double()
    with contextlib.suppress(Exception):  # MoE experts: grouped_mm has no fp64; the loop is the same sum
        model.set_experts_implementation("eager")
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # tensors the forward creates match the fp64 weights
    try:
        torch.manual_seed(seed)
        _loss(model(**inputs)).backward()
    finally:
        torch.set_default_dtype(default)
    return {n: p.grad for n, p in model.named_parameters()}


def _compare(cp_model: nn.Module, ref_model: nn.Module, truth: Optional[Dict[str, Tensor]]) -> Dict[str, Any]:
    """The gradient errors by :func:`_exact.grad_errors` (``zero``: :func:`_zero_in_exact_arithmetic`,
    ``truth``: the fp64 gradients), those zero gradients, and the fp32 reference's own relative
    error against fp64 per parameter (the rounding floor a CP error compares with)."""
    zero = _zero_in_exact_arithmetic(ref_model, truth)
    errors = grad_errors(cp_model, ref_model, zero=zero, truth=truth)
    refs = {n: p.grad for n, p in ref_model.named_parameters() if p.grad is not None}
    noise = {n: rel(refs[n], truth[n]) for n in errors if truth and n in truth and n in refs}
    return {"grad_errors": errors, "zero_grads": zero, "fp32_noise": noise}


def _zero_in_exact_arithmetic(ref_model: nn.Module, truth: Optional[Dict[str, Tensor]]) -> List[str]:
    """The parameters whose gradient is zero in exact arithmetic (their fp32 gradients are rounding
    noise): exactly zero in fp32, or (with the fp64 ``truth``) an fp64 norm <= ZERO_EXACT x the whole
    fp64 gradient's. Only those with an fp32 gradient below ``_exact.ZERO_CEILING`` of the whole, as
    :func:`_exact.grad_errors` requires; a louder one is judged against the truth like any other."""
    refs = {n: p.grad.double() for n, p in ref_model.named_parameters() if p.grad is not None}
    whole32 = math.sqrt(sum(g.square().sum().item() for g in refs.values()))
    zero = {n for n, g in refs.items() if not g.any()}
    if truth:
        whole64 = math.sqrt(sum(g.double().square().sum().item() for g in truth.values()))
        zero |= {n for n, g in truth.items() if n in refs and g.double().norm().item() <= ZERO_EXACT * whole64}
    return sorted(n for n in zero if refs[n].norm().item() <= ZERO_CEILING * whole32)


def _cp_run(model: nn.Module, inputs: Dict[str, Tensor], seed: int) -> Dict[str, Any]:
    """Forward and backward of ``model`` compiled with ring_cp; what the backend recorded, the
    WARNINGs it logged, and the exception if it raised."""
    import cp_compile

    backend = cp_compile.RingCP(inner="aot_eager")
    compiled = torch.compile(model, backend=backend, fullgraph=False)
    loss, error = None, None
    with cp_compile_warnings() as warnings, torch._dynamo.config.patch(specialize_float=True):
        try:
            torch.manual_seed(seed)
            loss = _loss(compiled(**inputs))
            loss.backward()
            loss = loss.detach()
        except Exception as e:  # noqa: BLE001 - classified: refused or crash
            error = describe_error(e)
    return {"cp_loss": loss, "cp_error": error, "warnings": list(warnings),
            "ring_ops": sum(rec.rings for rec in backend.records), "gathers": list(backend.fallbacks),
            "recurrences": sum(len(rec.recurrences) for rec in backend.records),
            "unsplit": [u for rec in backend.records for u in rec.unsplit], "graphs": len(backend.records)}


def _plain_compile(model_type: str, inputs: Dict[str, Tensor], seed: int) -> Optional[str]:
    """The error of the same step compiled without ring_cp (``aot_eager``, one process), or None."""
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(specialize_float=True):
            torch.manual_seed(seed)
            _loss(torch.compile(build_model(model_type, seed), backend="aot_eager")(**inputs)).backward()
    except Exception as e:  # noqa: BLE001 - reported beside the CP run's error
        return error_line(e)
    return None


def error_line(e: BaseException) -> str:
    """``Type: first non-empty line of the message`` (and the next, where the first ends in ':')."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    first = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else (lines[0] if lines else "")
    return f"{type(e).__name__}: {first}"[:400]


def describe_error(e: BaseException) -> Dict[str, Any]:
    """The CP run's exception: ``refused`` if it, or an exception it wraps (Dynamo wraps what a
    backend raises), is cp_compile's ``CPRewriteError`` or a ValueError / NotImplementedError whose
    message names a fix ("Fix:"). ``line``: that exception's first line, else the innermost explicit
    cause's (``raise ... from``, Dynamo's ``inner_exception``); ``outer``: what the call raised."""
    from cp_compile.errors import CPRewriteError

    explicit, every = _chain(e, implicit=False), _chain(e, implicit=True)
    clear = [x for x in every if isinstance(x, CPRewriteError)
             or isinstance(x, (ValueError, NotImplementedError)) and "Fix:" in str(x)]
    shown = clear[0] if clear else explicit[-1]
    return {"refused": bool(clear), "line": error_line(shown), "outer": error_line(e)}


def _chain(e: Optional[BaseException], implicit: bool) -> List[BaseException]:
    """``e`` and the exceptions it wraps, outermost first (``__context__`` too if ``implicit``)."""
    out: List[BaseException] = []
    while e is not None and all(e is not x for x in out):
        out.append(e)
        e = getattr(e, "inner_exception", None) or e.__cause__ or (e.__context__ if implicit else None)
    return out


# -- outcomes ----------------------------------------------------------------------------------
def merge_ranks(results: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One result from every rank's: the worst errors over the ranks, the first rank's exception
    or skip, and every rank's warnings and gathers (each once)."""
    bad = [r for r in results if r["status"] != "ran" or r.get("cp_error")]
    merged = dict(bad[0] if bad else results[0])
    if merged["status"] != "ran" or merged.get("cp_error"):
        return merged
    merged["loss_error"] = max(r["loss_error"] for r in results)
    merged["grad_errors"] = {n: max(r["grad_errors"][n] for r in results) for n in merged["grad_errors"]}
    for key in ("warnings", "gathers", "unsplit"):
        merged[key] = list(dict.fromkeys(x for r in results for x in r[key]))
    merged["ring_ops"] = min(r["ring_ops"] for r in results)
    merged["recurrences"] = min(r.get("recurrences", 0) for r in results)
    return merged


def worst_grad(result: Dict[str, Any]) -> Tuple[str, float]:
    """The parameter with the largest gradient error, and that error (("", 0.0) if none)."""
    errors = result.get("grad_errors") or {}
    name = max(errors, key=lambda n: (math.isnan(errors[n]), errors[n]), default="")
    return name, errors.get(name, 0.0)



def classify(result: Dict[str, Any]) -> Tuple[str, str]:
    """``(outcome, first message)`` of a :func:`run_architecture` result (or :func:`merge_ranks`).

    Skipped (:data:`SKIPPED`): "not built", "reference failed", and "compile fails without
    ring_cp" (the CP run crashed and the same step compiled without ring_cp fails too). Else, in
    this order: "crash" (the CP run raised, not a refusal), "refused" (a CPRewriteError or an error
    naming its fix), "wrong" (the loss off by more than TOL, or a gradient by
    :func:`_exact.grad_errors`), "silent" (fewer ring ops than attention calls counted, or a gather,
    with no cp_compile WARNING saying so), "no CP, warned" (the WARNING: :func:`no_cp_warning`),
    "ring + gathers" (every gather warned), "ring". A model with no attention at all (0 counted, 0
    ring ops) whose recurrences were split by sequence (state passing, scans from run totals) is
    "sharded" ("sharded + gathers" with warned gathers); with none, it gets no context parallelism:
    "no CP, warned" or "silent" by the same WARNING rule. The message: the error, else the deciding or
    first WARNING, else what is wrong or unwarned."""
    if result["status"] != "ran":
        return result["status"], result["error"]
    if result.get("cp_error"):
        return _failed(result["cp_error"], result.get("plain_compile", ""))
    warnings, gathers = result["warnings"], result["gathers"]
    first = warnings[0] if warnings else ""
    name, grad = worst_grad(result)
    if not (result["loss_error"] <= TOL and grad <= TOL):
        noise = (result.get("fp32_noise") or {}).get(name)
        floor = "" if noise is None else f"; the fp32 reference's own error there: {noise:.1e}"
        return "wrong", (f"loss error {result['loss_error']:.1e}, gradient error {grad:.1e} ({name}){floor}"
                         + (f"; {first}" if first else ""))
    unwarned = [g for g in gathers if not any(g in w for w in warnings)]
    if unwarned:
        return "silent", f"gather without a WARNING: {unwarned[0]}"
    if result["ring_ops"] == result["attentions"] == 0 and result.get("recurrences"):
        return ("sharded + gathers" if gathers else "sharded"), first
    if no_cp(result):
        said = no_cp_warning(result)
        if said is None:
            return "silent", (f"no WARNING: {result['ring_ops']} ring op(s), {result['attentions']} attention call(s) "
                              "in the eager run (fused attention, softmax over square scores)"
                              + (f"; {first}" if first else ""))
        return "no CP, warned", said
    return ("ring + gathers" if gathers else "ring"), first


def _failed(error: Dict[str, Any], plain: Optional[str]) -> Tuple[str, str]:
    """The outcome of a CP run that raised: refused, crash, or (``plain``, the error of the step
    compiled without ring_cp, is one) compile fails without ring_cp. ``plain``: None when that
    compiled, "" when it was not tried."""
    if error["refused"]:
        return "refused", error["line"]
    if plain:
        return "compile fails without ring_cp", (plain if plain == error["line"] else
                                                 f"{plain}; with ring_cp: {error['line']}")
    return "crash", error["line"] + ("; without ring_cp it compiles" if plain is None else "")


def no_cp(result: Dict[str, Any]) -> bool:
    """Whether ring_cp left attention unsplit: fewer ring ops than attention calls, or none of either."""
    return result["ring_ops"] < result["attentions"] or result["ring_ops"] == result["attentions"] == 0


def no_cp_warning(result: Dict[str, Any]) -> Optional[str]:
    """The WARNING that says so (:func:`no_cp`): the first cp_compile WARNING about attention or the
    whole sequence that is not about a gather; None if none is."""
    said = [w for w in result["warnings"] if not any(g in w for g in result["gathers"])
            and re.search(r"attention|whole sequence", w)]
    return said[0] if said else None
