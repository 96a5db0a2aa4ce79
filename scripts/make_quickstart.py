"""Generate the embedded default: a tiny Llama config, a tokenizer trained offline, and a toy task.

The task is short questions a ~5M-parameter model visibly learns in a few minutes on a laptop CPU:
two-digit addition, reversing and sorting short letter strings. `grpo.jsonl` holds addition questions in neither
train.jsonl nor eval.jsonl, for `make train-grpo` to practise on. Everything is deterministic (fixed seed),
so running this again reproduces the committed files under assets/quickstart/ byte for byte.

    python scripts/make_quickstart.py [--out assets/quickstart]
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, PreTrainedTokenizerFast

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]


def make_example(rng: random.Random) -> dict[str, str]:
    kind = rng.choice(["add", "reverse", "sort"])
    if kind == "add":
        return addition(rng.randint(0, 99), rng.randint(0, 99))
    # Letters are spaced so each is its own token: the task is then about order, not about BPE merges.
    letters = [rng.choice(string.ascii_lowercase[:12]) for _ in range(rng.randint(3, 7))]
    answer = letters[::-1] if kind == "reverse" else sorted(letters)
    verb = "Reverse" if kind == "reverse" else "Sort"
    return {"prompt": f"{verb} the letters: {' '.join(letters)}\nAnswer:", "completion": " " + " ".join(answer)}


def addition(a: int, b: int) -> dict[str, str]:
    return {"prompt": f"What is {a} + {b}?\nAnswer:", "completion": f" {a + b}"}


def new_additions(n: int, seen: list[dict[str, str]], rng: random.Random) -> list[dict[str, str]]:
    """`n` two-digit additions whose question is in none of `seen`, drawn by `rng`: GRPO practises on questions SFT
    never showed it (a rise in reward is then the model adding better, not recalling the answers it was trained on),
    and eval_accuracy.py scores on questions no file holds."""
    asked = {row["prompt"] for row in seen}
    rows = [row for a in range(100) for b in range(100) if (row := addition(a, b))["prompt"] not in asked]
    rng.shuffle(rows)
    return rows[:n]


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    # Digits and letters split one per token, so arithmetic and string tasks are learnable at this size.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|eos|>")
    fast.chat_template = CHATML
    return fast


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="assets/quickstart")
    parser.add_argument("--train", type=int, default=6000)
    parser.add_argument("--eval", type=int, default=200)
    parser.add_argument("--grpo", type=int, default=2000)
    args = parser.parse_args()
    out = Path(args.out)
    rng = random.Random(0)
    train = [make_example(rng) for _ in range(args.train)]
    eval_ = [make_example(rng) for _ in range(args.eval)]
    grpo = new_additions(args.grpo, train + eval_, random.Random(1))
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.jsonl", train), ("eval.jsonl", eval_), ("grpo.jsonl", grpo)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    tokenizer = train_tokenizer([r["prompt"] + r["completion"] for r in train], vocab_size=512)
    model_dir = out / "model"
    tokenizer.save_pretrained(model_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.save_pretrained(model_dir)


if __name__ == "__main__":
    main()
