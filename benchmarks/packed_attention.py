"""Packed rows' attention on a CPU: SDPA once per document (`llmtune.model.attention.per_document_sdpa`) against one
SDPA per micro-batch with the dense block-causal mask [B, 1, L, L] (what transformers builds for sdpa from restarting
position ids), forward and backward of attention alone, at the quickstart's shape and at a Llama-3.2-1B layer's.

    python -m benchmarks.packed_attention [--out benchmarks/results/packed_attention.json]

Prints the median time of each and their ratio (dense / per-document: above 1, per-document is faster); the JSON keeps
every case. A benchmark, not a test: figures depend on the host.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from llmtune.data.batch import document_offsets
from llmtune.model.attention import per_document_sdpa

# (name, rows, row length, heads, kv heads, head dim, document lengths drawn from)
CASES = [
    ("quickstart", 32, 64, 4, 4, 32, (6, 24)),
    ("1b-layer-short-docs", 2, 1024, 32, 8, 64, (32, 256)),
    ("1b-layer-long-docs", 2, 2048, 32, 8, 64, (256, 1536)),
]


def packed_positions(rows: int, length: int, docs: tuple[int, int], rng: random.Random) -> torch.Tensor:
    """Rows filled with documents of random lengths, the last one cut to fit (positions restart per document)."""
    out = []
    for _ in range(rows):
        row: list[int] = []
        while len(row) < length:
            row += list(range(min(rng.randint(*docs), length - len(row))))
        out.append(row)
    return torch.tensor(out)


def block_causal_mask(offsets: list[int], rows: int, length: int) -> torch.Tensor:
    """[B, 1, L, L] bool: causal within each span of the flattened rows."""
    doc = torch.zeros(rows * length, dtype=torch.long)
    for i, start in enumerate(offsets[1:-1], 1):
        doc[start:] = i
    doc = doc.view(rows, length)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_case(case: tuple, dtype: torch.dtype, repeats: int) -> dict:
    name, rows, length, heads, kv_heads, dim, docs = case
    positions = packed_positions(rows, length, docs, random.Random(0))
    offsets = document_offsets(positions)
    q = torch.randn(rows, heads, length, dim, dtype=dtype, requires_grad=True)
    k = torch.randn(rows, kv_heads, length, dim, dtype=dtype, requires_grad=True)
    v = torch.randn(rows, kv_heads, length, dim, dtype=dtype, requires_grad=True)
    scale = dim**-0.5

    def per_document() -> None:
        per_document_sdpa(q, k, v, offsets, scale).sum().backward()

    def dense() -> None:
        # transformers' sdpa with a mask repeats K/V to the query heads (no native GQA under a mask) and builds the
        # mask every forward.
        mask = block_causal_mask(offsets.tolist(), rows, length)
        kk, vv = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=scale).sum().backward()

    a, b = seconds(per_document, repeats), seconds(dense, repeats)
    spans = offsets.diff().tolist()
    return {
        "case": name,
        "dtype": str(dtype).removeprefix("torch."),
        "rows": rows,
        "length": length,
        "documents": len(spans),
        "per_document_s": a,
        "dense_mask_s": b,
        "dense_over_per_document": b / a,
        "scores_per_document": sum(n * (n + 1) // 2 for n in spans),
        "scores_dense": rows * length * length,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/packed_attention.json"))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    results = []
    for case in CASES:
        for dtype in (torch.float32, torch.bfloat16):
            r = run_case(case, dtype, args.repeats)
            results.append(r)
            ms = r["per_document_s"] * 1e3, r["dense_mask_s"] * 1e3
            print(  # noqa: T201 (a benchmark's report)
                f"{r['case']:22s} {r['dtype']:8s} docs {r['documents']:4d}  per-document {ms[0]:8.2f} ms"
                f"  dense mask {ms[1]:8.2f} ms  dense/per-document {r['dense_over_per_document']:5.2f}x"
            )
    host = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"host": host, "torch": torch.__version__, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
