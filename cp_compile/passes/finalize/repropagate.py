"""Give the rewritten graph's nodes their per-rank fake values.

Before: new nodes carry Dynamo's ``example_value`` of the node they were copied
from, i.e. *global* shapes. After: ``meta["val"]`` and ``meta["example_value"]``
hold the local (per-rank) fake value and ``facts(node).global_val`` the global one,
so tools (logging, the CLI) can show both. Propagation runs under the placeholders'
own fake mode with the Python dispatcher enabled (another fake mode would fail
with "Mixing fake modes"); constant index buffers are fakeified on the way.
"""

from __future__ import annotations

from typing import Any, List

import torch
import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from ..context import log
from ..node_facts import set_facts


class _Prop(FakeTensorProp):
    def run_node(self, n: fx.Node) -> Any:
        if n.op == "get_attr":
            value = super().run_node(n)
            # A constant buffer has one fixed size: static, as AOTAutograd fakeifies buffers (a
            # symbolic size would mint new symbols and sympy reasoning, ~0.5 s per graph).
            return self._mode.from_tensor(value, static_shapes=True) if isinstance(value, torch.Tensor) else value
        return super().run_node(n)


def repropagate(gm: fx.GraphModule, fake_inputs: List[Any]) -> fx.GraphModule:
    """Fill per-rank fake values; on failure keep the graph and log why (metadata only)."""
    modes = {id(x.fake_mode): x.fake_mode for x in fake_inputs if hasattr(x, "fake_mode")}
    if len(modes) != 1:
        return gm
    (mode,) = modes.values()
    for n in gm.graph.nodes:
        if "example_value" in n.meta:
            set_facts(n, global_val=n.meta.pop("example_value"))
    try:
        prop = _Prop(gm, mode)
        with enable_python_dispatcher():
            prop.propagate_dont_convert_inputs(*fake_inputs)
    except Exception as e:  # metadata only: the compiled result does not depend on it
        log.warning("cp_compile: could not re-propagate per-rank shapes (%s: %s)", type(e).__name__, e)
        return gm
    for n in gm.graph.nodes:
        if "val" in n.meta:
            n.meta["example_value"] = n.meta["val"]
    return gm
