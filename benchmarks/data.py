"""Benchmark batching strategies: packing vs plain padding vs length-grouping.

A synthetic instruction set with a realistic length spread (prompt and completion lengths drawn from
lognormals, medians ~40 and ~110 tokens, long tails cut at max_length) goes through the real
`prepare_data` (a word-level tokenizer built offline: one word = one token, so lengths are exact).
For each strategy it reports, over a whole epoch of micro-batches, the fraction of computed token
positions that are padding, then trains a tiny Llama (hidden 256, 4 layers, fp32) for a few
optimizer steps and reports trained (non-masked) tokens per second of wall time and per CPU-second
of this process (the steadier figure when other jobs share the cores; the ratio column uses it).
Strategies take turns step by step so background load hits them alike.

    .venv/bin/python -m benchmarks.data                # ~1-2 minutes on 2 cores
    .venv/bin/python -m benchmarks.data --steps 4 --examples 400

Writes benchmarks/results/data_packing_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import datasets
import numpy as np
import torch

from benchmarks import RESULTS
from llmtune.data import IGNORE, batch_for_step, collate, prepare_data
from llmtune.recipe import DataConfig, SourceConfig

OUTPUT = RESULTS / "data_packing_cpu.json"
WORDS = 2000


def build_tokenizer(folder: Path):
    """Word-level tokenizer over w0..w{WORDS-1}: token counts equal word counts (+ BOS, EOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {tok: i for i, tok in enumerate(special + [f"w{i}" for i in range(WORDS)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def synthetic_rows(n: int, seed: int) -> list[dict[str, str]]:
    rng = np.random.default_rng(seed)
    prompt_len = np.maximum(4, rng.lognormal(np.log(40), 0.8, n)).astype(int)
    completion_len = np.maximum(2, rng.lognormal(np.log(110), 0.9, n)).astype(int)

    def words(k: int) -> str:
        return " ".join(f"w{i}" for i in rng.integers(0, WORDS, k))

    return [{"prompt": words(p), "completion": words(c)} for p, c in zip(prompt_len, completion_len, strict=True)]


def epoch_padding(data: datasets.Dataset, *, packed: bool, group: bool, gbs: int, mb: int, seed: int) -> dict:
    """Padding over one epoch of micro-batches, as the training loop would build them (one process)."""
    computed = padding = 0
    for step in range(len(data) // gbs):
        rows = batch_for_step(
            data, step=step, global_batch_size=gbs, seed=seed, rank=0, world_size=1, group_by_length=group
        )
        for i in range(0, len(rows), mb):
            batch = collate(rows[i : i + mb], pad_token_id=0, packed=packed)
            real = sum(len(r["input_ids"]) for r in rows[i : i + mb])
            computed += batch["input_ids"].numel()
            padding += batch["input_ids"].numel() - real
    return {"computed_positions": computed, "padding_fraction": padding / max(1, computed)}


def tiny_llama(vocab: int, seed: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
    )
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").train()


def train_step(model, opt, data, *, step: int, packed: bool, group: bool, gbs: int, mb: int, seed: int) -> dict:
    """One optimizer step as the loop runs it; returns its wall time and token counts."""
    rows = batch_for_step(
        data, step=step, global_batch_size=gbs, seed=seed, rank=0, world_size=1, group_by_length=group
    )
    batches = [collate(rows[i : i + mb], pad_token_id=0, packed=packed) for i in range(0, len(rows), mb)]
    # Loss summed over trained tokens and divided by the window's count (what the loop does).
    window = sum(int((b["labels"][:, 1:] != IGNORE).sum()) for b in batches)
    start, cpu_start = time.perf_counter(), time.process_time()
    for b in batches:
        logits = model(**{k: v for k, v in b.items() if k != "labels"}, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), b["labels"][:, 1:].flatten(), ignore_index=IGNORE, reduction="sum"
        )
        (loss / window).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return {
        "seconds": time.perf_counter() - start,
        # CPU seconds of this process (all threads): steadier than wall time on a shared machine.
        "cpu_seconds": time.process_time() - cpu_start,
        "trained": window,
        "positions": sum(b["input_ids"].numel() for b in batches),
    }


def throughput(records: list[dict]) -> dict:
    seconds = sum(r["seconds"] for r in records)
    return {
        "steps_timed": len(records),
        "seconds_per_step": seconds / len(records),
        "seconds_per_step_min": min(r["seconds"] for r in records),
        "trained_tokens_per_s": sum(r["trained"] for r in records) / seconds,
        "trained_tokens_per_cpu_s": sum(r["trained"] for r in records) / sum(r["cpu_seconds"] for r in records),
        "computed_positions_per_s": sum(r["positions"] for r in records) / seconds,
        "trained_tokens_per_step": sum(r["trained"] for r in records) / len(records),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=512)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4, help="timed optimizer steps per strategy")
    parser.add_argument("--global-batch", type=int, default=16, help="examples per step (unpacked)")
    parser.add_argument("--micro-batch", type=int, default=4, help="examples per forward (unpacked)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    datasets.disable_progress_bars()

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = build_tokenizer(Path(tmp) / "tok")
        path = Path(tmp) / "synthetic.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in synthetic_rows(args.examples, args.seed)))
        source = SourceConfig(path=str(path))
        plain = prepare_data(DataConfig(train=[source], max_length=args.max_length), tokenizer, seed=args.seed)
        packed = prepare_data(
            DataConfig(train=[source], max_length=args.max_length, packing=True), tokenizer, seed=args.seed
        )
        vocab = len(tokenizer)

    lengths = np.asarray(plain.train["length"])
    per_row = plain.stats.examples / packed.stats.rows
    # Packed rows hold ~per_row examples: scale the packed batch so a step sees about as many tokens.
    packed_gbs = max(1, round(args.global_batch / per_row))
    packed_mb = max(1, round(args.micro_batch / per_row))
    strategies = {
        "padding": (plain.train, False, False, args.global_batch, args.micro_batch),
        "group_by_length": (plain.train, False, True, args.global_batch, args.micro_batch),
        "packing": (packed.train, True, False, packed_gbs, packed_mb),
    }
    # Strategies take turns step by step, so a noisy (shared) machine slows them alike.
    runs = {}
    for name in strategies:
        model = tiny_llama(vocab, args.seed)
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4), [])
    for step in range(args.steps + 1):  # step 0 warms up (allocator, kernels) and is not timed
        for name, (data, is_packed, group, gbs, mb) in strategies.items():
            model, opt, records = runs[name]
            record = train_step(
                model, opt, data, step=step, packed=is_packed, group=group, gbs=gbs, mb=mb, seed=args.seed
            )
            if step:
                records.append(record)
        print(f"  step {step} done", file=sys.stderr)
    results = {}
    for name, (data, is_packed, group, gbs, mb) in strategies.items():
        pad = epoch_padding(data, packed=is_packed, group=group, gbs=gbs, mb=mb, seed=args.seed)
        results[name] = {"global_batch_rows": gbs, "micro_batch_rows": mb, **pad, **throughput(runs[name][2])}

    print(
        f"{plain.stats.examples} examples, lengths p50 {np.median(lengths):.0f} / p90 {np.percentile(lengths, 90):.0f}"
        f" / max {lengths.max()} tokens, {plain.stats.truncated} truncated at {args.max_length};"
        f" packing: {packed.stats.rows} rows, {per_row:.2f} examples/row, fill {packed.stats.packing_fill:.1%}"
    )
    header = (
        f"{'strategy':<16} {'rows/step':>9} {'padding':>8} {'s/step':>7} {'trained tok/s':>14}"
        f" {'tok/cpu-s':>10} {'vs padding':>10}"
    )
    print(header)
    print("-" * len(header))
    base = results["padding"]["trained_tokens_per_cpu_s"]
    for name, r in results.items():
        print(
            f"{name:<16} {r['global_batch_rows']:>9} {r['padding_fraction']:>8.1%} {r['seconds_per_step']:>7.2f}"
            f" {r['trained_tokens_per_s']:>14.0f} {r['trained_tokens_per_cpu_s']:>10.0f}"
            f" {r['trained_tokens_per_cpu_s'] / base:>9.2f}x"
        )

    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "data_packing",
        "command": "python -m benchmarks.data " + " ".join(sys.argv[1:]),
        "args": vars(args),
        "environment": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "precision": "fp32",
            "model": "Llama hidden 256, 4 layers, 4 heads, sdpa",
        },
        "data": {
            "examples": plain.stats.examples,
            "length_p50": float(np.median(lengths)),
            "length_p90": float(np.percentile(lengths, 90)),
            "length_max": int(lengths.max()),
            "truncated": plain.stats.truncated,
            "trained_tokens": plain.stats.trained_tokens,
            "packed_rows": packed.stats.rows,
            "examples_per_packed_row": per_row,
            "packing_fill": packed.stats.packing_fill,
        },
        "results": results,
    }
    OUTPUT.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {OUTPUT}")


if __name__ == "__main__":
    main()
