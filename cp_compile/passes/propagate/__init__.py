"""The rewrite proper: placement propagation, emitting the per-rank graph in one walk.

:mod:`.rewrite` walks the graph and :mod:`.emitter` builds the new one; every value gets a
placement (:mod:`.placements`: Global, Sharded, Local) from the rule registered for its op
(:mod:`.rules`), or from the rule oracle (:mod:`.oracle`) for an op with no rule, or a logged
gather. Sequence indices as graph values: :mod:`.seqindex`; rows selected upstream of an origin:
:mod:`.row_select`; the documents layout's table: :mod:`.doc_table`.
"""
