"""Loading a ``cp-compile`` TARGET: ``path/to/file.py:factory`` -> ``(model, args, kwargs)``.

The factory returns the model and its example inputs in one of the forms ``torch.export``
takes: ``(model, args)``, ``(model, kwargs)`` or ``(model, args, kwargs)``, with ``args`` a
tuple/list of positional forward() arguments (or a single tensor) and ``kwargs`` a dict of
keyword arguments, so a Hugging Face model can be given as it is called:
``(model, {"input_ids": ids, "position_ids": pos, "labels": ids, "use_cache": False})``.
"""

from __future__ import annotations

import importlib.util
import inspect as _inspect
import os
import re
import sys
from typing import Any, Callable, Dict, Optional, Tuple

import torch

TARGET_FORM = "path/to/file.py:factory"
TARGET_EXAMPLE = "examples/models.py:llama_factory"
RETURN_FORMS = "(model, args), (model, kwargs) or (model, args, kwargs)"
RETURN_HELP = (f"{RETURN_FORMS}, as torch.export takes them: args a tuple/list of positional forward() "
               "arguments (or a single tensor), kwargs a dict of keyword arguments")

Target = Tuple[torch.nn.Module, Tuple[Any, ...], Dict[str, Any]]


class TargetError(ValueError):
    """TARGET (or an argument that goes with it) is unusable; the message names the fix."""


def load_target(spec: str, seq_len: Optional[int] = None) -> Target:
    """``path/to/file.py:factory`` -> ``(model, args, kwargs)`` from ``factory(**kw)``.

    The factory may return ``(model, args)``, ``(model, kwargs)`` or ``(model, args, kwargs)``
    (see :func:`example_inputs`); the model is then called as ``model(*args, **kwargs)``.
    ``seq_len`` is passed as ``seq_len=`` only when given (and the factory must accept it).
    The file's directory is on ``sys.path`` while it is imported and the factory runs,
    so sibling imports (``from models import ...``) work.
    """
    path, name = _split_spec(spec)
    folder = os.path.dirname(path)
    sys.path.insert(0, folder)
    try:
        factory = _find_factory(path, name)
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
    model, args, kw = example_inputs(result, f"{name}()")
    _check_binds(model, args, kw, f"{name}()")
    return model, args, kw


def example_inputs(result: Any, who: str = "the factory") -> Target:
    """``(model, args)``, ``(model, kwargs)`` or ``(model, args, kwargs)`` -> ``(model, args, kwargs)``.

    As ``torch.export.export(model, args, kwargs)``: ``args`` a tuple or list (a single
    tensor is taken as the one positional argument), ``kwargs`` a dict with string keys (or None).
    Anything else raises :class:`TargetError` naming what ``who`` returned and the forms accepted.
    """
    parts = tuple(result) if isinstance(result, (tuple, list)) else (result,)
    model, rest = (parts[0], parts[1:]) if parts else (None, ())
    args: Any = ()
    kwargs: Any = {}
    if len(rest) == 1:
        (args,) = rest
        if isinstance(args, dict):
            args, kwargs = (), args
    elif len(rest) == 2:
        args, kwargs = rest[0], {} if rest[1] is None else rest[1]  # torch.export's kwargs=None
    if isinstance(args, torch.Tensor):
        args = (args,)
    ok = (isinstance(model, torch.nn.Module) and len(rest) in (1, 2) and isinstance(args, (tuple, list))
          and isinstance(kwargs, dict))
    if not ok:
        raise TargetError(f"{who} must return {RETURN_HELP}; it returned {_describe(result)}. Fix: return "
                          "(model, (input_ids, labels)), (model, {'input_ids': ids, 'labels': labels}) or "
                          "(model, (input_ids,), {'labels': labels}), say.")
    bad = [k for k in kwargs if not isinstance(k, str) or not k.isidentifier()]
    if bad:
        raise TargetError(f"{who} returned keyword inputs whose keys are not argument names: {bad!r}. Fix: key "
                          "the dict by forward()'s parameter names, e.g. {'input_ids': ids}.")
    return model, tuple(args), dict(kwargs)


