"""Refuse nested (jagged) tensors in a graph that ring_cp would split.

Before: a Dynamo graph whose inputs or values include a ``torch.nested`` tensor, e.g.
the projections of a jagged batch ``x`` (B, j, D) into q/k/v. Dynamo cannot run
``scaled_dot_product_attention`` on jagged fake tensors, so it breaks the graph there
and runs the attention eagerly: ring_cp never sees it, and every rank would attend over
the whole, unsplit batch (correct numbers, no memory saving, no warning).

After: :class:`~cp_compile.passes.context.CPRewriteError` naming the value, the model
line that first uses it, and the fix (a dense, padded batch with a key-padding mask,
which ring_cp runs exactly). A CP group of size 1 never gets here: it compiles
graphs unchanged.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from ..context import CPRewriteError, fake_value, source_line
from ..analyze.graph_inputs import user_name


def _is_nested(node: fx.Node) -> bool:
    val = fake_value(node)
    return isinstance(val, torch.Tensor) and val.is_nested


def _first_nested(gm: fx.GraphModule) -> Optional[fx.Node]:
    return next((n for n in gm.graph.nodes if n.op != "output" and _is_nested(n)), None)


def refuse_nested_tensors(gm: fx.GraphModule) -> None:
    """Raise if any value of ``gm`` is a nested tensor (see the module docstring)."""
    node = _first_nested(gm)
    if node is None:
        return
    what = f"the input {user_name(node)!r}" if node.op == "placeholder" else f"the value {node.name!r}"
    users = [u for u in node.users if u.op != "output"]
    where = source_line(users[0] if node.op == "placeholder" and users else node)
    raise CPRewriteError(
        f"cp_compile: {what} is a nested (jagged) tensor, used at {where}. ring_cp splits dense "
        "(B, S, ...) sequences across the CP ranks; Dynamo cannot trace scaled_dot_product_attention "
        "on jagged tensors, so the attention would run eagerly on the whole, unsplit batch on every "
        "rank (no memory saving). Fix: pad the batch to a dense (B, S) tensor and pass the padding as "
        "an attention mask (a (B, 1, 1, S) boolean key mask, or a Hugging Face attention_mask), which "
        "ring_cp runs exactly; or compile this model without ring_cp."
    )
