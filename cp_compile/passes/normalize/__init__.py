"""The normalizing passes: the graph put into the forms the analyses and rules read.

Each pass changes the graph and changes no numbers: activation-checkpointed and nested compile
regions inlined (:mod:`.regions`), ``nn.MultiheadAttention`` and its fast paths opened
(:mod:`.expand_mha`, :mod:`.expand_fastpath`), hand-written attention fused into SDPA
(:mod:`.fuse_attention`), mask views moved onto their terms (:mod:`.mask_views`), BlockMask
construction dropped (:mod:`.block_masks`), losses on slices made whole (:mod:`.loss_shift`),
patch convolutions opened (:mod:`.patch_conv`), document ids moved first
(:mod:`.documents_first`). The order is :data:`cp_compile.passes.pipeline.PASSES`, where a normalizing pass may follow
the analysis whose finding it acts on (BlockMasks are dropped once find_attention has read them).
"""
