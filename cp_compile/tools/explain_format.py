"""Rendering of a :class:`cp_compile.tools.explain.Report`: the ``explain`` summary,
the ``dump`` text listing, Graphviz DOT and a self-contained HTML page."""

from __future__ import annotations

import dataclasses
from typing import Any, List

import torch
import torch.fx as fx

from .explain import NodeRow, Report, RingSite, format_shape, short_source
from ..passes.context import source_line

# ---------------------------------------------------------------------------------- text output
def human(n: int) -> str:
    """``1,024 B (1.0 KiB)``: bytes with a binary unit once they reach one."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n:,} B ({n / size:.1f} {unit})"
    return f"{n:,} B"


def describe_mask(site: RingSite) -> str:
    """What a ring op masks by position (causal flag, window), by document ids and mods (the words of
    its :class:`cp_compile.ring.call_spec.RingCall`), and the explicit attn_mask it is given, with that
    tensor's per-rank shape, dtype and bytes."""
    call, m = site.call, site.tensors.attn_mask
    by_ids = [w for w in call.mask_words if w == "documents" or w.startswith(("mask_mod", "score_mod", "mods"))]
    window = call.mask.window
    position = ("causal" + (f", window {window}" if window > 0 else "") + " by position") if call.causal else ""
    if by_ids:
        position = ", ".join(x for x in [position] + ["documents by their ids" if w == "documents" else w
                                                       for w in by_ids] if x)
    if m is None or not m.node:
        return f"{position} (no mask tensor)" if position else "none (full attention, no mask tensor)"
    rows = "this rank's query rows over all keys, O(S^2 / N)" if m.per_query else "one row for every query, O(B·S)"
    shared = f"; the same tensor as {site.shared_with}'s" if site.shared_with else ""
    explicit = f"explicit attn_mask {m.shape} {m.dtype} per rank, {human(m.bytes)}: {rows}{shared}"
    return f"{position}, and {explicit}" if position else explicit


def _layout(load_balance: str) -> str:
    """The layout's name as explain prints it (``documents`` is computed per batch, in the graph)."""
    return "documents (table per batch)" if load_balance == "documents" else load_balance


def _symbolic(gm: fx.GraphModule) -> bool:
    """Whether Dynamo traced ``gm`` with symbolic sizes (an input that is a SymInt)."""
    return any(isinstance(n.meta.get("example_value"), torch.SymInt) for n in gm.graph.find_nodes(op="placeholder"))


def options_line(options: Any) -> str:
    """``options: rotate=p2p kernel=auto ...``: every rewrite option as the rewrite was given it (the load
    balance is on the line above), ``seq_inputs`` a dict as ``name=dim,...``."""
    words = []
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if f.name == "load_balance":
            continue
        if isinstance(value, dict):
            value = ",".join(f"{k}={v}" for k, v in value.items())
        words.append(f"{f.name}={value}")
    return "  options: " + " ".join(words)


def _attention_lines(r: Report) -> List[str]:
    """Per attention: its source line, what its ring op masks, and the strategy it runs by (the record's
    words: the runtime's too)."""
    record = r.ctx.record
    forms, strategies = (record.masks, record.strategies) if record is not None else ([], [])
    w = max(len(n) for n, _ in r.attention)
    lines: List[str] = []
    for i, ((n, s), site) in enumerate(zip(r.attention, r.rings)):  # what each ring op is given (rewritten graph)
        lines += [f"  {n:<{w}}  {short_source(s)}", f"  {'':<{w}}  mask: {describe_mask(site)}"]
        if i < len(forms) and forms[i]:
            lines.append(f"  {'':<{w}}  mask form: {forms[i]}")
        if i < len(strategies):
            lines.append(f"  {'':<{w}}  strategy: {strategies[i]}")
        lines.append(f"  {'':<{w}}  ring op: kernel {site.call.kernel}, rotate {site.call.rotate}")
    return lines


