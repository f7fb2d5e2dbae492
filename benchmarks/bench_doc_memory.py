"""Benchmark 8: per-rank peak memory with packed documents (document masks without a mask tensor).

    .venv/bin/python benchmarks/bench_doc_memory.py              # S = 64k, ~32 documents (~6 min on 2 cores)
    .venv/bin/python benchmarks/bench_doc_memory.py --quick      # S = 16k only (~2 min)

The model is one transformer block written the way packing code writes it: token ids,
document ids (B, S) and labels come in, and the block builds its attention mask in the
graph from the document ids (``same document & causal``), then calls
``F.scaled_dot_product_attention``. Documents are log-normal in length, mean 2k tokens,
so S = 64k holds about 32 of them.

Rows (each in fresh processes, one torch thread each, gloo on 127.0.0.1):

* ``N=1 varlen``: the single-device reference. Without CP the graph-built mask is S x S
  (16 GiB of additive mask at 64k), which no one would run; the fair single-device form
  is a varlen kernel that attends document by document. This row uses
  ``cp_compile.ring_attention(..., doc_ids=)`` on one process, which is exactly that:
  one flash call per document, no mask tensor.
* ``N>1 documents``: ``torch.compile(model, backend=RingCP(inner="aot_eager"))`` on the
  unmodified graph-mask model. The rewrite turns ``doc[:, :, None] == doc[:, None, :]``
  into the ring op's ``doc_ids`` (the whole (B, S) id tensor, 4-8 bytes a token).
* ``N>1 explicit``: the same model with float document ids, which the rewrite does not
  read as document ids, so the mask stays explicit: each rank builds its c x S rows of
  it (what every document mask cost before document ids). Run at the shorter S only:
  at 64k on 4 ranks those rows are 4 GiB per rank.

The figure is ``peak_above``: the process's resident peak during step 2's forward +
backward above its resident size just before (see ``common.measure_peak``). The ratio
is each row's peak_above over the ``N=1 varlen`` row of the same S.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any, Dict, List

import common

INNER = "aot_eager"
DIM, HEADS, FFN, VOCAB = 256, 4, 512, 256
MEAN_DOC, SIGMA = 2048, 1.0


def doc_lengths(seq_len: int, seed: int) -> List[int]:
    """Log-normal document lengths (mean ``MEAN_DOC``, sigma ``SIGMA``) filling exactly ``seq_len`` tokens."""
    import torch

    g = torch.Generator().manual_seed(seed)
    mu = math.log(MEAN_DOC) - SIGMA ** 2 / 2
    out: List[int] = []
    while sum(out) < seq_len:
        n = int(torch.empty(1).log_normal_(mu, SIGMA, generator=g).clamp(min=16).item())
        out.append(min(n, seq_len - sum(out)))
    return out


def _model(attention: str):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class PackedBlock(nn.Module):
        """Embedding, one pre-norm attention + MLP block, LM head, cross-entropy."""

        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB, bias=False)
            self.n1, self.n2 = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
            self.qkv, self.o = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
            self.up, self.down = nn.Linear(DIM, FFN), nn.Linear(FFN, DIM)

        def attend(self, q, k, v, doc):  # q, k, v: (B, H, S, D); doc: (B, S)
            if attention == "varlen":
                import cp_compile

                return cp_compile.ring_attention(q, k, v, causal=True, doc_ids=doc)
            s = q.shape[2]
            pos = torch.arange(s, device=q.device)
            ids = doc.float() if attention == "explicit" else doc
            mask = (ids[:, :, None] == ids[:, None, :]) & (pos[None, :] <= pos[:, None])  # (B, S, S)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])

        def forward(self, ids, doc, labels):  # (B, S) each
            b, s = ids.shape
            x = self.emb(ids)  # (B, S, DIM)
            q, k, v = self.qkv(self.n1(x)).view(b, s, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
            x = x + self.o(self.attend(q, k, v, doc).transpose(1, 2).reshape(b, s, DIM))
            x = x + self.down(F.gelu(self.up(self.n2(x))))
            return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())

    return PackedBlock()


def rank_step(rank: int, world: int, attention: str, seq_len: int) -> Dict[str, Any]:
    """In one rank: compile, warm up, then measure the peak of one forward + backward."""
    import torch

    import cp_compile

    torch.manual_seed(0)
    model = _model(attention)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, seq_len), generator=g)
    labels = torch.randint(0, VOCAB, (1, seq_len), generator=g)
    lengths = doc_lengths(seq_len, seed=2)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]  # (1, S) int64
    backend = INNER if world == 1 else cp_compile.RingCP(inner=INNER)
    compiled = torch.compile(model, backend=backend, fullgraph=True)

    m = common.measure_train_step(model, compiled, (ids, doc, labels), world)
    m["documents"] = len(lengths)
    if world > 1 and hasattr(backend, "records") and backend.records:
        rec = backend.records[-1]
        m["masks"] = list(getattr(rec, "masks", []))
        m["fallbacks"] = len(rec.fallbacks)
    return m


def configs(args) -> List[tuple]:
    out = []
    for s in args.seq_lens:
        out.append(("varlen", s, 1))
        out += [("documents", s, n) for n in args.worlds if n > 1]
        if s <= args.explicit_up_to:
            out += [("explicit", s, n) for n in args.worlds if n > 1]
    return out


def measure_all(args) -> List[Dict[str, Any]]:
    rows = []
    cfgs = configs(args)
    for i, (attention, s, n) in enumerate(cfgs, 1):
        common.log(f"[{i}/{len(cfgs)}] {attention} S={s} N={n}")
        res = common.try_run_ranks(rank_step, n, attention, s)
        row: Dict[str, Any] = {"path": attention, "seq_len": s, "world": n}
        if isinstance(res, dict):
            row["error"] = res["error"]
        else:
            row.update(ranks=res, peak_above_mib=max(r["peak_above_mib"] for r in res),
                       peak_rss_mib=max(r["peak_rss_mib"] for r in res), seconds=max(r["seconds"] for r in res),
                       loss=res[0]["loss"], documents=res[0]["documents"], masks=res[0].get("masks"))
        rows.append(row)
    ref = {r["seq_len"]: r for r in rows if r["path"] == "varlen" and "error" not in r}
    for r in rows:
        if r["seq_len"] in ref and "error" not in r:
            r["ratio_above"] = r["peak_above_mib"] / ref[r["seq_len"]]["peak_above_mib"]
            r["loss_diff"] = abs(r["loss"] - ref[r["seq_len"]]["loss"])
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--seq-lens", type=common.int_list, default=None, help="sequence lengths (default 16k,64k)")
    p.add_argument("--worlds", type=common.int_list, default=[1, 2, 4], help="CP sizes (default 1,2,4)")
    p.add_argument("--explicit-up-to", type=common.int_list, default=common.int_list("16k"),
                   help="run the explicit-mask rows up to this S (default 16k)")
    p.add_argument("--quick", action="store_true", help="S = 16k only")
    args = p.parse_args(argv)
    args.explicit_up_to = args.explicit_up_to[0]
    if args.seq_lens is None:
        args.seq_lens = common.int_list("16k" if args.quick else "16k,64k")
    started = time.perf_counter()
    rows = measure_all(args)
    for r in rows:
        head = f"{r['path']:9s} S={r['seq_len']:6d} N={r['world']}"
        if "error" in r:
            common.log(f"{head}: FAILED {r['error']}")
        else:
            common.log(f"{head}: {r['documents']} docs, above {r['peak_above_mib']:8.1f} MiB "
                       f"(x{r.get('ratio_above', float('nan')):.3f}), loss {r['loss']:.6f}")
    common.write_result("doc_memory", {"rows": rows, "inner": INNER, "mean_doc": MEAN_DOC, "sigma": SIGMA},
                        started, args)


if __name__ == "__main__":
    main()
