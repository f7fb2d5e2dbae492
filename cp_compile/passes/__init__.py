"""FX graph passes of the ``ring_cp`` backend, run in this order by
:func:`cp_compile.backend.compiler.rewrite_for_cp` (for the backend and for ``cp-compile explain``):

0. :mod:`.nested` — refuses nested (jagged) tensors, which Dynamo cannot trace
   attention on (it would run unsplit, outside the graph);
1. attention in other forms becomes ``scaled_dot_product_attention``:
   :mod:`.expand_mha` (``F.multi_head_attention_forward`` of ``nn.MultiheadAttention`` /
   ``nn.Transformer*``), :mod:`.expand_fastpath` (their eval-mode fused fast paths),
   :mod:`.fuse_attention` (``softmax(q @ kᵀ · scale + mask) @ v`` written by hand);
2. :mod:`.find_attention` — the attention nodes and the sequence length S; a mask is
   split into what the ring op does by position (causal, full, a sliding window; also
   read from constant buffers, :mod:`.masks.buffers`) and explicit terms (:mod:`.masks.classify`,
   :mod:`.masks.index`), whose rows the attention rule builds per rank (:mod:`.masks.rows`);
   FlexAttention nodes are parsed by :mod:`.find_flex` (mods and buffers; the BlockMask's
   construction, which the ring does not need, is erased).
   No attention: :mod:`.unsplit` warns about attention it cannot split, and the graph is
   compiled unchanged (under ``grad_sync="none"`` :mod:`.grad_share` scales its parameter
   gradients to this rank's 1/N share);
2b. :mod:`.loss_shift` — a class loss read through a slice of the sequence (a label shift
   inside the model, ``logits[:, :-1]`` against ``labels[:, 1:]``) becomes the same loss on
   the whole sequence with its targets padded by ``ignore_index``: no slice of sharded logits;
3. :mod:`.seq_inputs` — which graph inputs carry the sequence, and along which dim;
   :mod:`.seq_origins` — where none does, the nodes where the sequence arises (a patch
   convolution upstream opened first into patches + linear, :mod:`.patch_conv`);
4. :mod:`.rewrite` — sequence-layout propagation emitting the per-rank graph: rules in
   :mod:`.rules` (one table, rules by op class), the rule oracle for ops with no rule
   (:mod:`.oracle`, :mod:`.oracle_aten`), indices in :mod:`.seqindex`, rows selected
   upstream of an origin by :mod:`.row_select`; under ``load_balance="documents"``,
   :mod:`.doc_table` first moves the document ids' construction to the top, and this rank's
   positions are ``document_table(X, N)[rank]``, computed in the graph each call;
5. :mod:`.repropagate` — per-rank fake values on the rewritten graph; then
   :func:`cp_compile.backend.record.record_graph` records what the graph got.

The layouts are defined in :mod:`.propagate.placements`; what the passes share is in :mod:`.context`.
"""
