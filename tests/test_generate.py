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
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from llmtune.cli.main import main

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


def greedy_ids(model, tokenizer, prompt: str) -> list[int]:
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
    return out[0, ids.shape[1] :].tolist()


def greedy(model, tokenizer, prompt: str) -> str:
    return tokenizer.decode(greedy_ids(model, tokenizer, prompt), skip_special_tokens=True).strip()


def cli_generate(capsys, run: Path, *extra: str) -> str:
    capsys.readouterr()
    assert main(["generate", "--run", str(run), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS), *extra]) == 0
    return capsys.readouterr().out.strip()


def cli_chat(capsys, monkeypatch, run: Path) -> tuple[str, str]:
    """`llmtune chat` asked PROMPT once: (the reply, what it said on stderr)."""
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{PROMPT}\n\n"))
    capsys.readouterr()
    assert main(["chat", "--run", str(run), "--max-new-tokens", str(NEW_TOKENS)]) == 0
    captured = capsys.readouterr()
    return captured.out.replace("> ", "").strip(), captured.err


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
    said, told = cli_chat(capsys, monkeypatch, run)
    assert said == expected and "plain prompts" in told


def test_lora_run_on_random_base_loads_with_plain_peft(tiny_recipe, capsys, caplog):
    from peft import AutoPeftModelForCausalLM

    from llmtune.model.adapters import peft_quietly

    run = train(tiny_recipe(model__random_init=True, peft__method="lora", peft__rank=4, peft__alpha=8.0), caplog)
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
    from llmtune.cli.generate import Sampling, answer, batch_answers
    from llmtune.data import render_prompt

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


# ---------------------------------------------------------------- stop ids and device placement

WORD = "Hello"  # one token of the conftest tokenizer


def write_parrot(folder: Path, eos_token_id: int | list[int]) -> Path:
    """A saved tiny Llama (ChatML template, `generation_config.eos_token_id` as given) that says WORD, then
    `<|im_end|>`, then WORD again, and so on, whatever the prompt: a chat model that ends its turn with a token
    other than the tokenizer's eos and, past it, invents more.

    Attention and MLP outputs are zeroed, so the last hidden state is the current token's embedding and the
    model is a bigram table: any token -> WORD -> <|im_end|> -> WORD."""
    write_tiny_model(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    (word,) = tokenizer(WORD, add_special_tokens=False).input_ids
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        embed.zero_()
        head.zero_()
        embed[:, 0] = 1.0
        embed[word, 0], embed[word, 1] = 0.0, 1.0
        embed[end, 0], embed[end, 2] = 0.0, 1.0
        head[word, 0] = head[word, 2] = head[end, 1] = 1.0
    model.generation_config.eos_token_id = eos_token_id
    model.save_pretrained(folder)
    return folder


def test_parrot_runs_past_its_end_of_turn_with_the_tokenizers_eos_alone(tmp_path):
    """The premise of the stop tests below: stopped at the tokenizer's eos only, the parrot fills its budget."""
    folder = write_parrot(tmp_path / "parrot", [2, 5])
    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=tokenizer.eos_token_id)
    assert tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True) == WORD * (NEW_TOKENS // 2)


def test_replies_stop_at_each_stop_id_of_the_generation_config(tmp_path, capsys, monkeypatch):
    """Llama-3-Instruct / Gemma-2-it / Qwen: generation_config.json lists the end-of-turn token beside the eos;
    generate, chat, and prompts rendered with the chat template or plain, one by one or batched, stop there."""
    from llmtune.cli.generate import Sampling, batch_answers, load_run, prompt_ids, reply

    folder = write_parrot(tmp_path / "parrot", [2, 5])  # [</s>, <|im_end|>]
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == [2, 5]
    got = {"llmtune generate": cli_generate(capsys, folder), "llmtune chat": cli_chat(capsys, monkeypatch, folder)[0]}

    sampling = Sampling(max_new_tokens=NEW_TOKENS)
    budgets = [NEW_TOKENS, 1, NEW_TOKENS, 2, NEW_TOKENS, NEW_TOKENS]
    for chat in (True, False):
        run = load_run(folder, chat=chat)
        got[f"reply, chat={chat}"] = reply(run, [{"role": "user", "content": PROMPT}], sampling)
        prompts = [prompt_ids(run, [{"role": "user", "content": PROMPT[:n]}]) for n in (3, 9, len(PROMPT))] * 2
        assert len({len(p) for p in prompts}) > 1
        for k, text in enumerate(batch_answers(run.model, run.tokenizer, prompts, budgets, batch_size=2)):
            got[f"batch_answers row {k}, chat={chat}"] = text
    assert got == dict.fromkeys(got, WORD)


def test_chat_reply_stops_at_the_templates_end_of_turn(tmp_path):
    """A model whose generation_config knows only </s>, prompted with a ChatML template (llmtune's fallback for a
    base model trained on chats): the reply ends at the template's <|im_end|>. Plain prompts never saw the
    template, so their stops stay the model's own."""
    from llmtune.cli.generate import Sampling, answer, batch_answers, load_run, prompt_ids, reply

    run = load_run(write_parrot(tmp_path / "parrot", 2), chat=True)
    messages = [{"role": "user", "content": PROMPT}]
    sampling = Sampling(max_new_tokens=NEW_TOKENS)
    assert reply(run, messages, sampling) == WORD
    ids = prompt_ids(run, messages)
    assert answer(run.model, run.tokenizer, ids, sampling, chat=True) == WORD
    assert batch_answers(run.model, run.tokenizer, [ids, ids], [NEW_TOKENS, 3], chat=True) == [WORD, WORD]
    assert answer(run.model, run.tokenizer, ids, sampling) == WORD * (NEW_TOKENS // 2)


def test_stop_ids_gather_the_models_the_tokenizers_and_the_templates(tokenizer):
    from types import SimpleNamespace

    from llmtune.model.decode import stop_ids

    def model(eos):
        return SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=eos))

    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_id == 2 and end == 5
    assert stop_ids(model(2), tokenizer, chat=False) == [2]  # the old behaviour where eos is the only one
    assert stop_ids(model(None), tokenizer, chat=False) == [2]
    assert stop_ids(model([7, 2, 7]), tokenizer, chat=False) == [7, 2]  # Gemma-2-it style list, order kept
    assert stop_ids(model([2, 5]), tokenizer, chat=True) == [2, 5]
    assert stop_ids(model(2), tokenizer, chat=True) == [2, 5]  # ChatML's <|im_end|>
    assert stop_ids(SimpleNamespace(), tokenizer, chat=True) == [2, 5]  # no generation_config at all
    # Llama-3's and Gemma's markers in a template, unknown to this tokenizer (its unk): not stop ids.
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}<|eot_id|><end_of_turn>{% endfor %}"
    assert stop_ids(model(2), tokenizer, chat=True) == [2]


