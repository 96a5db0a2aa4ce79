"""The tiled MLP (`llmtune.model.tiling`) against the plain one at long rows on a CPU: a step's peak live bytes and
time.

A tiny but wide Llama (hidden 256, MLP 1024, 2 layers, vocab 1024; the MLP 4x the hidden size as Llama-3.2's is),
fp32, one packed row of 8k and 16k tokens (documents of 1024 tokens, attention per document as a packed run has it),
with every decoder layer checkpointed (what long rows run with) and without. Each case steps the tiled and the plain
model from the same weights: the peak counted by `PeakMemoryTracker` (live tensor storages; the weights in its
baseline), and the median time of a forward and backward, the two models alternated so a busy host slows both alike.

    python -m benchmarks.tiled_mlp               # ~7 min on 2 shared cores
    python -m benchmarks.tiled_mlp --quick       # 8k tokens only, checkpointed only

Writes benchmarks/results/tiled_mlp_cpu.json. A benchmark, not a test: times depend on the host; the peaks do not.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from benchmarks import run_header, write_results
from llmtune.model.attention import VARLEN
from llmtune.model.blocks import apply_checkpointing
from llmtune.model.tiling import mlp_tiles, tile_mlp
from llmtune.objectives import objective_named
from llmtune.ops.measure import PeakMemoryTracker
from llmtune.recipe import Checkpointing

HIDDEN, INTERMEDIATE, VOCAB, DOCUMENT = 256, 1024, 1024, 1024


def model_pair(checkpointing: Checkpointing) -> dict[str, torch.nn.Module]:
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=DOCUMENT, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(config, attn_implementation=VARLEN, dtype=torch.float32).train()
    apply_checkpointing(plain, checkpointing)
    tiled = copy.deepcopy(plain)
    tile_mlp(tiled)
    return {"plain": plain, "tiled": tiled}


def packed_row(tokens: int) -> dict[str, torch.Tensor]:
    """One row of `tokens` as SFT's packed collate makes it: documents of DOCUMENT tokens, every token trained."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (tokens,), generator=g).tolist()
    rows = [{"input_ids": ids, "labels": ids, "position_ids": [i % DOCUMENT for i in range(tokens)]}]
    return objective_named("sft").collate(rows, pad_token_id=0, packed=True)


def step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> None:
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()


def peak_bytes(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, int]:
    with PeakMemoryTracker("cpu", baseline=[model]) as t:
        step(model, batch)
    return {"peak": t.peak_bytes, "above_weights": t.peak_bytes - t.entry_bytes}


def seconds(models: dict[str, torch.nn.Module], batch: dict[str, torch.Tensor], rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in models}
    for r in range(rounds + 1):  # the first round warms up (allocations, the thread pool)
        for k in list(models)[:: 1 if r % 2 else -1]:
            t0 = time.perf_counter()
            step(models[k], batch)
            if r:
                times[k].append(time.perf_counter() - t0)
    return times


def case(tokens: int, checkpointing: Checkpointing, rounds: int) -> dict:
    models, batch = model_pair(checkpointing), packed_row(tokens)
    peaks = {k: peak_bytes(m, batch) for k, m in models.items()}
    rounds_s = seconds(models, batch, rounds)
    time_s = {k: statistics.median(v) for k, v in rounds_s.items()}
    return {
        "tokens": tokens,
        "checkpointing": checkpointing.enabled,
        "tiles": mlp_tiles(tokens, HIDDEN),
        "peak_bytes": peaks,
        "step_s": time_s,  # medians of
        "rounds_s": rounds_s,
        "peak_tiled_over_plain": peaks["tiled"]["peak"] / peaks["plain"]["peak"],
        "above_weights_tiled_over_plain": peaks["tiled"]["above_weights"] / peaks["plain"]["above_weights"],
        "time_tiled_over_plain": time_s["tiled"] / time_s["plain"],
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8k tokens, checkpointed only")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="1: a shared host's second core is often busy")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    started = time.perf_counter()
    lengths = [8192] if a.quick else [8192, 16384]
    specs = [Checkpointing(1)] if a.quick else [Checkpointing(1), Checkpointing(0)]
    cases = [case(n, spec, a.rounds) for n in lengths for spec in specs]
    results = {
        **run_header("tiled_mlp", argv, "cpu"),
        "model": {"hidden": HIDDEN, "intermediate": INTERMEDIATE, "layers": 2, "vocab": VOCAB, "document": DOCUMENT},
        "cases": cases,
        "seconds": time.perf_counter() - started,
    }
    print(f"{'tokens':>6s} {'ckpt':>5s} {'tiles':>5s} {'peak MiB plain':>14s} {'tiled':>7s} {'ratio':>6s}"
          f" {'above-weights ratio':>19s} {'step s plain':>12s} {'tiled':>6s} {'ratio':>6s}")  # fmt: skip
    for c in cases:
        p, s = c["peak_bytes"], c["step_s"]
        print(
            f"{c['tokens']:6d} {c['checkpointing']!s:>5s} {c['tiles']:5d} {p['plain']['peak'] / 2**20:14.1f}"
            f" {p['tiled']['peak'] / 2**20:7.1f} {c['peak_tiled_over_plain']:6.2f}"
            f" {c['above_weights_tiled_over_plain']:19.2f} {s['plain']:12.2f} {s['tiled']:6.2f}"
            f" {c['time_tiled_over_plain']:6.2f}"
        )
    write_results(results, "tiled_mlp", "cpu")
    return results


if __name__ == "__main__":
    main()
