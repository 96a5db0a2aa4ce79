"""Exact-match accuracy of a trained model on prompt/completion rows (greedy decoding).

    python scripts/eval_accuracy.py --model runs/quickstart/final --data assets/quickstart/eval.jsonl

`make train` runs it after the quickstart, so the log shows that the model learned the task, not only
that its loss fell. Compare with an untrained model: `--model assets/quickstart/model --random-init`.
Each prompt is given as `llmtune generate` gives it (`llmtune.cli.generate.load_run`): in the layout the run trained
with (plain, Alpaca's template, or the chat template), ending at every stop id.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

import torch
from make_quickstart import new_additions  # scripts/ is this script's folder: on sys.path when it runs
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from llmtune.cli.generate import LoadedRun, Sampling, load_run, on_accelerator, reply


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
    parser.add_argument("--fresh-addition", type=int, default=0, help="also score N additions absent from the data")
    parser.add_argument("--exclude", nargs="*", default=[], help="files whose questions --fresh-addition avoids")
    parser.add_argument("--against", help="a second model scored on the same rows: the change, question by question")
    args = parser.parse_args()

    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()][: args.limit]
    if args.fresh_addition:
        seen = [args.data, *args.exclude]
        rows += fresh_additions(
            args.fresh_addition, [json.loads(x) for f in seen for x in Path(f).read_text().splitlines()]
        )
    scored = score(untrained(args.model) if args.random_init else load_run(args.model), rows)
    report(scored)
    if args.against:
        before = score(load_run(args.against), rows)
        print(f"against {args.against}:")
        report(before)
        report_change(scored, before)


def score(run: LoadedRun, rows: list[dict]) -> dict[str, list[bool]]:
    """Each row's exact match, greedy, grouped by the kind of question."""
    by_kind: dict[str, list[bool]] = {}
    for row in rows:
        target = run.tokenizer(row["completion"], add_special_tokens=False).input_ids
        answer_text = reply(run, [{"role": "user", "content": row["prompt"]}], Sampling(max_new_tokens=len(target) + 2))
        kind = row.get("kind") or row["prompt"].split()[0]  # What / Reverse / Sort, or fresh additions
        by_kind.setdefault(kind, []).append(answer_text.strip() == row["completion"].strip())
    return by_kind


def report(by_kind: dict[str, list[bool]]) -> None:
    total = [ok for kind, oks in by_kind.items() if kind != FRESH for ok in oks]
    print(f"exact-match accuracy on {len(total)} eval rows: {sum(total) / len(total):.1%} {error_bar(total)}")
    for kind, oks in sorted(by_kind.items()):
        print(f"  {kind:<8} {sum(oks) / len(oks):6.1%} {error_bar(oks)}  ({len(oks)} rows)")


def report_change(after: dict[str, list[bool]], before: dict[str, list[bool]]) -> None:
    """The change per kind of question, with the standard error of the paired difference: both models answered the
    same questions, so this error bar is the change's own, tighter than the two accuracies' bars combined."""
    print("change, question by question:")
    for kind in sorted(after):
        change = [int(a) - int(b) for a, b in zip(after[kind], before[kind], strict=True)]
        mean = sum(change) / len(change)
        spread = math.sqrt(sum((c - mean) ** 2 for c in change) / max(len(change) - 1, 1) / len(change))
        print(f"  {kind:<8} {mean:+6.1%} +/- {spread:.1%}  ({len(change)} rows)")


def error_bar(oks: list[bool]) -> str:
    """The binomial standard error of a share: how far another sample of as many questions could land."""
    p = sum(oks) / len(oks)
    return f"+/- {math.sqrt(p * (1 - p) / len(oks)):.1%}"


FRESH = "addition(fresh)"


def fresh_additions(n: int, seen_rows: list[dict]) -> list[dict]:
    """`n` two-digit additions (0-99 + 0-99, as the quickstart's) whose question is in none of `seen_rows`: more
    held-out addition questions than eval.jsonl's 67, for a tighter error bar. Seeded: the same set every time."""
    return [row | {"kind": FRESH} for row in new_additions(n, seen_rows, random.Random(0))]


if __name__ == "__main__":
    main()
