"""On-policy preference pairs for DPO after the quickstart: the SFT model's own wrong answers rejected.

The SFT model answers training questions greedily, as `scripts/eval_accuracy.py` scores it; where it is wrong,
its answer is rejected and the correct one chosen. Off-policy pairs (`make_quickstart_pairs.py`: synthetic
mistakes the model may never make) taught DPO to rank them while greedy accuracy fell (measured in
benchmarks/results/measurements.md): DPO moves probability between the two answers of a pair, which helps
greedy decoding where the rejected answer is one the model would give. `--temperature T` also samples an
answer to each question the model gets right greedily, and a wrong sample is rejected: the near misses of
the tasks it mostly gets right, still its own.

    python scripts/make_quickstart_dpo_pairs.py --model runs/quickstart/final --out runs/quickstart-dpo-pairs.jsonl

Only training questions (assets/quickstart/train.jsonl) are asked, never the held-out eval.jsonl. The pairs
depend on the trained model, so `make train-dpo` makes them at run time (under runs/, not committed).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from llmtune.cli.generate import Sampling, batch_answers, load_run
from llmtune.data import render_prompt


def select_pairs(rows: list[dict], greedy: list[str], sampled: list[str] | None = None) -> list[dict]:
    """A pair per question whose greedy answer is wrong (that answer rejected), or, answered right greedily, whose
    sampled answer is wrong (the sample rejected). An empty answer (EOS at once) has no text to reject."""
    pairs = []
    for row, said, sample in zip(rows, greedy, sampled or [""] * len(rows), strict=True):
        gold = row["completion"].strip()
        rejected = sample if said.strip() == gold else said
        if rejected.strip() and rejected.strip() != gold:
            pairs.append({"prompt": row["prompt"], "chosen": row["completion"], "rejected": rejected})
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the SFT model (runs/quickstart/final)")
    parser.add_argument("--data", default="assets/quickstart/train.jsonl", help="the questions (training ones)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--questions", type=int, default=0, help="ask only the first N questions (0: all)")
    parser.add_argument("--temperature", type=float, default=0.0, help="also sample the ones right greedily (0: no)")
    args = parser.parse_args()

    began = time.perf_counter()
    run = load_run(args.model, chat=False)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    rows = rows[: args.questions] if args.questions else rows
    prompts = [render_prompt(r["prompt"], run.tokenizer) for r in rows]
    # As eval_accuracy.py: up to two tokens past the correct answer's length.
    budgets = [len(run.tokenizer(r["completion"], add_special_tokens=False).input_ids) + 2 for r in rows]
    greedy = batch_answers(run.model, run.tokenizer, prompts, budgets)
    sampled = None
    if args.temperature > 0:
        sampling = Sampling(temperature=args.temperature, seed=0)
        sampled = batch_answers(run.model, run.tokenizer, prompts, budgets, sampling)
    pairs = select_pairs(rows, greedy, sampled)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    right = sum(a.strip() == r["completion"].strip() for r, a in zip(rows, greedy, strict=True))
    print(
        f"{len(rows)} training questions: {right} answered right greedily ({right / len(rows):.1%});"
        f" {len(pairs)} pairs -> {out} in {time.perf_counter() - began:.0f} s"
    )


if __name__ == "__main__":
    main()
