"""``cp-compile dump`` and ``cp-compile explain``: what the ring_cp backend does to a model's graph.

Both run in one process with no process group. TARGET (``path/to/file.py:factory``) is
a function returning ``(model, args)``, ``(model, kwargs)`` or ``(model, args, kwargs)``
(:mod:`cp_compile.tools.targets`); the model is called as ``model(*args, **kwargs)``, traced by
Dynamo once and rewritten for a synthetic CP group of ``--world-size`` ranks (``--rank``, default 0
shown). The logic is in :mod:`cp_compile.tools.explain` (per-rank costs:
:mod:`cp_compile.backend.cost`). Exit codes: 0 ok; 2 bad TARGET or arguments; 1 the
model cannot be traced as one graph or rewritten (the message names the fix).

Register in ``cp_compile/tools/cli.py``::

    from .graph_commands import add_dump_parser, add_explain_parser, cmd_dump, cmd_explain
    add_dump_parser(sub); add_explain_parser(sub)          # in build_parser()
    COMMANDS = {"plan": cmd_plan, "dump": cmd_dump, "explain": cmd_explain}
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from typing import Any, Dict, Union

from ..options import LOAD_BALANCES, ROTATES, STRATEGIES, GradSync, Mode, literal_choices
from .targets import RETURN_HELP

TARGET_HELP = (f"path/to/file.py:factory, a function returning {RETURN_HELP}; the model is called as "
               "model(*args, **kwargs)")
FACTORY_EPILOG = """The factory (TARGET) returns the model and its example inputs, as torch.export takes them:
  return model, (input_ids, labels)                     # model(input_ids, labels)
  return model, {"input_ids": ids, "labels": ids, "use_cache": False}   # keywords, as HF models are called
  return model, (input_ids,), {"labels": labels}        # model(input_ids, labels=labels)
args may also be a single tensor: return model, input_ids."""

DUMP_EXAMPLES = f"""examples:
  cp-compile dump examples/models.py:llama_factory
  cp-compile dump examples/models.py:llama_factory --world-size 4 --seq-len 128 --load-balance striped
  cp-compile dump examples/models.py:llama_factory --format html --out /tmp/cp-dump
  cp-compile dump examples/models.py:llama_factory --format dot --out /tmp/cp-dump   # then: dot -Tsvg ...

{FACTORY_EPILOG}

Nodes marked * were inserted or rewritten by ring_cp; kinds: ring_attention, shard (indexed by
this rank's positions), gather (a fallback to the full sequence), grad_all_reduce(_bucket),
all_reduce_sum, grad_scale. Shapes of the rewritten graph read global -> local (rank --rank, default 0).
Exit codes: 0 ok, 2 bad TARGET or arguments, 1 the model cannot be traced or rewritten.
"""

EXPLAIN_EXAMPLES = f"""examples:
  cp-compile explain examples/models.py:llama_factory
  cp-compile explain examples/models.py:llama_factory --world-size 4 --seq-len 4096

{FACTORY_EPILOG}

Lists the attention nodes found, each with the mask its ring op is given (causal / window by
position, or an explicit attn_mask with its per-rank shape and bytes), the inputs split by
sequence, every fallback (an op run on the gathered full sequence) with its source line and
bytes, the collectives of one training step with bytes per rank, and a crude activation-memory
estimate. Everything per rank is read off the rewritten graph the ring_cp backend runs.
Exit codes: 0 ok, 2 bad TARGET or arguments, 1 the model cannot be traced or rewritten.
"""


def _int_at_least(flag: str, low: int, why: str = ""):
    """An argparse type: an integer >= ``low``, with a message naming the flag."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer >= {low}, got {text!r}")
        if n < low:
            raise argparse.ArgumentTypeError(f"{flag} must be >= {low}{why}, got {n}")
        return n
    return parse


_world_size = _int_at_least("--world-size", 2, " (a CP group of 1 is never rewritten)")
_seq_len = _int_at_least("--seq-len", 1)


