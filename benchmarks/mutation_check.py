"""Which tests of the fast tier catch each rule switched off (issue 37: every check can fail).

    .venv/bin/python benchmarks/mutation_check.py            # the fast tier once plain, once per mutation
    .venv/bin/python benchmarks/mutation_check.py --only loss

For each mutation of ``tests/mutations.py`` (attention not made the ring, losses not made global,
parameter gradients not summed over the CP group, no input sharded) the fast tier
(``-m "not slow and not inductor"``) runs with ``CP_COMPILE_TEST_MUTATION`` set, so the test process
and every rank worker run with that rule switched off; the tests that fail (or error) are the ones
that caught it. The plain run first must pass. Writes ``benchmarks/results/mutation_check.json`` and
prints one row per mutation: how many tests caught it, and the first few. Goal: each caught by 3 or
more. About 3 to 4 minutes per run on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from typing import Dict, List

import common

sys.path.insert(0, os.path.join(common.ROOT, "tests"))
from mutations import MUTATIONS  # noqa: E402

FAILED = re.compile(r"^(?:FAILED|ERROR) (tests/.+?)(?: - .*)?$", re.M)  # (test ids may hold spaces)


def run(mutation: str, timeout: float) -> Dict[str, object]:
    """One fast-tier run with ``mutation`` ("" for none): the failing test ids and the summary line."""
    env = {**os.environ, "CP_COMPILE_TEST_MUTATION": mutation}
    cmd = [sys.executable, "-m", "pytest", "tests", "-m", "not slow and not inductor", "-q", "-rfE",
           "--timeout", "120", "-p", "no:cacheprovider"]
    started = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=common.ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        out = done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        out += f"\n(the run took over {timeout:.0f} s and was stopped)"
    caught = sorted(set(FAILED.findall(out)))
    summary = next((line for line in reversed(out.splitlines()) if " in " in line and ("passed" in line or
                                                                                       "failed" in line)), "")
    failed = sum(int(n) for n in re.findall(r"(\d+) (?:failed|error)", summary))
    return {"mutation": mutation or "none", "caught": caught, "failed": failed, "summary": summary.strip("= "),
            "minutes": round((time.perf_counter() - started) / 60, 1)}


def main(argv: List[str] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=MUTATIONS, help="one mutation (default: every one)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one run may take (default 1800)")
    args = p.parse_args(argv)
    started = time.perf_counter()
    rows = [run("", args.timeout)]
    if rows[0]["caught"]:
        print(f"the plain run fails ({len(rows[0]['caught'])} tests): fix those first", file=sys.stderr)
    for m in [args.only] if args.only else MUTATIONS:
        rows.append(run(m, args.timeout))
        r = rows[-1]
        print(f"{r['mutation']:<14} caught by {len(r['caught']):>4} tests  ({r['minutes']} min)  "
              f"e.g. {', '.join(r['caught'][:3])}", flush=True)
    common.write_result("mutation_check", {"rows": rows}, started, args)
    return 0 if not rows[0]["caught"] and all(len(r["caught"]) >= 3 for r in rows[1:]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
