"""The zoo: tiny transformers written the ways people write them, each one file, for ring_cp.

Every member is a module of this package defining ``factory(seq_len=..., seed=0)`` that
returns ``(model, args)`` or ``(model, kwargs)`` (the forms ``cp-compile explain`` takes:
``cp-compile explain examples/zoo/alibi.py:factory``), where calling the model returns the
training loss (a scalar, or an object with ``.loss`` such as a Hugging Face output), and a
module-level ``MEMBER = Member(...)`` (or ``MEMBERS = [...]``) describing it. The model
code is plain PyTorch in the style of a widely used codebase; nothing in it knows about
context parallelism. :func:`members` imports every module here and returns the registry;
``tests/test_zoo.py``, ``examples/zoo_sweep.py`` and the zoo table of docs/zoo.md read it.

Sizes are chosen so that a tensor spanning the sequence twice is recognisable by shape
(:mod:`.measure`): the default sequence is 80 tokens (c = 40 rows a rank on 2 ranks, 20
on 4) and the batch 3 (so B·c, the tokens of a rank flattened, is never S or c), and no
model dimension (or product of them, e.g. 3·dim for a fused qkv) is 20, 40 or 80.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable, Dict, Tuple

SEQ_LEN = 80  # default sequence length of every member (divisible by 2N for N = 2, 4)
BATCH = 3  # default batch of every member


@dataclass(frozen=True)
class Member:
    """One zoo model and what its checks expect (``tests/test_zoo.py``)."""

    name: str  # registry key, e.g. "alibi"
    summary: str  # one line for docs/zoo.md's table: the style and what it exercises
    factory: Callable[..., Tuple[Any, ...]]  # factory(seq_len=SEQ_LEN, seed=0) -> (model, args | kwargs)
    worlds: Tuple[int, ...] = (2,)  # CP sizes the test suite runs; the sweep runs 2 and 4 for all
    mixes_tokens: Tuple[str, ...] = ()  # ops outside attention that really mix tokens: the fallbacks
    # the member must show (each a substring of one fallback message), none other
    min_sharded: float = 0.9  # lower bound on the record's sharded fraction of activation bytes
    fullgraph: bool = True  # compiled with fullgraph=True (False where Dynamo must break the graph)
    tol: float = 1e-5  # relative error bound on the loss and every parameter gradient (fp32)
    zero_grads: Tuple[str, ...] = ()  # parameters whose gradient is zero in exact arithmetic (a key bias
    # nothing rotates): measured against a fraction of the whole gradient's norm (examples/_exact.py)


def members() -> Dict[str, Member]:
    """Every member of every module in this package, by name (import order: alphabetical)."""
    found: Dict[str, Member] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_") or info.name == "measure":
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        entries = list(getattr(module, "MEMBERS", [])) + ([module.MEMBER] if hasattr(module, "MEMBER") else [])
        for member in entries:
            if member.name in found:
                raise ValueError(f"zoo: two members named {member.name!r} ({module.__name__})")
            found[member.name] = member
    return found