@pytest.mark.parametrize("cuda", [True, False])
def test_load_run_moves_the_model_to_the_gpu_when_there_is_one(tmp_path, monkeypatch, cuda):
    from transformers import LlamaForCausalLM

    from llmtune.cli.generate import load_run

    folder = write_parrot(tmp_path / "parrot", 2)
    asked: list[torch.device] = []

    def to(self, *args, **kwargs):  # records the device asked for; this machine may have no GPU to move to
        device = kwargs.get("device", args[0] if args else None)
        if isinstance(device, str | torch.device):
            asked.append(torch.device(device))
        return self

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(LlamaForCausalLM, "to", to)
    run = load_run(folder)
    assert [d.type for d in asked] == (["cuda"] if cuda else [])
    assert isinstance(run.model, LlamaForCausalLM)


# ---------------------------------------------------------------- prompt layouts (generate, chat and the eval script)

ROOT = Path(__file__).resolve().parents[1]


def eval_accuracy(monkeypatch, capsys, model: Path, rows: list[dict[str, str]], data: Path, *args: str) -> str:
    """scripts/eval_accuracy.py run in this process (as `make train` runs it): its first line of output, or all of
    it where `args` asks for more."""
    import runpy
    import sys

    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # as `python scripts/eval_accuracy.py` has it
    monkeypatch.setattr(sys, "argv", ["eval_accuracy.py", "--model", str(model), "--data", str(data), *args])
    capsys.readouterr()
    runpy.run_path(str(ROOT / "scripts" / "eval_accuracy.py"), run_name="__main__")
    out = capsys.readouterr().out
    return out if args else out.splitlines()[0]


