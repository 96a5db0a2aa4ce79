"""Prompt rows (format `prompt`, for training.objective grpo) -> the prompt's ids and the row's other fields.

A prompt is a string (its own ids, as `prompt_completion` renders prompts) or chat turns (the chat template with
the generation prompt, as `llmtune chat` prompts a chat model). No token has a label: what is trained is the
policy's own completion, sampled during training (llmtune.objectives.rollouts). The row's other columns travel as JSON
in `fields`, under the names the reward functions receive (a source's `fields:` renames them, e.g. {answer:
solution}), beside `prompt`, the prompt as the row gives it.
"""

from __future__ import annotations

import json
from typing import Any

from llmtune.data.chat import chat_ids
from llmtune.data.render import IGNORE, DataError, messages_of, render_prompt

RESERVED = frozenset({"prompt", "completion"})  # the keywords every reward function is called with


def render_prompt_row(row: dict[str, Any], renames: dict[str, str], prompt_column: str, tokenizer: Any) -> dict:
    """One source row (its raw columns) -> input_ids (the prompt), labels (none trained), length, fields."""
    prompt = row[prompt_column]
    if prompt is None:
        raise DataError(f"field `{prompt_column}`: missing or null")
    if isinstance(prompt, str):
        ids = render_prompt(prompt, tokenizer)
    else:
        ids = chat_ids(tokenizer, messages_of([prompt] if isinstance(prompt, dict) else prompt), True)
    if not ids:
        raise DataError(f"field `{prompt_column}`: renders to no tokens")
    name_of = {column: name for name, column in renames.items()}
    fields = {name_of.get(column, column): value for column, value in row.items() if column != prompt_column}
    for reserved in RESERVED & set(fields):
        column = next(c for c in row if name_of.get(c, c) == reserved)
        raise DataError(
            f"field `{column}`: reward functions receive `{reserved}` themselves (the sampled {reserved}); give this"
            f" column another name with fields: {{<name>: {column}}}"
        )
    fields["prompt"] = prompt
    return {
        "input_ids": ids,
        "labels": [IGNORE] * len(ids),
        "length": len(ids),
        "n_trained": 0,
        "fields": json.dumps(fields, default=str),
    }
