"""Rendering: one source row -> `input_ids` + `labels` (-100 = not trained), by the source's format.

* `prompt_completion` tokenises prompt and completion separately and concatenates the ids, so the mask
  boundary is exact and the prompt's ids are those the model sees at inference.
* Alpaca rows (`instruction` [+ `input`] + `output`) become a prompt with the original Alpaca template.
* ShareGPT rows (`conversations` of {from, value}) become `messages` (human -> user, gpt -> assistant).
* Chats are rendered with the tokenizer's chat template (llmtune.data.chat: the whole conversation's ids, each
  assistant turn's text and end-of-turn token trained). A tokenizer without a template gets ChatML (with a
  warning), set on the tokenizer so a saved model renders chats as it was trained.
* `preference` rows become a chosen and a rejected sequence in one example (llmtune.data.pairs).
* The first token of every example has label -100: a causal LM's shifted loss never predicts it from
  inside the example, and in a packed row it would be predicted from the previous example's last token.
"""

from __future__ import annotations

import json
from typing import Any

from llmtune.data.chat import REASONING_KEYS, ChatError, render_chat
from llmtune.errors import UserError
from llmtune.recipe import SourceConfig

IGNORE = -100
FORMAT_FIELDS = {
    "text": ("text",),
    "prompt_completion": ("prompt", "completion"),
    "messages": ("messages",),
    "preference": ("prompt", "chosen", "rejected"),
    "prompt": ("prompt",),
}
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "system": "system",
    "tool": "tool",
}
# The original Stanford Alpaca prompts (github.com/tatsu-lab/stanford_alpaca, train.py).
ALPACA_PROMPT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request."
    "\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)
ALPACA_PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request."
    "\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)


class DataError(UserError, ValueError):
    """Bad training data, found before training: one line naming the file, the row and the field.

    Rows are numbered from 1 in the order the source yields them (a JSON Lines file's line number when
    it has no blank lines; a CSV's data rows after the header).
    """


def resolve_columns(src: SourceConfig, columns: list[str]) -> dict[str, str]:
    """Map llmtune's field names to this source's columns, recognising Alpaca and ShareGPT layouts.

    Returns {llmtune field: column}; for Alpaca the keys are `instruction`, `input` (optional), `completion`.
    """
    unknown = set(src.fields) - set(FORMAT_FIELDS[src.format]) - {"instruction", "input"}
    if unknown and src.format != "prompt":  # a prompt row's other fields are named for its reward functions
        raise DataError(
            f"{src.path}: row 1: field `{sorted(unknown)[0]}`: not a field of format {src.format!r}"
            f" (fields are {', '.join(FORMAT_FIELDS[src.format])})"
        )
    wanted = {name: src.fields.get(name, name) for name in FORMAT_FIELDS[src.format]}
    if src.format == "prompt_completion" and "prompt" not in src.fields and "prompt" not in columns:
        instruction = src.fields.get("instruction", "instruction")
        if instruction in columns:  # Alpaca: instruction [+ input] + output
            wanted = {"instruction": instruction, "completion": src.fields.get("completion", "output")}
            if src.fields.get("input", "input") in columns:
                wanted["input"] = src.fields.get("input", "input")
    if src.format == "messages" and "messages" not in src.fields and "messages" not in columns:
        if "conversations" in columns:  # ShareGPT
            wanted = {"messages": "conversations"}
    if src.format == "preference" and "prompt" not in src.fields and "prompt" not in columns:
        instruction = src.fields.get("instruction", "instruction")
        if instruction in columns:  # alpaca-style: instruction [+ input] + chosen / rejected
            wanted = {k: v for k, v in wanted.items() if k != "prompt"} | {"instruction": instruction}
            if src.fields.get("input", "input") in columns:
                wanted["input"] = src.fields.get("input", "input")
        elif "conversations" in columns:  # sharegpt-style: the conversation so far + a chosen / rejected turn
            wanted["prompt"] = "conversations"
        else:  # chat pairs that share their first turns: the prompt is found (llmtune.data.pairs)
            del wanted["prompt"]
    for name, column in wanted.items():
        if column not in columns:
            hint = f" (map it with fields: {{{name}: <column>}})" if column == name else ""
            raise DataError(f"{src.path}: row 1: field `{column}`: missing; the columns are {', '.join(columns)}{hint}")
    return wanted


def source_fields(src: SourceConfig, columns: list[str]) -> dict[str, str]:
    """resolve_columns, or (when columns are missing) the names it would want, for diagnosing a row."""
    try:
        return resolve_columns(src, columns)
    except DataError:
        return {name: src.fields.get(name, name) for name in FORMAT_FIELDS[src.format]}


def _turn(turn: dict[str, Any]) -> tuple[Any, Any]:
    """(role, content) of an OpenAI-style {role, content} or ShareGPT-style {from, value} turn."""
    role = turn.get("role") if turn.get("role") is not None else turn.get("from")
    content = turn.get("content") if turn.get("content") is not None else turn.get("value")
    return role, content