def test_eval_against_a_baseline_gives_the_change_with_its_paired_error_bar(tmp_path, tiny_model_dir, monkeypatch,
                                                                            capsys):  # fmt: skip
    """`--against` scores a second model on the same questions and reports the change question by question (how
    `make train-grpo` reports GRPO against the SFT model): the parrot answers the first question right, the untrained
    model neither, so the change is +1 of 2 and its paired standard error std([1, 0]) / sqrt(2) = 50%."""
    parrot = write_parrot(tmp_path / "parrot", [2, 5])
    rows = [{"prompt": PROMPT, "completion": WORD}, {"prompt": PROMPT, "completion": " fox"}]
    out = eval_accuracy(monkeypatch, capsys, parrot, rows, tmp_path / "eval.jsonl", "--against", str(tiny_model_dir))
    assert out.splitlines()[0] == "exact-match accuracy on 2 eval rows: 50.0% +/- 35.4%"
    assert f"against {tiny_model_dir}:\nexact-match accuracy on 2 eval rows: 0.0% +/- 0.0%" in out
    assert out.splitlines()[-1] == "  tell     +50.0% +/- 50.0%  (2 rows)"


def test_a_run_trained_on_alpaca_rows_is_prompted_in_the_alpaca_layout(tiny_recipe, tiny_data, tmp_path, capsys,
                                                                      monkeypatch, caplog):  # fmt: skip
    """Alpaca rows train on Stanford Alpaca's template around the instruction: the run records that layout in
    final/, and generate, chat and the eval script prompt with it (they gave the bare instruction)."""
    from llmtune.data import alpaca_prompt

    rows = [json.loads(line) for line in tiny_data.read_text().splitlines()]
    alpaca = tmp_path / "alpaca.jsonl"
    alpaca.write_text("".join(json.dumps({"instruction": r["prompt"], "output": r["completion"]}) + "\n" for r in rows))
    run = train(tiny_recipe(data__train=[{"path": str(alpaca)}], data__max_length=160), caplog)
    final = run / "final"
    assert json.loads((final / "prompt_layout.json").read_text()) == {"layout": "alpaca"}
    model, tokenizer = AutoModelForCausalLM.from_pretrained(final), AutoTokenizer.from_pretrained(final)
    expected = greedy(model, tokenizer, alpaca_prompt(PROMPT, ""))
    assert expected and expected != greedy(model, tokenizer, PROMPT), "the layout must change the answer"

    assert cli_generate(capsys, run) == expected
    said, told = cli_chat(capsys, monkeypatch, run)
    assert said == expected and "Alpaca-templated prompts" in told
    # Scored by the eval script, whose budget is the completion's length + 2 tokens: the saved generation_config
    # lists a stop id beside </s> (as an instruct model lists its end of turn), the token after the first one in
    # which the Alpaca-prompted answer and the plain one differ, so the answer ends there.
    got, plain = greedy_ids(model, tokenizer, alpaca_prompt(PROMPT, "")), greedy_ids(model, tokenizer, PROMPT)
    part = next(k for k, (a, b) in enumerate(zip(got, plain, strict=True)) if a != b)
    answer, stop = got[: part + 1], got[part + 1]
    assert stop not in answer
    config = json.loads((final / "generation_config.json").read_text())
    config["eos_token_id"] = [tokenizer.eos_token_id, stop]
    (final / "generation_config.json").write_text(json.dumps(config))
    rows = [{"prompt": PROMPT, "completion": tokenizer.decode(answer)}]
    got = eval_accuracy(monkeypatch, capsys, final, rows, tmp_path / "eval.jsonl")
    assert got == "exact-match accuracy on 1 eval rows: 100.0% +/- 0.0%"


@pytest.mark.parametrize("eos", [[2, 5], 2])
def test_eval_prompts_an_instruct_model_with_its_chat_template_and_stops_at_each_stop_id(tmp_path, monkeypatch,
                                                                                        capsys, eos):  # fmt: skip
    """An instruct model (a chat template, no recipe beside it; generation_config's stop ids [</s>, <|im_end|>] or
    </s> alone) is scored as `llmtune generate` answers it: prompted with its template, its reply ends at the
    template's end of turn (plain prompts and the tokenizer's eos alone ran on into the next turn)."""
    folder = write_parrot(tmp_path / "parrot", eos)
    rows = [{"prompt": PROMPT, "completion": WORD}, {"prompt": "hello", "completion": f" {WORD} "}]
    got = eval_accuracy(monkeypatch, capsys, folder, rows, tmp_path / "eval.jsonl")
    assert got == "exact-match accuracy on 2 eval rows: 100.0% +/- 0.0%"