def _seq_inputs(text: str) -> Union[str, Dict[str, int]]:
    """``--seq-inputs input_ids=1,labels=1`` -> {"input_ids": 1, "labels": 1} (BackendOptions.seq_inputs);
    ``auto`` stays "auto"."""
    if text == "auto":
        return text
    out: Dict[str, int] = {}
    for part in filter(None, text.split(",")):
        name, eq, dim = part.partition("=")
        try:
            if not eq or not name.strip():
                raise ValueError
            out[name.strip()] = int(dim)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--seq-inputs takes NAME=DIM[,NAME=DIM...], got {text!r}")
    return out


def _common(p: argparse.ArgumentParser) -> None:
    """The arguments dump and explain share: TARGET, the CP group and the ring_cp options that
    change the rewrite, so the record printed is the one the runtime keeps with the same options."""
    p.add_argument("target", metavar="TARGET", help=TARGET_HELP)
    p.add_argument("--world-size", type=_world_size, default=2, metavar="N", help="ranks in the CP group (default 2)")
    p.add_argument("--seq-len", type=_seq_len, default=None, metavar="S",
                   help="passed to the factory as seq_len=S (default: the factory's own)")
    p.add_argument("--load-balance", choices=LOAD_BALANCES, default="zigzag")
    p.add_argument("--rank", type=_int_at_least("--rank", 0), default=0, metavar="R",
                   help="whose graph to show (default 0); ranks differ where the sequence is assembled in the model")
    p.add_argument("--dynamic", action="store_true",
                   help="trace with a symbolic sequence length, as torch.compile(dynamic=True) (implied by "
                        "--inputs local)")
    opt = p.add_argument_group("ring_cp options (as in BackendOptions; defaults as there)")
    opt.add_argument("--seq-inputs", type=_seq_inputs, default="auto", metavar="NAME=DIM[,...]",
                     help="which forward() arguments carry the sequence, and along which dim, or auto (default)")
    opt.add_argument("--inputs", choices=literal_choices(Mode), default="full")
    opt.add_argument("--outputs", choices=literal_choices(Mode), default="full")
    opt.add_argument("--grad-sync", choices=literal_choices(GradSync), default="allreduce")
    opt.add_argument("--kernel", default="auto")
    opt.add_argument("--rotate", choices=ROTATES, default="p2p")
    opt.add_argument("--strict", action="store_true", help="refuse instead of warning where the rewrite would gather")
    opt.add_argument("--strategy", choices=STRATEGIES, default="ring",
                     help="how each attention is split: the ring, Ulysses, 2-D or chosen by cost (auto)")
    opt.add_argument("--ulysses-degree", type=_int_at_least("--ulysses-degree", 1), default=None, metavar="U",
                     help="the Ulysses degree of 2d / auto (a divisor of --world-size)")
    opt.add_argument("--hardware", default=None, metavar="HW",
                     help="the profile auto prices on (a cp-compile plan --hardware value)")


