"""The house rules of the source tree, checked rather than hoped for.

* no module of ``cp_compile`` imports, directly or through others, a module that imports it
  back (function-level imports count; ``if TYPE_CHECKING:`` imports never run, so they do not);
* no function of the package is over 60 lines of code (its docstring aside); size and
  complexity otherwise are ruff's (``./dev lint``: McCabe complexity, branches, statements);
* no citation of a design document outside the repository (the design is docs/design.md);
* no test module imports another test module: what two test files share lives in tests/checks.py
  (or tests/distributed.py, tests/compose_kit.py);
* every test-tier marker is declared in pyproject.toml (``--strict-markers`` makes an undeclared
  one an error) and used: the tiers are marks on the tests themselves.
"""

from __future__ import annotations

import ast
import os
import re
from typing import Dict, Iterator, Set

import networkx as nx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_FUNCTION_LINES = 60


def _python_files(*tops: str) -> Iterator[str]:
    for top in tops:
        for d, _, files in os.walk(os.path.join(REPO, top)):
            yield from (os.path.join(d, f) for f in files if f.endswith(".py"))


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _imports(path: str, module: str, known: Set[str]) -> Set[str]:
    """The cp_compile modules ``module`` imports (an ancestor package's own __init__ excluded)."""
    tree = ast.parse(open(path).read())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    out: Set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = ".".join(base[: len(base) - node.level + 1]) if node.level else ""
            full = ".".join(p for p in (base, node.module or "") if p)
            names = [full] + [f"{full}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out |= {n for n in names if n in known and n != module and not module.startswith(n + ".")}
    return out


def test_no_module_imports_in_a_cycle() -> None:
    paths: Dict[str, str] = {_module_name(p): p for p in _python_files("cp_compile")}
    graph = nx.DiGraph()
    for module, path in paths.items():
        graph.add_edges_from((module, dep) for dep in _imports(path, module, set(paths)))
    cycles = sorted(" -> ".join(c + [c[0]]) for c in nx.simple_cycles(graph))
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def _code_lines(fn: ast.AST) -> int:
    """Lines from a function's first statement after its docstring to its end."""
    body = fn.body
    doc = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    first = body[1] if doc and len(body) > 1 else body[0]
    return fn.end_lineno - first.lineno + 1


def test_no_function_is_over_60_lines() -> None:
    long = [f"{os.path.relpath(p, REPO)}:{fn.lineno} {fn.name} ({n} lines)" for p in _python_files("cp_compile")
            for fn in ast.walk(ast.parse(open(p).read()))
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and (n := _code_lines(fn)) > MAX_FUNCTION_LINES]
    assert not long, "functions to split along their logic:\n" + "\n".join(long)


def test_no_citation_points_outside_the_repository() -> None:
    pattern = re.compile(r"\bDESIGN(\.md)?\b")
    found = [f"{os.path.relpath(p, REPO)}:{i}" for p in _python_files("cp_compile", "tests", "examples", "benchmarks")
             if p != os.path.abspath(__file__) for i, line in enumerate(open(p), 1) if pattern.search(line)]
    assert not found, f"cite docs/design.md instead: {found}"


def test_no_test_module_imports_another() -> None:
    found = []
    for path in _python_files("tests"):
        for node in ast.walk(ast.parse(open(path).read(), path)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{os.path.basename(path)}:{node.lineno} imports {n}" for n in names if n.startswith("test_")]
    assert not found, f"move what the tests share into tests/checks.py: {found}"


def test_every_tier_marker_is_declared_strict_and_used() -> None:
    config = open(os.path.join(REPO, "pyproject.toml")).read()
    assert re.search(r'^addopts = ".*--strict-markers', config, re.M), "add --strict-markers to addopts"
    declared = set(re.findall(r'^    "(\w+): ', config.split("markers = [", 1)[1].split("]", 1)[0], re.M))
    assert declared == {"multirank", "slow", "inductor"}, declared
    used = {m for path in _python_files("tests") for m in re.findall(r"pytest\.mark\.(\w+)", open(path).read())}
    assert declared <= used, f"declared but never marked: {declared - used}"