def _recurrence_lines(r: Report) -> List[str]:
    """Per registered recurrent kernel call: how it runs (the record's words: the runtime's too)."""
    record = r.ctx.record
    done = record.recurrences if record is not None else []
    if not r.ctx.recurrences:
        return []
    lines = [f"recurrences: {len(r.ctx.recurrences)} registered kernel call(s), {len(done)} state-passed "
             "(each rank runs its own runs of tokens from the state entering them)"]
    lines += [f"  {d}" for d in done]
    missing = len(r.ctx.recurrences) - len(done)
    if missing > 0:
        lines.append(f"  {missing} call(s) run on the gathered sequence instead (see fallbacks)")
    return lines


def format_explain(r: Report, target: str = "") -> str:
    """The ``explain`` summary: attention (each with the mask its ring op applies), sharded inputs,
    fallbacks, collectives per step and the activation-memory estimate."""
    ctx = r.ctx
    head = f"cp-compile explain {target}".rstrip()
    lines = [head, f"  CP group of {r.world_size} ranks (synthetic, rank {ctx.group.rank} shown), "
                   f"load balance {_layout(r.load_balance)}", options_line(ctx.options)]
    if not r.attention and not ctx.recurrences:
        lines.append("attention: none found. The ring_cp backend compiles this graph unchanged "
                     "(nothing is split by sequence).")
        lines += [f"  WARNING: attention that ring_cp cannot split, at {u}" for u in ctx.unsplit]
        return "\n".join(lines)
    lines.append(f"  sequence length S = {ctx.seq_len}; {ctx.local_len} positions per rank"
                 + (f" (padded to {ctx.padded_len})" if ctx.padded_len != ctx.seq_len else "")
                 + ("; symbolic in the graph (dynamic shapes)" if _symbolic(r.before) else ""))
    if r.attention:
        lines.append(f"attention: {len(r.attention)} node(s), each becomes ring attention")
        lines += _attention_lines(r)
    lines += _recurrence_lines(r)
    lines += [f"  WARNING: attention that ring_cp cannot split (run on the gathered sequence), at {u}"
              for u in ctx.unsplit]
    lines.append("sharded inputs: " + (", ".join(f"{k} (dim {d})" for k, d in r.shard_inputs.items()) or
                                       "none (every input stays whole; values are indexed by position)"))
    for name, dim in ctx.shard_nodes.items():  # passes/seq_origins.py
        node = next((n for n in r.before.graph.nodes if n.name == name), None)
        where = short_source(source_line(node)) if node is not None else "?"
        lines.append(f"  the sequence arises at {name} ({where}): sharded there, dim {dim}")
    if r.fallbacks:
        lines.append(f"fallbacks: {len(r.fallbacks)} op(s) run on the gathered full sequence "
                     "(exact, but every rank holds the whole value: not memory-scalable)")
        for f in r.fallbacks:
            lines.append(f"  {f.node} at {short_source(f.source)}")
            lines.append(f"      gathers {human(f.gathered_bytes)} per rank")
    else:
        lines.append("fallbacks: none (no op gathers the full sequence)")
    lines.append("collectives per training step (one forward + backward), per rank, payload bytes:")
    w = max(len(c.what) for c in r.collectives) if r.collectives else 0
    for phase in ("forward", "backward"):
        cs = [c for c in r.collectives if c.phase == phase]
        tot = sum(c.bytes for c in cs)
        lines.append(f"  {phase}: {sum(c.count for c in cs)} collective(s), {human(tot)}")
        for c in cs:
            lines.append(f"    {c.what:<{w}}  x{c.count:<4} {human(c.bytes)}" + (f"  [{c.detail}]" if c.detail else ""))
    total = sum(c.bytes for c in r.collectives)
    lines.append(f"  total: {human(total)} (a ring all-reduce moves about 2(N-1)/N x its payload per rank)")
    ratio = r.act_bytes_local / r.act_bytes_global if r.act_bytes_global else float("nan")
    lines.append(f"activation memory, per rank vs single device: {human(r.act_bytes_local)} vs "
                 f"{human(r.act_bytes_global)} ({ratio:.2f}x)")
    lines.append("  crude upper bound: the sum of every intermediate tensor of the graph as if all were live at "
                 "once (views hold no bytes, no reuse, backward buffers not included)")
    if ctx.record is not None:  # the record RingCP.records holds for this graph at runtime (cp_compile.backend.record)
        lines.append(f"record: {ctx.record.summary()}")
        lines.extend(f"  region: {region}" for region in ctx.record.regions)  # passes/regions.py
    return "\n".join(lines)


