"""`llmtune generate` and `llmtune chat` on tiny trained runs (a full fine-tune and a LoRA run on a randomly
initialised base), checked against plain transformers / peft loading and greedy `model.generate`."""

from __future__ import annotations

import io
import json
import logging
import warnings
from pathlib import Path

import pytest
import torch
from conftest import write_tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from llmtune.cli import main

PROMPT = "tell me the quick"
NEW_TOKENS = 8


def train(recipe: Path, caplog) -> Path:
    """Train through the CLI; a normal run says first where its outputs go and shows no third-party warnings."""
    caplog.set_level(logging.INFO)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["train", "--recipe", str(recipe)]) == 0
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    out = recipe.parent / "run"
    assert caplog.records[0].getMessage().startswith(f"llmtune run -> {out.resolve()} ")
    return out


def greedy(model, tokenizer, prompt: str) -> str:
    """What a user gets from plain transformers: the prompt ids as training saw them, greedy decoding."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    model.eval()
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


def cli_generate(capsys, run: Path, *extra: str) -> str:
    capsys.readouterr()
    assert main(["generate", "--run", str(run), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS), *extra]) == 0
    return capsys.readouterr().out.strip()


def test_generate_and_chat_answer_as_plain_transformers(tiny_recipe, tmp_path, capsys, monkeypatch, caplog):
    # Tied embeddings and a checkpoint: accelerate's "Removed shared tensor" notice must not reach the user.
    tied = write_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    run = train(tiny_recipe(model__name_or_path=str(tied), checkpoint__every_n_steps=2), caplog)
    final = run / "final"
    expected = greedy(AutoModelForCausalLM.from_pretrained(final), AutoTokenizer.from_pretrained(final), PROMPT)
    assert expected, "an empty answer would make the comparison meaningless"
    assert cli_generate(capsys, run) == expected
    assert cli_generate(capsys, final) == expected  # final/ itself works too

    # Sampling is reproducible with a seed and is not the greedy answer's code path.
    sampled = cli_generate(capsys, run, "--temperature", "5.0", "--seed", "3")
    assert sampled == cli_generate(capsys, run, "--temperature", "5.0", "--seed", "3")

    # chat streams the same greedy reply; the run trained on prompts, so it is prompted with plain prompts
    # although this tokenizer has a chat template.
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{PROMPT}\n\n"))
    capsys.readouterr()
    assert main(["chat", "--run", str(run), "--max-new-tokens", str(NEW_TOKENS)]) == 0
    captured = capsys.readouterr()
    assert captured.out.replace("> ", "").strip() == expected
    assert "plain prompts" in captured.err


def test_lora_run_on_random_base_loads_with_plain_peft(tiny_recipe, capsys, caplog):
    from peft import AutoPeftModelForCausalLM

    from llmtune.model import peft_quietly

    run = train(tiny_recipe(peft__method="lora", peft__rank=4, peft__alpha=8.0), caplog)
    final = run / "final"
    adapter_config = json.loads((final / "adapter_config.json").read_text())
    assert Path(adapter_config["base_model_name_or_path"]) == (final / "base").resolve()

    with peft_quietly():
        model = AutoPeftModelForCausalLM.from_pretrained(final)  # the way peft's docs load an adapter
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b), "the adapter trained (B starts at zero)"
    expected = greedy(model, AutoTokenizer.from_pretrained(final), PROMPT)
    assert expected
    assert cli_generate(capsys, run) == expected  # llmtune loads the same adapter, unmerged

    # ... and merges it from final/base/ as before.
    assert main(["merge", "--run", str(run)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(run / "merged")
    assert greedy(merged, AutoTokenizer.from_pretrained(run / "merged"), PROMPT) == expected


@pytest.mark.parametrize("args", [["--prompt", "x"], []])
def test_generate_and_chat_refuse_a_folder_that_is_not_a_run(tmp_path, capsys, args):
    command = "generate" if args else "chat"
    assert main([command, "--run", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path) in err and "not a run's output_dir" in err and "Traceback" not in err


def test_batch_answers_batched_equal_answer_row_by_row():
    """The on-policy pair script answers thousands of questions with `batch_answers`; each answer must be the one
    `answer` (and so eval_accuracy.py) gives that prompt alone: prompts of several lengths, per-row token budgets,
    and rows that end at EOS before their budget while others in the batch go on."""
    from llmtune.data import render_prompt
    from llmtune.generate import Sampling, answer, batch_answers

    root = Path(__file__).resolve().parents[1] / "assets" / "quickstart"
    tokenizer = AutoTokenizer.from_pretrained(root / "model")  # the quickstart's, shipped with the repo
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # a random model rarely says EOS; a larger EOS row makes some rows stop early
        model.lm_head.weight[tokenizer.eos_token_id] *= 20
    rows = [json.loads(line) for line in (root / "train.jsonl").read_text().splitlines()[:24]]
    prompts = [render_prompt(r["prompt"], tokenizer) for r in rows]
    budgets = [2 + i % 5 for i in range(len(rows))]
    got = batch_answers(model, tokenizer, prompts, budgets, batch_size=4)
    assert got == [
        answer(model, tokenizer, p, Sampling(max_new_tokens=b)) for p, b in zip(prompts, budgets, strict=True)
    ]
    assert len({len(p) for p in prompts}) > 1
    early = [
        tokenizer.eos_token_id in model.generate(torch.tensor([p]), max_new_tokens=b, do_sample=False)[0, len(p) :]
        for p, b in zip(prompts, budgets, strict=True)
    ]
    assert 0 < sum(early) < len(rows), "some rows end at EOS, some at their budget"