# A base model that ships its own modelling code (config.json's auto_map): loading it with trust_remote_code runs this
# file, which leaves a mark where the test says.
CUSTOM_CODE = """
import os, pathlib
pathlib.Path(os.environ["LLMTUNE_TEST_CODE_RAN"]).write_text("ran")
from transformers import LlamaConfig, LlamaForCausalLM
class CustomConfig(LlamaConfig):
    model_type = "custom_llama"
class CustomLlamaForCausalLM(LlamaForCausalLM):
    config_class = CustomConfig
"""


def shared_run_with_code(tmp_path: Path, tiny_model_dir: Path) -> Path:
    """A LoRA run folder as a stranger could share it: its base ships a .py file, and its recipe.yaml says
    `trust_remote_code: true` (a folder's own word, which must not make llmtune run that file)."""
    import shutil

    import yaml
    from peft import LoraConfig, get_peft_model

    base = tmp_path / "base-with-code"
    shutil.copytree(tiny_model_dir, base)
    (base / "custom_llama.py").write_text(CUSTOM_CODE)
    config = json.loads((base / "config.json").read_text())
    # A model type transformers does not know: only the folder's code can load it.
    config["model_type"] = "custom_llama"
    config["auto_map"] = {
        "AutoConfig": "custom_llama.CustomConfig",
        "AutoModelForCausalLM": "custom_llama.CustomLlamaForCausalLM",
    }
    (base / "config.json").write_text(json.dumps(config))
    run = tmp_path / "shared-run"
    lora = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(r=2, target_modules=["q_proj"])
    )
    lora.save_pretrained(run / "final")
    adapter_config = json.loads((run / "final" / "adapter_config.json").read_text())
    (run / "final" / "adapter_config.json").write_text(
        json.dumps({**adapter_config, "base_model_name_or_path": str(base)})
    )
    (run / "recipe.yaml").write_text(yaml.safe_dump({"model": {"name_or_path": str(base), "trust_remote_code": True}}))
    return run


def test_a_run_folder_cannot_opt_itself_into_running_its_code(tiny_model_dir, tmp_path, capsys, monkeypatch):
    ran = tmp_path / "code-ran"
    monkeypatch.setenv("LLMTUNE_TEST_CODE_RAN", str(ran))
    run = shared_run_with_code(tmp_path, tiny_model_dir)
    for argv in (
        ["generate", "--run", str(run), "--prompt", PROMPT, "--max-new-tokens", "2"],
        ["merge", "--run", str(run), "--out", str(tmp_path / "merged")],
    ):
        assert main(argv) == 2
        (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("llmtune: error:")]
        assert "base-with-code" in line and "--trust-remote-code" in line
    assert not ran.exists() and not (tmp_path / "merged").exists()

    # The user's own flag is what lets it run.
    assert (
        main(["generate", "--run", str(run), "--prompt", PROMPT, "--max-new-tokens", "2", "--trust-remote-code"]) == 0
    )
    assert ran.read_text() == "ran"


def test_a_system_prompt_opens_the_conversation_in_generate_and_chat(tmp_path, capsys, monkeypatch):
    """`--system` (generate, chat) and `/system` (chat) put a system turn first, rendered by the run's chat template
    as training rendered chats with one; a run trained on plain prompts refuses it in one line rather than drop it."""
    import llmtune.cli.generate as generate
    from llmtune.data.chat import chat_ids

    folder = write_parrot(tmp_path / "parrot", [2, 5])
    prompted: list[list[int]] = []
    real_answer = generate.answer

    def answer(model, tokenizer, ids, *args, **kwargs):  # what the model is prompted with, then the real answer
        prompted.append(ids)
        return real_answer(model, tokenizer, ids, *args, **kwargs)

    monkeypatch.setattr(generate, "answer", answer)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    system, user = {"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}
    expected = chat_ids(tokenizer, [system, user], add_generation_prompt=True)

    assert cli_generate(capsys, folder, "--system", "Be brief.") == WORD
    monkeypatch.setattr("sys.stdin", io.StringIO(f"/system Be brief.\n{PROMPT}\n\n"))
    assert main(["chat", "--run", str(folder), "--max-new-tokens", str(NEW_TOKENS)]) == 0
    assert prompted == [expected, expected]
    assert "Be brief." in tokenizer.decode(expected)

    plain = generate.LoadedRun(model=None, tokenizer=tokenizer, chat=False, folder=folder)
    with pytest.raises(generate.GenerateError, match="--system: .* plain prompts"):
        generate.system_turn(plain, "Be brief.")
