"""The analyses: findings recorded in the context, the graph left as it is.

The attention nodes and S (:mod:`.find_attention`, :mod:`.find_flex`), their masks
(:mod:`.masks`), attention that cannot be split (:mod:`.unsplit`), the graph inputs that carry
the sequence (:mod:`.seq_inputs`) or the nodes where it arises (:mod:`.seq_origins`). The order
is :data:`cp_compile.passes.pipeline.PASSES`.
"""