def format_rows(rows: List[NodeRow], after: bool) -> List[str]:
    """One aligned text line per row: mark, name, kind, target, shape(s), source line."""
    cols = []
    for r in rows:
        shape = (f"{format_shape(r.global_shape)} -> {format_shape(r.local_shape)}" if after
                 else format_shape(r.global_shape))
        cols.append(("*" if r.marked else " ", r.name, r.kind or "-", r.target, shape, short_source(r.source)))
    caps = (1, 32, 22, 28, 40)  # longer entries overflow their column rather than widen it for every row
    widths = [min(max((len(c[i]) for c in cols), default=0), cap) for i, cap in enumerate(caps)]
    return [f"{c[0]} {c[1]:<{widths[1]}}  {c[2]:<{widths[2]}}  {c[3]:<{widths[3]}}  {c[4]:<{widths[4]}}  "
            f"{c[5]}".rstrip() for c in cols]


def format_dump_text(r: Report, target: str = "") -> str:
    """The ``dump`` text listing: the Dynamo graph, then the rewritten one (global -> local shapes)."""
    title = f"# cp-compile dump {target}: world size {r.world_size}, load balance {_layout(r.load_balance)}"
    lines = [title.replace("  ", " "),
             "# columns: name  kind  target  shape  source line;  * = inserted or rewritten by ring_cp",
             "", f"== before: the Dynamo graph ({len(r.before_rows)} nodes), global shapes"]
    lines += format_rows(r.before_rows, after=False)
    lines.append("")
    if r.rewritten:
        lines.append(f"== after: rewritten for {r.world_size} ranks ({len(r.after_rows)} nodes), "
                     f"global shape -> local shape (rank {r.ctx.group.rank})")
        lines += format_rows(r.after_rows, after=True)
    else:
        lines.append("== after: unchanged (no attention in the graph)")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------- dot / html
def _dot_escape(s: str) -> str:
    """``s`` inside a double-quoted Graphviz string."""
    return s.replace("\\", "\\\\").replace('"', '\\"')


def format_dot(gm: fx.GraphModule, rows: List[NodeRow], title: str, after: bool) -> str:
    """``gm`` as a Graphviz digraph, nodes inserted or rewritten by ring_cp filled by kind."""
    by_name = {r.name: r for r in rows}
    out = [f'digraph "{_dot_escape(title)}" {{', "  rankdir=TB;",
           '  node [shape=box, fontname="monospace", fontsize=9];', f'  label="{_dot_escape(title)}"; labelloc=t;']
    colors = {"ring_attention": "#ffb3b3", "shard": "#b3d9ff", "gather": "#ff8080", "grad_all_reduce": "#d9b3ff",
              "grad_all_reduce_bucket": "#d9b3ff", "all_reduce_sum": "#ffd9b3", "grad_scale": "#e6e6e6"}
    for n in gm.graph.nodes:
        r = by_name.get(n.name)
        if r is None:
            continue
        shape = (f"{format_shape(r.global_shape)} -> {format_shape(r.local_shape)}" if after
                 else format_shape(r.global_shape))
        label = "\\n".join(_dot_escape(x) for x in (("* " if r.marked else "") + r.name, r.kind or r.op, r.target,
                                                     shape) if x)
        style = ""
        if r.marked:
            style = f', style=filled, fillcolor="{colors.get(r.kind, "#ffffb3")}"'
        tip = _dot_escape(short_source(r.source))
        out.append(f'  "{_dot_escape(n.name)}" [label="{label}", tooltip="{tip}"{style}];')
        for a in n.all_input_nodes:
            out.append(f'  "{_dot_escape(a.name)}" -> "{_dot_escape(n.name)}";')
    out.append("}")
    return "\n".join(out) + "\n"


