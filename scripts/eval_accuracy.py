"""Exact-match accuracy of a trained model on prompt/completion rows (greedy decoding).

    python scripts/eval_accuracy.py --model runs/quickstart/final --data assets/quickstart/eval.jsonl

`make train` runs it after the quickstart, so the log shows that the model learned the task, not only
that its loss fell. Compare with an untrained model: `--model assets/quickstart/model --random-init`.
Each prompt is given as `llmtune generate` gives it (`llmtune.generate.load_run`): in the layout the run trained
with (plain, Alpaca's template, or the chat template), ending at every stop id.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from llmtune.generate import LoadedRun, Sampling, load_run, on_accelerator, reply


def untrained(folder: str) -> LoadedRun:
    """The baseline: the model's config with seeded random weights, prompted plain (it trained on nothing)."""
    torch.manual_seed(0)
    model = on_accelerator(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))).eval()
    return LoadedRun(model, AutoTokenizer.from_pretrained(folder), chat=False, folder=Path(folder))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--random-init", action="store_true", help="score an untrained model (the baseline)")
    args = parser.parse_args()

    run = untrained(args.model) if args.random_init else load_run(args.model)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()][: args.limit]
    by_kind: dict[str, list[bool]] = {}
    for row in rows:
        target = run.tokenizer(row["completion"], add_special_tokens=False).input_ids
        answer_text = reply(run, [{"role": "user", "content": row["prompt"]}], Sampling(max_new_tokens=len(target) + 2))
        kind = row["prompt"].split()[0]  # What / Reverse / Sort
        by_kind.setdefault(kind, []).append(answer_text.strip() == row["completion"].strip())
    total = [ok for oks in by_kind.values() for ok in oks]
    print(f"exact-match accuracy on {len(total)} eval rows: {sum(total) / len(total):.1%}")
    for kind, oks in sorted(by_kind.items()):
        print(f"  {kind:<8} {sum(oks) / len(oks):6.1%}  ({len(oks)} rows)")


if __name__ == "__main__":
    main()
