"""FX graph passes of the ``ring_cp`` backend.

The passes and their order are :data:`cp_compile.passes.pipeline.PASSES` (each a name, a phase
and an entry ``fn(gm, ctx)``), run by :func:`cp_compile.passes.pipeline.run_pipeline` for
:func:`cp_compile.backend.compiler.rewrite_for_cp` (the backend and ``cp-compile explain``);
``docs/design.md`` section 5 describes each in one line. The packages hold them by phase:
:mod:`.normalize` (the graph rewritten into forms the analyses read), :mod:`.analyze` (findings
recorded in the context), :mod:`.propagate` (the per-rank graph emitted, rules in
:mod:`.propagate.rules`), :mod:`.finalize` (the rewritten graph completed).

What the passes share: :mod:`.context` (the CP group, the frozen options, the analyses' findings),
:mod:`.node_facts` (per-node results), :mod:`.fx_utils` (generic FX helpers); the layouts are
defined in :mod:`.propagate.placements`. ``CP_COMPILE_DUMP=DIR`` writes the graph after every
pass (:mod:`.dump`).
"""
