"""The styles the generality work was measured on (examples/model_styles.py), as zoo members.

* ``llama3_complex_rope``: torchtitan-style Llama 3 with complex-number RoPE and grouped-query
  attention (K/V heads repeated by expand + reshape);
* ``einsum_gpt``: a GPT whose every projection is ``torch.einsum``, with learned positions.
"""

from __future__ import annotations

import model_styles

from . import BATCH, SEQ_LEN, Member


def llama3_factory(seq_len: int = SEQ_LEN, seed: int = 0):
    """torchtitan-style Llama 3, 4 query heads sharing 2 K/V heads (dim 32, MLP 96)."""
    return model_styles.llama3_complex_rope_factory(seq_len=seq_len, batch=BATCH, seed=seed, vocab=101, max_seq_len=128)


def einsum_factory(seq_len: int = SEQ_LEN, seed: int = 0):
    """GPT with einsum projections; position table longer than any zoo sequence."""
    return model_styles.einsum_gpt_factory(seq_len=seq_len, batch=BATCH, seed=seed, vocab=101, max_len=256)


MEMBERS = [
    Member("llama3_complex_rope", "torchtitan Llama 3: complex RoPE (polar table sliced [0:S]), GQA by expand+reshape",
           llama3_factory),
    Member("einsum_gpt", "GPT with every projection an einsum, learned positions from arange(S)", einsum_factory),
]