# Keys of a turn that reach the chat template beside role and content: reasoning, tool calls and their results.
TURN_KEYS = (*REASONING_KEYS, "tool_calls", "tool_call_id", "name")


def check_messages(value: Any) -> str | None:
    if not isinstance(value, list) or not value:
        return f"must be a non-empty list of {{role, content}} turns, got {value!r:.40}"
    for i, turn in enumerate(value):
        if not isinstance(turn, dict):
            return f"turn {i} must be a mapping, got {type(turn).__name__}"
        role, content = _turn(turn)
        if not isinstance(role, str) or role not in SHAREGPT_ROLES:
            return f"turn {i}: role must be one of {', '.join(sorted(SHAREGPT_ROLES))}, got {role!r}"
        if not isinstance(content, str) and not (content is None and turn.get("tool_calls")):
            return f"turn {i}: content must be a string, got {type(content).__name__}"
    return None


def messages_of(value: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """{role, content} turns with ShareGPT roles (human, gpt) mapped to user and assistant; reasoning, tool calls
    and tool results kept (a column's missing keys, None in Arrow, are dropped)."""
    return [
        {
            "role": SHAREGPT_ROLES[role],
            "content": content,
            **{key: turn[key] for key in TURN_KEYS if turn.get(key) is not None},
        }
        for turn, (role, content) in ((turn, _turn(turn)) for turn in value)
    ]


def prompt_layout(src: SourceConfig, columns: dict[str, str]) -> str:
    """How a source's prompts reach the model: `chat` (the chat template), `alpaca` (Stanford Alpaca's template
    around the instruction) or `plain` (the prompt's own ids). A trained model must be prompted the same way."""
    if src.format == "messages":
        return "chat"
    return "alpaca" if "instruction" in columns else "plain"


def alpaca_prompt(instruction: str, input_text: str) -> str:
    if input_text.strip():
        return ALPACA_PROMPT_WITH_INPUT.format(instruction=instruction, input=input_text)
    return ALPACA_PROMPT.format(instruction=instruction)


def _with_eos(ids: list[int], tokenizer: Any) -> list[int]:
    # Some tokenizers already append EOS (add_eos_token); never train two.
    return ids if ids and ids[-1] == tokenizer.eos_token_id else [*ids, tokenizer.eos_token_id]


def _mask_first(labels: list[int]) -> list[int]:
    # The first token is never predicted inside its example; in a packed row it would be predicted
    # from the previous example's last token (loss cross-talk), so it is never trained.
    return [IGNORE, *labels[1:]] if labels else labels


def render_text(text: str, tokenizer: Any) -> tuple[list[int], list[int]]:
    """Raw text: every token trained, EOS appended."""
    ids = _with_eos(list(tokenizer(text, add_special_tokens=True)["input_ids"]), tokenizer)
    return ids, _mask_first(list(ids))


def render_prompt(prompt: str, tokenizer: Any) -> list[int]:
    """The ids of a prompt as `prompt_completion` trains it, and so as the trained model must be prompted."""
    ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if ids and ids[-1] == tokenizer.eos_token_id and len(ids) > 1:
        ids = ids[:-1]  # a tokenizer that appends EOS must not end the prompt with it
    return ids


def render_prompt_completion(
    prompt: str, completion: str, tokenizer: Any, train_on: str
) -> tuple[list[int], list[int]]:
    """Prompt then completion + EOS; the prompt is trained only with train_on=all.

    The two are tokenised separately: the mask boundary is exact and the prompt ids are the ones the
    model is given at inference (joint tokenisation can merge across the boundary).
    """
    prompt_ids = render_prompt(prompt, tokenizer)
    completion_ids = _with_eos(list(tokenizer(completion, add_special_tokens=False)["input_ids"]), tokenizer)
    ids = prompt_ids + completion_ids
    if train_on == "all":
        return ids, _mask_first(list(ids))
    return ids, _mask_first([IGNORE] * len(prompt_ids) + completion_ids)


def render_messages(
    messages: list[dict[str, Any]],
    tokenizer: Any,
    train_on: str,
    train_reasoning: bool = True,
    first_trained: int = 0,
    tools: Any = None,
) -> tuple[list[int], list[int]]:
    """A chat rendered by the tokenizer's template (with the row's `tools` schemas, a list or its JSON text, when it
    has them); with train_on=completion only assistant turns (from index `first_trained` on) are trained, each its
    text and end-of-turn token (llmtune.data.chat)."""
    try:
        tools = json.loads(tools) if isinstance(tools, str) else tools
        ids, trained = render_chat(tokenizer, messages, train_reasoning, first_trained, tools)
    except ChatError as err:
        raise DataError(str(err)) from None
    except json.JSONDecodeError as err:
        raise DataError(f"column `tools`: not JSON ({err.msg})") from None
    if train_on == "all":
        return ids, _mask_first(list(ids))
    return ids, _mask_first([t if m else IGNORE for t, m in zip(ids, trained, strict=True)])
