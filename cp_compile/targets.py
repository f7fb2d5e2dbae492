"""Loading a ``cp-compile`` TARGET: ``path/to/file.py:factory`` -> ``(model, example_inputs)``."""

from __future__ import annotations

import importlib.util
import inspect as _inspect
import os
import re
import sys
from typing import Any, Callable, Optional, Tuple

import torch

TARGET_FORM = "path/to/file.py:factory"
TARGET_EXAMPLE = "examples/models.py:llama_factory"


class TargetError(ValueError):
    """TARGET (or an argument that goes with it) is unusable; the message names the fix."""



def load_target(spec: str, seq_len: Optional[int] = None) -> Tuple[torch.nn.Module, Tuple[Any, ...]]:
    """``path/to/file.py:factory`` -> ``factory(**kw)``, checked to be ``(model, example_inputs)``.

    ``seq_len`` is passed as ``seq_len=`` only when given (and the factory must accept it).
    The file's directory is on ``sys.path`` while it is imported and the factory runs,
    so sibling imports (``from models import ...``) work.
    """
    if not isinstance(spec, str) or ":" not in spec:
        raise TargetError(f"TARGET must have the form {TARGET_FORM} (e.g. {TARGET_EXAMPLE}), got {spec!r}. "
                          "Fix: add ':' and the name of a function returning (model, example_inputs).")
    path, name = spec.rsplit(":", 1)
    if not path or not name.isidentifier():
        raise TargetError(f"TARGET must have the form {TARGET_FORM} (e.g. {TARGET_EXAMPLE}), got {spec!r}: "
                          f"{'the file part is empty' if not path else f'{name!r} is not a function name'}.")
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise TargetError(f"TARGET file {path} does not exist. Fix: give the path of a .py file "
                          f"(relative to {os.getcwd()} or absolute), e.g. {TARGET_EXAMPLE}.")
    folder = os.path.dirname(path)
    sys.path.insert(0, folder)
    try:
        module = _import_file(path)
        factory = getattr(module, name, None)
        if not callable(factory):
            found = sorted(n for n, v in vars(module).items()
                           if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__)
            raise TargetError(f"{os.path.relpath(path)} has no function {name!r}. "
                              f"Callables defined there: {', '.join(found) or '(none)'}.")
        kwargs = {}
        if seq_len is not None:
            if not _accepts(factory, "seq_len"):
                raise TargetError(f"{name}() takes no seq_len argument, so --seq-len cannot be applied. "
                                  "Fix: drop --seq-len, or give the factory a seq_len parameter.")
            kwargs["seq_len"] = seq_len
        try:
            result = factory(**kwargs)
        except Exception as e:
            raise TargetError(f"{name}({', '.join(f'{k}={v}' for k, v in kwargs.items())}) raised "
                              f"{type(e).__name__}: {e}. Fix the factory (or its arguments).") from e
    finally:
        try:
            sys.path.remove(folder)
        except ValueError:
            pass
    if not (isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[0], torch.nn.Module)
            and isinstance(result[1], (tuple, list))):
        got = type(result).__name__
        if isinstance(result, (tuple, list)):
            got += f" of ({', '.join(type(r).__name__ for r in result)})"
        raise TargetError(f"{name}() must return (model, example_inputs): an nn.Module and a tuple of forward() "
                          f"arguments; it returned a {got}. Fix: return (model, (input_ids, labels)), say.")
    return result[0], tuple(result[1])


def _import_file(path: str):
    mod_name = "_cp_target_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0]) + f"_{abs(hash(path))}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise TargetError(f"cannot import {path} as Python. Fix: TARGET must name a .py file ({TARGET_FORM}).")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # dataclasses look their module up while the file executes
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(mod_name, None)
        raise TargetError(f"importing {path} raised {type(e).__name__}: {e}. Fix the file.") from e
    return module


def _accepts(fn: Callable, name: str) -> bool:
    try:
        params = _inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in params)