def _describe(result: Any) -> str:
    """``a tuple of (LlamaForCausalLM, dict, int)``: the shape of a factory's return value."""
    got = f"a {type(result).__name__}"
    if isinstance(result, (tuple, list)):
        got += f" of ({', '.join(type(r).__name__ for r in result)})"
    return got


def _check_binds(model: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], who: str) -> None:
    """Refuse example inputs that ``model.forward`` cannot take, naming the argument (before any tracing)."""
    try:
        sig = _inspect.signature(model.forward)
    except (TypeError, ValueError):
        return
    where = f"{type(model).__name__}.forward{sig}"
    params = sig.parameters.values()
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        unknown = [k for k in kwargs if k not in sig.parameters]
        if unknown:
            raise TargetError(f"{who} returned keyword inputs {unknown} that {where} has no parameter for. Fix: "
                              f"key them by its parameter names ({', '.join(sig.parameters) or 'none'}).")
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TargetError(f"{who} returned example inputs that {where} does not accept: {e}. Fix: pass "
                          "forward()'s arguments by position in args or by name in kwargs.") from e


def _split_spec(spec: str) -> Tuple[str, str]:
    """``path/to/file.py:factory`` -> (absolute path of an existing file, factory name)."""
    if not isinstance(spec, str) or ":" not in spec:
        raise TargetError(f"TARGET must have the form {TARGET_FORM} (e.g. {TARGET_EXAMPLE}), got {spec!r}. "
                          f"Fix: add ':' and the name of a function returning {RETURN_FORMS}.")
    path, name = spec.rsplit(":", 1)
    if not path or not name.isidentifier():
        raise TargetError(f"TARGET must have the form {TARGET_FORM} (e.g. {TARGET_EXAMPLE}), got {spec!r}: "
                          f"{'the file part is empty' if not path else f'{name!r} is not a function name'}.")
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise TargetError(f"TARGET file {path} does not exist. Fix: give the path of a .py file "
                          f"(relative to {os.getcwd()} or absolute), e.g. {TARGET_EXAMPLE}.")
    return path, name


def _find_factory(path: str, name: str) -> Callable:
    """The callable ``name`` of the file at ``path`` (imported), or a TargetError listing what is there."""
    module = _import_file(path)
    factory = getattr(module, name, None)
    if not callable(factory):
        found = sorted(n for n, v in vars(module).items()
                       if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__)
        raise TargetError(f"{os.path.relpath(path)} has no function {name!r}. "
                          f"Callables defined there: {', '.join(found) or '(none)'}.")
    return factory


def _package_name(path: str) -> Optional[Tuple[str, str]]:
    """``(root's parent folder, dotted module name)`` when the file at ``path`` lies in a package
    (its folder has an ``__init__.py``), so it is imported as ``python -m`` would: relative and
    package imports inside it work. None for a plain file."""
    folder, parts = os.path.dirname(os.path.abspath(path)), [os.path.splitext(os.path.basename(path))[0]]
    if not os.path.isfile(os.path.join(folder, "__init__.py")):
        return None
    while os.path.isfile(os.path.join(folder, "__init__.py")):
        folder, pkg = os.path.split(folder)
        parts.insert(0, pkg)
    names = parts if parts[-1] != "__init__" else parts[:-1]
    return (folder, ".".join(names)) if all(n.isidentifier() for n in names) else None


def _import_file(path: str) -> Any:
    """The module of the file at ``path``: as a module of its package when it lies in one, else
    imported under a name unique to that path."""
    package = _package_name(path)
    if package is not None:
        root, dotted = package
        sys.path.insert(0, root)
        try:
            return importlib.import_module(dotted)
        except Exception as e:
            raise TargetError(f"importing {path} (as {dotted}) raised {type(e).__name__}: {e}. Fix the file.") from e
        finally:
            sys.path.remove(root)
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
    """Whether ``fn`` takes a keyword argument ``name`` (True when its signature cannot be read)."""
    try:
        params = _inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in params)
