"""Benchmark preference batches: pairs packed into rows vs one padded row per sequence (TRL's layout).

The quickstart's pairs (assets/quickstart/pairs.jsonl, scripts/make_quickstart_pairs.py) go through the real
`prepare_data` both ways; batches come from `batch_for_step` as the loop takes them (length-grouped when
unpacked). For each layout it reports, over a whole epoch of micro-batches, the fraction of computed token
positions that are padding, then times DPO training micro-steps (forward + backward of
`llmtune.objectives.pair_losses.PreferenceModel` on the quickstart's model config, fp32, a precomputed reference) and
reports trained (completion) tokens per second and pairs per second. Layouts take turns step by step so
background load hits them alike; the ratio is the figure to read on a shared machine.

    .venv/bin/python -m benchmarks.preference             # ~1-2 minutes on 2 cores
    .venv/bin/python -m benchmarks.preference --steps 4

Writes benchmarks/results/preference_packing_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from benchmarks import RESULTS, ROOT
from llmtune.data import batch_for_step, prepare_data, steps_per_epoch
from llmtune.objectives.pair_losses import PreferenceModel, collate_pairs, pairs_in
from llmtune.recipe import DataConfig, PreferenceConfig, SourceConfig

OUTPUT = RESULTS / "preference_packing_cpu.json"
ASSETS = ROOT / "assets" / "quickstart"
# Rows per optimizer step and per micro-batch: about the same pairs either way (a packed 128-token row holds ~4).
LAYOUTS = {"packed": (16, 4), "unpacked": (64, 16)}


def micro_batches(data, packed: bool, global_rows: int, micro: int, pad_id: int, step: int) -> list[dict]:
    rows = batch_for_step(
        data, step=step, global_batch_size=global_rows, seed=0, rank=0, world_size=1, group_by_length=not packed
    )
    return [collate_pairs(rows[i : i + micro], pad_token_id=pad_id, packed=packed) for i in range(0, len(rows), micro)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps per layout (after one warm-up)")
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "model")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ASSETS / "model")).float()
    module = PreferenceModel(model, "chunked", "dpo", PreferenceConfig(), "precomputed")
    source = [SourceConfig(path=str(ASSETS / "pairs.jsonl"), format="preference")]
    results = {}
    datasets_by_layout = {}
    for name, (global_rows, micro) in LAYOUTS.items():
        data = prepare_data(DataConfig(train=source, max_length=128, packing=name == "packed"), tokenizer, seed=0)
        datasets_by_layout[name] = data.train
        positions = padding = 0
        for step in range(steps_per_epoch(data.train, global_rows)):
            for batch in micro_batches(data.train, name == "packed", global_rows, micro, tokenizer.pad_token_id, step):
                positions += batch["input_ids"].numel()
                padding += int((batch["segment_ids"] < 0).sum())
        results[name] = {"padding_fraction": padding / positions, "rows_per_step": global_rows, "micro_rows": micro}
        results[name] |= {"seconds": 0.0, "trained_tokens": 0, "pairs": 0}
    for step in range(args.steps + 1):  # step 0 warms up
        for name, (global_rows, micro) in LAYOUTS.items():
            batches = micro_batches(
                datasets_by_layout[name], name == "packed", global_rows, micro, tokenizer.pad_token_id, step
            )
            start = time.perf_counter()
            for batch in batches:
                batch["ref_logps"] = torch.zeros(pairs_in(batch), 2)
                module(**batch)[0].backward()
            seconds = time.perf_counter() - start
            model.zero_grad(set_to_none=True)
            if step:
                results[name]["seconds"] += seconds
                results[name]["trained_tokens"] += sum(int((b["labels"] != -100).sum()) for b in batches)
                results[name]["pairs"] += sum(pairs_in(b) for b in batches)
    print(f"{'layout':<10} {'padding':>8} {'trained tok/s':>14} {'pairs/s':>8}")
    for name, r in results.items():
        r["tokens_per_s"] = r["trained_tokens"] / r["seconds"]
        r["pairs_per_s"] = r["pairs"] / r["seconds"]
        print(f"{name:<10} {r['padding_fraction']:>8.1%} {r['tokens_per_s']:>14.0f} {r['pairs_per_s']:>8.1f}")
    speedup = results["packed"]["tokens_per_s"] / results["unpacked"]["tokens_per_s"]
    print(f"packed / unpacked trained tokens/s: {speedup:.2f}x")
    record = {
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "layouts": results,
        "packed_over_unpacked_tokens_per_s": speedup,
        "command": " ".join(["python -m benchmarks.preference", *sys.argv[1:]]),
    }
    OUTPUT.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
