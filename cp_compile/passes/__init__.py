"""FX graph passes of the ``ring_cp`` backend, run in this order by ``backend.RingCP``:

0. :mod:`.nested` — refuses nested (jagged) tensors, which Dynamo cannot trace
   attention on (it would run unsplit, outside the graph);
1. :mod:`.find_attention` — the attention nodes and the sequence length S; a mask is
   split into what the ring op does by position (causal, full, a sliding window) and
   explicit terms (:mod:`.masks`, :mod:`.mask_index`), whose rows the attention rule
   builds per rank (:mod:`.mask_rows`);
2. :mod:`.seq_inputs` — which graph inputs carry the sequence, and along which dim;
3. :mod:`.rewrite` — sequence-layout propagation (rules in :mod:`.rules` and
   :mod:`.rules_attention`, indices in :mod:`.seqindex`) emitting the per-rank graph;
4. :mod:`.repropagate` — per-rank fake values on the rewritten graph.

A graph without attention skips 1-4; under ``grad_sync="none"`` :mod:`.grad_share`
scales its parameter gradients to this rank's 1/N share.

The layouts are defined in :mod:`.layouts`; what the passes share is in :mod:`.context`.
"""
