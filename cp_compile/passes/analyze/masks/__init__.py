"""Attention masks built in the graph: what the ring op does by position, and the rest.

* :mod:`.classify` — splits a mask into terms and classifies them (causal, window, full, or
  explicit) on abstract values; :mod:`.index` follows the indexing ops HF masks use;
  :mod:`.buffers` evaluates terms read from constant buffers (nanoGPT's ``tril`` buffer);
* :mod:`.docs` — document terms ``X[b, q] == X[b, kv]`` (packed batches) -> the ring op's
  ``doc_ids`` (the whole X, no mask tensor);
* :mod:`.lift` — terms that are elementwise functions of positions (ALiBi biases, prefix-LM masks)
  -> the ring op's ``mask_mod`` / ``score_mod`` with O(S) leaves;
* :mod:`.rows` — this rank's query rows of the explicit terms, for the ring op's ``attn_mask``.
"""

from .classify import classify_mask

__all__ = ["classify_mask"]
