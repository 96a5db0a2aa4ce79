"""Preference pairs for the quickstart task: the correct answer chosen, a plausible wrong one rejected.

The wrong answers are the mistakes a small model makes on this task: a sum off by one or by ten, or with
two digits swapped; letters reversed or sorted with two neighbours swapped, one letter dropped or doubled,
or left in the input order. Deterministic (fixed seed): running it again reproduces the committed files.

    python scripts/make_quickstart_pairs.py [--assets assets/quickstart]

writes pairs.jsonl (from train.jsonl) and eval_pairs.jsonl (from eval.jsonl) beside the task's files.
The held-out questions of eval.jsonl are never trained on: eval_pairs.jsonl is only the eval loss's data.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path


def wrong_sum(answer: int, rng: random.Random) -> int:
    digits = str(answer)
    options = [answer + 1, answer - 1, answer + 10, answer - 10]
    if len(digits) > 1 and digits[-1] != digits[-2]:
        options.append(int(digits[:-2] + digits[-1] + digits[-2]))
    return rng.choice([o for o in options if o >= 0 and o != answer])


def wrong_letters(letters: list[str], answer: list[str], rng: random.Random) -> list[str]:
    candidates = []
    for i in range(len(answer) - 1):
        if answer[i] != answer[i + 1]:
            swapped = list(answer)
            swapped[i], swapped[i + 1] = swapped[i + 1], swapped[i]
            candidates.append(swapped)
    i = rng.randrange(len(answer))
    candidates += [answer[:i] + answer[i + 1 :], answer[: i + 1] + answer[i:], letters]
    return rng.choice([c for c in candidates if c != answer])


def make_pair(row: dict[str, str], rng: random.Random) -> dict[str, str]:
    prompt, completion = row["prompt"], row["completion"]
    if prompt.startswith("What is"):
        wrong = str(wrong_sum(int(completion), rng))
    else:
        letters = re.search(r"letters: (.*)\n", prompt).group(1).split()
        wrong = " ".join(wrong_letters(letters, completion.split(), rng))
    return {"prompt": prompt, "chosen": completion, "rejected": " " + wrong}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--assets", default="assets/quickstart")
    args = parser.parse_args()
    folder = Path(args.assets)
    rng = random.Random(0)
    for source, target in (("train.jsonl", "pairs.jsonl"), ("eval.jsonl", "eval_pairs.jsonl")):
        rows = [json.loads(line) for line in (folder / source).read_text().splitlines()]
        (folder / target).write_text("".join(json.dumps(make_pair(r, rng)) + "\n" for r in rows))


if __name__ == "__main__":
    main()