def add_dump_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``dump`` on ``subparsers`` (argparse's add_subparsers result)."""
    p = subparsers.add_parser("dump", help="the graph before and after the ring_cp rewrite",
                              description="Print or write the Dynamo graph of TARGET before and after the ring_cp "
                                          "rewrite, one node per line: name, kind, target, global -> local shape, "
                                          "source line.",
                              epilog=DUMP_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(p)
    p.set_defaults(cp_graph_command="dump")
    p.add_argument("--stage", choices=("graph", "forward", "backward", "all"), default="graph",
                   help="graph: the Dynamo graph the backend rewrites (before and after); forward / "
                        "backward: the per-rank graphs AOTAutograd makes of the rewritten one (collectives "
                        "and the ring op marked *; text only); all: every one of them")
    p.add_argument("--format", choices=("text", "dot", "svg", "html"), default="text",
                   help="text (stdout, or DIR/graph.txt with --out); dot: Graphviz DIR/before.dot and "
                        "DIR/after.dot; svg: the same rendered (needs the graphviz 'dot' program); "
                        "html: one self-contained DIR/graph.html")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="directory for the files written (default: ./cp-dump for dot/svg/html)")
    return p


def add_explain_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``explain`` on ``subparsers`` (argparse's add_subparsers result)."""
    p = subparsers.add_parser("explain", help="what ring_cp does to a model: attention, sharding, fallbacks, "
                                               "communication, memory",
                              description="A readable summary of the ring_cp rewrite of TARGET's graph.",
                              epilog=EXPLAIN_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(p)
    p.set_defaults(cp_graph_command="explain")
    return p


def _report(args: argparse.Namespace, aot: bool = False):
    """(report, None) or (None, exit code) with the message printed to stderr."""
    from .explain import ExplainError, explain_model
    from .targets import TargetError, load_target
    from ..passes.context import CPRewriteError

    try:
        model, example_args, example_kwargs = load_target(args.target, seq_len=args.seq_len)
    except TargetError as e:
        print(f"cp-compile {getattr(args, 'cp_graph_command', '')}: {e}", file=sys.stderr)
        return None, 2
    try:
        return explain_model(model, example_args, args.world_size, args.load_balance, aot=aot,
                       example_kwargs=example_kwargs, rank=args.rank, dynamic=args.dynamic,
                       seq_inputs=args.seq_inputs, inputs=args.inputs, outputs=args.outputs,
                       grad_sync=args.grad_sync, kernel=args.kernel, rotate=args.rotate, strict=args.strict,
                       strategy=args.strategy, ulysses_degree=args.ulysses_degree, hardware=args.hardware), 0
    except (CPRewriteError, ExplainError, ValueError) as e:
        print(f"cp-compile {getattr(args, 'cp_graph_command', '')}: {e}", file=sys.stderr)
        return None, 1


def cmd_dump(args: argparse.Namespace) -> int:
    """``cp-compile dump``; returns the exit code."""
    from .explain_format import format_dump_text

    if args.format == "svg" and shutil.which("dot") is None:
        print("cp-compile dump: --format svg needs the graphviz 'dot' program, which is not on PATH. "
              "Fix: install graphviz (e.g. apt-get install graphviz), or use --format dot (then render "
              "elsewhere) or --format html.", file=sys.stderr)
        return 2
    aot_stages = {"graph": [], "forward": ["forward"], "backward": ["backward"], "all": ["forward", "backward"]}
    stages = aot_stages[args.stage]
    if stages and args.format != "text":
        print(f"cp-compile dump: --stage {args.stage} is printed as text only. Fix: add --format text, or use "
              "--stage graph for dot/svg/html.", file=sys.stderr)
        return 2
    report, code = _report(args, aot=bool(stages))
    if report is None:
        return code
    if stages:
        from .explain_format import format_aot_text

        text = (format_dump_text(report, args.target) if args.stage == "all" else "") + format_aot_text(report, stages)
        if args.out is None:
            sys.stdout.write(text)
            return 0
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"{args.stage}.txt"), "w", encoding="utf-8") as f:
            f.write(text)
        return 0
    if args.format == "text" and args.out is None:
        sys.stdout.write(format_dump_text(report, args.target))
        return 0
    return _write_dump_files(args, report)


def _write_dump_files(args: argparse.Namespace, report: Any) -> int:
    """Write the dump as ``--format`` files under ``--out`` (default ``cp-dump``), listing them."""
    from .explain_format import format_dot, format_dump_text, format_html

    out = args.out or "cp-dump"
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        print(f"cp-compile dump: cannot create --out directory {out!r} ({e}). Fix: pass a writable DIR.",
              file=sys.stderr)
        return 2
    written = []

    def write(name: str, text: str) -> str:
        path = os.path.join(out, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        written.append(path)
        return path

    if args.format == "text":
        write("graph.txt", format_dump_text(report, args.target))
    elif args.format == "html":
        write("graph.html", format_html(report, args.target))
    else:
        graphs = [("before", report.before, report.before_rows, False)]
        if report.rewritten:
            graphs.append(("after", report.after, report.after_rows, True))
        for stem, gm, rows, after in graphs:
            dot = format_dot(gm, rows, f"{args.target} {stem} (N={report.world_size})", after)
            path = write(f"{stem}.dot", dot)
            if args.format == "svg":
                svg = os.path.join(out, f"{stem}.svg")
                res = subprocess.run(["dot", "-Tsvg", path, "-o", svg], capture_output=True, text=True)
                if res.returncode != 0:
                    print(f"cp-compile dump: dot failed on {path}: {res.stderr.strip()}", file=sys.stderr)
                    return 1
                written.append(svg)
    for path in written:
        print(f"wrote {path}")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    """``cp-compile explain``; returns the exit code."""
    from .explain_format import format_explain

    report, code = _report(args)
    if report is None:
        return code
    print(format_explain(report, args.target))
    return 0
