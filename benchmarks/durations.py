"""The suite's slowest tests, from one run's JUnit XML, written into docs/examples.md with their tier.

    ./dev test --junitxml=/tmp/suite.xml          # a full run (any order)
    .venv/bin/python benchmarks/durations.py /tmp/suite.xml [--top 40] [--docs docs/examples.md]

The table (between the markers ``<!-- durations: begin -->`` and ``<!-- durations: end -->``) lists
each test's call time and its tier now (``fast``: run by ``./dev test --fast``; ``slow``: marked
``slow`` or ``inductor``), read from pytest's own collection with the ``--fast`` marker expression.
``tests/test_harness.py`` reads it back: a test of 2 s or more in it must not be in the fast tier,
except the smoke tests that test names, so the ``slow`` mark follows the record.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from typing import List, Set, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- durations: begin -->", "<!-- durations: end -->"
FAST = "not slow and not inductor"  # ./dev test --fast


def slowest(junit: str, top: int) -> List[Tuple[float, str]]:
    """(seconds, node id) of the ``top`` slowest test calls of a JUnit XML file, slowest first."""
    cases = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/") + ".py"
        cases.append((float(case.get("time", 0.0)), f"{path}::{case.get('name')}"))
    return sorted(cases, reverse=True)[:top]


def fast_ids(paths: Set[str]) -> Set[str]:
    """The node ids of ``paths`` that ``./dev test --fast`` selects (pytest's collection, file order)."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", FAST, "--random-order-bucket=none",
           *sorted(paths)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False).stdout
    return {line.strip() for line in out.splitlines() if "::" in line}


def table(rows: List[Tuple[float, str]], fast: Set[str], command: str, note: str) -> str:
    """The markdown section between the markers."""
    lines = [BEGIN, f"The {len(rows)} slowest test calls of `{command}` on {datetime.date.today()}"
             + (f" ({note})" if note else "") + "; written by `benchmarks/durations.py`; tier `fast`: run by "
             "`./dev test --fast` (the tiers as marked now):", "",
             "| seconds | tier | test |", "|---:|---|---|"]
    lines += [f"| {s:.1f} | {'fast' if t in fast else 'slow'} | `{t}` |" for s, t in rows]
    return "\n".join(lines + [END])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("junit", help="the JUnit XML of a full run (./dev test --junitxml=F)")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--docs", default=os.path.join(ROOT, "docs", "examples.md"))
    p.add_argument("--command", default="./dev test --junitxml=F", help="the command that produced the run")
    p.add_argument("--note", default="", help="what else the record should say of the run (machine, time, seed)")
    args = p.parse_args()
    rows = slowest(args.junit, args.top)
    section = table(rows, fast_ids({t.split("::")[0] for _, t in rows}), args.command, args.note)
    with open(args.docs) as f:
        text = f.read()
    if BEGIN in text:
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: section, text, flags=re.S)
    else:
        text = text.replace("\n## Benchmarks", "\n" + section + "\n\n## Benchmarks", 1)
    with open(args.docs, "w") as f:
        f.write(text)
    print(f"wrote the {len(rows)} slowest tests into {os.path.relpath(args.docs, ROOT)}")


if __name__ == "__main__":
    main()
