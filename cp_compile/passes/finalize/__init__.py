"""The finishing passes: the rewritten graph completed for the hand-off.

The backend's timeout on every ring op (:mod:`.ring_timeout`), per-rank fake values
(:mod:`.repropagate`); for graphs without attention, each parameter gradient's CP share
(:mod:`.grad_share`); at the hand-off, selective-AC regions put back (:mod:`.region_outline`).
The order is :data:`cp_compile.passes.pipeline.PASSES`.
"""
