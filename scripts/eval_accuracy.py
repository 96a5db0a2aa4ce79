"""Exact-match accuracy of a trained model on prompt/completion rows (greedy decoding).

    python scripts/eval_accuracy.py --model runs/quickstart/final --data assets/quickstart/eval.jsonl

`make train` runs it after the quickstart, so the log shows that the model learned the task, not only
that its loss fell. Compare with an untrained model: `--model assets/quickstart/model --random-init`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from llmtune.data import render_prompt
from llmtune.generate import Sampling, answer, on_accelerator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--random-init", action="store_true", help="score an untrained model (the baseline)")
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if args.random_init:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model))
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model)
    model = on_accelerator(model).eval()
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()][: args.limit]
    by_kind: dict[str, list[bool]] = {}
    for row in rows:
        # Prompted and decoded as `llmtune generate` does (greedy, the prompt ids the run trained on).
        target = tokenizer(row["completion"], add_special_tokens=False).input_ids
        sampling = Sampling(max_new_tokens=len(target) + 2)
        answer_text = answer(model, tokenizer, render_prompt(row["prompt"], tokenizer), sampling)
        kind = row["prompt"].split()[0]  # What / Reverse / Sort
        by_kind.setdefault(kind, []).append(answer_text.strip() == row["completion"].strip())
    total = [ok for oks in by_kind.values() for ok in oks]
    print(f"exact-match accuracy on {len(total)} eval rows: {sum(total) / len(total):.1%}")
    for kind, oks in sorted(by_kind.items()):
        print(f"  {kind:<8} {sum(oks) / len(oks):6.1%}  ({len(oks)} rows)")


if __name__ == "__main__":
    main()
