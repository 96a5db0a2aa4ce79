"""Chats through the official chat templates of the families people fine-tune, on their real tokenizers (built from
registry packages by tests/real_tokenizers.py): the ids are the template's rendering of the whole conversation, and
the trained tokens are each assistant turn's text and the end-of-turn token after it, nothing else.

The expectations come from transformers' own `apply_chat_template` and from each family's end-of-turn token as its
model card names it (`END_OF_TURN`), never from llmtune's locating code.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from llmtune.data.chat import end_of_turn_ids
from llmtune.data.render import IGNORE, render_messages
from llmtune.model.decode import stop_ids
from tests.real_tokenizers import CHATS, END_OF_TURN, TEMPLATES, TOOL_CHATS, TOOLS, real_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.real]  # the first run builds the tokenizers (~2 min); later, loads

PLAIN = ("system", "no_system", "echo", "short", "whitespace")
_loaded: dict[str, object] = {}


def tokenizer_of(name: str):
    if name not in _loaded:
        _loaded[name] = real_tokenizer(name)
    return _loaded[name]


def end_of(name: str, last: bool) -> str:
    # gpt-oss closes a conversation's final answer with <|return|> and every earlier message with <|end|>.
    return "<|return|>" if name == "gpt-oss" and last else END_OF_TURN[name]


def folded(messages: list[dict]) -> list[dict]:
    """The system turn inside the first user turn: what a template that refuses system turns is given."""
    system, user, *rest = messages
    return [{**user, "content": f"{system['content']}\n\n{user['content']}"}, *rest]


def expected_ids(tokenizer, messages: list[dict], tools=None) -> tuple[list[int], list[dict]]:
    try:
        out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True)
    except Exception:  # Gemma-2 raises on a system turn
        if messages[0]["role"] != "system":
            raise
        messages = folded(messages)
        out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True)
    return list(out["input_ids"]), messages


def trained_runs(tokenizer, ids: list[int], labels: list[int]) -> list[str]:
    """The decoded stretches of consecutive trained tokens."""
    runs, run = [], []
    for token, label in zip(ids, labels, strict=True):
        if label != IGNORE:
            run.append(token)
        elif run:
            runs.append(run)
            run = []
    return [tokenizer.decode(r) for r in [*runs, run] if r]


def shown(content: str) -> tuple[str, ...]:
    # As the template writes it: as given, or trimmed (Llama 3, Gemma, Qwen3.5 trim).
    return (content, content.strip(), content.lstrip("\n"), content.rstrip())


@pytest.mark.parametrize("chat", PLAIN)
@pytest.mark.parametrize("name", TEMPLATES)
def test_a_chat_renders_as_the_template_does_and_trains_each_answer_and_its_end_of_turn(name, chat, caplog):
    tokenizer = tokenizer_of(name)
    messages = CHATS[chat]
    want_ids, given = expected_ids(tokenizer, messages)
    with caplog.at_level(logging.WARNING, logger="llmtune.data.chat"):
        ids, labels = render_messages(messages, tokenizer, "completion")
    assert ids == want_ids
    if given is not messages:  # folded: the template refused the system turn, and the log says so (once per template)
        assert name == "gemma-2"
    answers = [(t["content"], k == len(given) - 1) for k, t in enumerate(given) if t["role"] == "assistant"]
    runs = trained_runs(tokenizer, ids, labels)
    assert len(runs) == len(answers), runs
    for run, (content, last) in zip(runs, answers, strict=True):
        # The leading whitespace of a decoded stretch depends on the tokenizer (SentencePiece's prefix space); what
        # follows the end-of-turn token (the template's newline, the next header) must not be there.
        assert any(run.lstrip() == (c + end_of(name, last)).lstrip() for c in shown(content)), (run, content)


def test_the_templates_that_refuse_a_system_turn_are_said_once(caplog):
    tokenizer = real_tokenizer("gemma-2")
    with caplog.at_level(logging.WARNING, logger="llmtune.data.chat"):
        render_messages(CHATS["system"], tokenizer, "completion")
        render_messages(CHATS["echo"], tokenizer, "completion")
    said = [r for r in caplog.records if "refuses a system turn" in r.getMessage()]
    assert len(said) <= 1  # once per template and process: an earlier test may have said it already


def reasoning_of(turn: dict) -> str | None:
    if turn.get("reasoning_content"):
        return turn["reasoning_content"]
    content = turn["content"]
    return content.split("</think>")[0].split("<think>")[-1].strip() if "</think>" in content else None


@pytest.mark.parametrize("chat", ["reasoning", "inline_think"])
@pytest.mark.parametrize("name", TEMPLATES)
def test_reasoning_is_trained_as_the_template_renders_it_or_kept_as_context(name, chat):
    tokenizer = tokenizer_of(name)
    messages = CHATS[chat]
    try:
        ids, labels = render_messages(messages, tokenizer, "completion", train_reasoning=True)
    except Exception as err:  # the template cannot render this conversation at all
        pytest.skip(f"{name} does not render {chat}: {err}")
    text = tokenizer.decode(ids)
    trained = "".join(trained_runs(tokenizer, ids, labels))
    answers = [t for t in messages if t["role"] == "assistant"]
    for turn in answers:
        thought = reasoning_of(turn)
        # Whatever reasoning the template renders is trained; what it drops (earlier turns in Qwen3, all in the R1
        # distills) is not invented.
        assert (thought in trained) == (thought in text), (thought, trained)
    _, labels_off = render_messages(messages, tokenizer, "completion", train_reasoning=False)
    runs_off = trained_runs(tokenizer, ids, labels_off)
    assert len(runs_off) == len(answers)
    for run, turn in zip(runs_off, answers, strict=True):
        answer = turn["content"].split("</think>")[-1]
        assert reasoning_of(turn) not in run
        assert any(run.lstrip() == (c + end_of(name, turn is answers[-1])).lstrip() for c in shown(answer)), run


@pytest.mark.parametrize("name", TEMPLATES)
def test_tool_calls_and_tool_turns_pass_through_as_the_template_renders_them(name):
    tokenizer = tokenizer_of(name)
    (chat,) = TOOL_CHATS
    messages = CHATS[chat]
    try:
        want_ids, given = expected_ids(tokenizer, messages, TOOLS)
    except Exception as err:
        pytest.skip(f"{name}'s template does not render tool calls: {str(err)[:80]}")
    ids, labels = render_messages(given, tokenizer, "completion", tools=TOOLS)
    assert ids == want_ids
    runs = trained_runs(tokenizer, ids, labels)
    text = tokenizer.decode(ids)
    answers = [t["content"] for t in given if t["role"] == "assistant" and t["content"]]
    if "get_weather" in text:
        (call,) = [run for run in runs if "get_weather" in run]
        assert "Paris" in call  # the call's arguments are trained with its name
        assert len(runs) == len(answers) + 1
        k = next(k for k, turn in enumerate(given) if turn.get("tool_calls"))
        prompt = tokenizer.apply_chat_template(given[:k], tools=TOOLS, add_generation_prompt=True, return_dict=True)
        prompt = list(prompt["input_ids"])
        if ids[: len(prompt)] == prompt:  # where the model starts writing the call, for a template that renders so
            first = next(i for i, label in enumerate(labels) if label != IGNORE and i >= len(prompt) - 1)
            assert first == len(prompt), tokenizer.decode(ids[len(prompt) : first + 1])
    else:  # Phi-3's and SmolLM2's templates drop tool calls: nothing of them to train
        assert len(runs) == len(answers)
    assert not any("temperature_c" in run for run in runs)  # the tool's output is never trained
    assert runs[-1].lstrip() == ("You are welcome." + end_of(name, True)).lstrip()


@pytest.mark.parametrize("name", TEMPLATES)
def test_prompts_and_stops_come_from_the_template(name):
    """What `generate`, `chat`, GRPO and the eval prompt with, and where they stop, for each family."""
    from llmtune.cli.generate import LoadedRun, prompt_ids

    tokenizer = tokenizer_of(name)
    end = tokenizer.convert_tokens_to_ids(end_of(name, last=True))
    assert end_of_turn_ids(tokenizer) == [end]
    no_config = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=None))
    assert end in stop_ids(no_config, tokenizer, chat=True)
    question = CHATS["no_system"][:3]
    run = LoadedRun(model=None, tokenizer=tokenizer, chat=True, folder=Path("."))
    want = tokenizer.apply_chat_template(question, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert prompt_ids(run, question) == list(want["input_ids"])