_CSS = """
body { font-family: sans-serif; margin: 1.5em; }
table { border-collapse: collapse; margin-bottom: 2em; font-size: 12px; }
th, td { border: 1px solid #ccc; padding: 2px 6px; text-align: left; font-family: monospace; white-space: nowrap; }
th { background: #eee; position: sticky; top: 0; }
tr.marked td { background: #fff4b3; }
tr.k-ring_attention td { background: #ffc9c9; }
tr.k-gather td { background: #ff9f9f; }
tr.k-shard td { background: #cfe6ff; }
tr.k-grad_all_reduce td, tr.k-grad_all_reduce_bucket td { background: #ead6ff; }
tr.k-all_reduce_sum td { background: #ffe3c4; }
pre { background: #f6f6f6; padding: 1em; }
"""


def format_html(r: Report, target: str = "") -> str:
    """One self-contained HTML page: the explain summary and both graphs as tables."""
    import html as H

    def table(rows: List[NodeRow], title: str, after: bool) -> str:
        head = ["", "name", "kind", "target", "global shape"] + (["local shape"] if after else []) + ["source"]
        out = [f"<h2>{H.escape(title)}</h2>", "<table>",
               "<tr>" + "".join(f"<th>{H.escape(h)}</th>" for h in head) + "</tr>"]
        for x in rows:
            cls = " ".join(c for c in ("marked" if x.marked else "", f"k-{x.kind}" if x.kind else "") if c)
            cells = ["*" if x.marked else "", x.name, x.kind, x.target, format_shape(x.global_shape)]
            if after:
                cells.append(format_shape(x.local_shape))
            cells.append(short_source(x.source))
            out.append(f'<tr class="{cls}">' + "".join(f"<td>{H.escape(c)}</td>" for c in cells) + "</tr>")
        out.append("</table>")
        return "\n".join(out)

    parts = ["<!DOCTYPE html>", '<html><head><meta charset="utf-8">',
             f"<title>cp-compile dump {H.escape(target)}</title>", f"<style>{_CSS}</style></head><body>",
             f"<h1>cp-compile dump {H.escape(target)}</h1>",
             "<p>Rows marked * (highlighted) were inserted or rewritten by ring_cp.</p>",
             f"<pre>{H.escape(format_explain(r, target))}</pre>",
             table(r.before_rows, f"before: the Dynamo graph ({len(r.before_rows)} nodes)", after=False)]
    if r.rewritten:
        parts.append(table(r.after_rows, f"after: rewritten for {r.world_size} ranks ({len(r.after_rows)} nodes)",
                           after=True))
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


_COMM = ("_c10d_functional", "ring_attention")


def format_aot_text(r: Report, stages: List[str]) -> str:
    """The AOTAutograd forward/backward graphs, one node per line, collectives and the ring op marked *."""
    out: List[str] = []
    for stage in stages:
        gm = r.aot_forward if stage == "forward" else r.aot_backward
        if gm is None:
            out.append(f"== {stage}: none (the graph was not rewritten, or nothing needs a gradient)")
            continue
        nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
        marked = sum(any(c in str(n.target) for c in _COMM) for n in nodes)
        out.append(f"== {stage} graph (AOTAutograd, per rank): {len(nodes)} nodes, {marked} communication/ring (*)")
        for n in nodes:
            val = n.meta.get("val")
            shape = format_shape(tuple(val.shape)) if hasattr(val, "shape") else ""
            mark = "*" if any(c in str(n.target) for c in _COMM) else " "
            out.append(f"{mark} {n.name:<28} {str(n.target):<52} {shape}")
    return "\n".join(out) + "\n"
