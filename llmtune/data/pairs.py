"""Preference rows -> a chosen and a rejected sequence, tokenised, masked and stored as one example.

A row gives a prompt and two completions, as strings or as chat turns:

* strings: `prompt`, `chosen`, `rejected` (alpaca-style `instruction` [+ `input`] in place of `prompt`);
* chat, explicit prompt: `prompt` a list of turns (or a string: one user turn), `chosen` / `rejected` the
  assistant turn(s) that follow (a list of turns, one turn, or a string);
* chat, shared prefix: no `prompt`; `chosen` and `rejected` are whole conversations that share their
  first turns, which are found (and must end in a user turn, with each side adding assistant turns);
* sharegpt-style (LLaMA-Factory): `conversations` of {from, value} turns as the prompt, `chosen` /
  `rejected` as one {from: gpt, value} turn.

The example stores the two sequences back to back, chosen first: `input_ids` / `labels` / `position_ids`
with position ids restarting at 0 for the rejected sequence, so packing (data.pack) keeps the two apart
exactly as it keeps SFT examples apart, and `preference.sequence_logps` finds them again by their
position ids. Only completion tokens have labels (loss only on the completions).
"""

from __future__ import annotations

from typing import Any

from llmtune.data.render import (
    IGNORE,
    DataError,
    alpaca_prompt,
    check_messages,
    messages_of,
    render_messages,
    render_prompt_completion,
)

SIDES = ("chosen", "rejected")
PAIR_FIELDS = ("prompt", *SIDES)


def check_pair_value(name: str, value: Any) -> str | None:
    """A problem with one field of a preference row, or None (prompt may be absent: chat pairs share it)."""
    if name == "prompt" and value is None:
        return None
    if value is None:
        return "missing or null"
    if isinstance(value, str):
        return None if value.strip() else "is empty"
    if isinstance(value, dict):  # sharegpt-style single turn
        return check_messages([value])
    if isinstance(value, list):
        return check_messages(value)
    return f"must be a string or chat turns, got {type(value).__name__} {value!r:.40}"


def _turns(value: Any, role: str) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return messages_of([value] if isinstance(value, dict) else value)


def render_pair(
    values: dict[str, Any], columns: dict[str, str], tokenizer: Any, train_reasoning: bool = True
) -> dict[str, Any]:
    """One preference row (values keyed by llmtune field) -> the example (see the module docstring)."""
    prompt = values.get("prompt")
    if "instruction" in columns:
        prompt = alpaca_prompt(values["instruction"], values.get("input") or "")
    chosen, rejected = values["chosen"], values["rejected"]
    if all(isinstance(v, str) for v in (prompt, chosen, rejected)):
        sequences = [render_prompt_completion(prompt, side, tokenizer, "completion") for side in (chosen, rejected)]
    else:
        sequences = _render_chat_pair(prompt, chosen, rejected, columns, tokenizer, train_reasoning)
    for (_, labels), side in zip(sequences, SIDES, strict=True):
        if all(label == IGNORE for label in labels):
            raise DataError(f"field `{columns[side]}`: renders to zero trained tokens")
    (c_ids, c_labels), (r_ids, r_labels) = sequences
    return {
        "input_ids": c_ids + r_ids,
        "labels": c_labels + r_labels,
        "position_ids": list(range(len(c_ids))) + list(range(len(r_ids))),
        "length": len(c_ids) + len(r_ids),
        "n_trained": sum(1 for label in c_labels + r_labels if label != IGNORE),
    }


def _render_chat_pair(
    prompt: Any, chosen: Any, rejected: Any, columns: dict[str, str], tokenizer: Any, train_reasoning: bool
) -> list[tuple[list[int], list[int]]]:
    chosen_turns, rejected_turns = _turns(chosen, "assistant"), _turns(rejected, "assistant")
    if prompt is None:
        prompt_turns = _shared_prefix(chosen_turns, rejected_turns, columns)
        chosen_turns, rejected_turns = chosen_turns[len(prompt_turns) :], rejected_turns[len(prompt_turns) :]
    else:
        prompt_turns = _turns(prompt, "user")
    for turns, side in ((chosen_turns, "chosen"), (rejected_turns, "rejected")):
        if not turns or any(t["role"] != "assistant" for t in turns):
            raise DataError(f"field `{columns[side]}`: must continue the prompt with assistant turns only")
    # The prompt's own assistant turns (earlier rounds) are context, not the completion being compared.
    first = len(prompt_turns)
    return [
        render_messages(prompt_turns + turns, tokenizer, "completion", train_reasoning, first)
        for turns in (chosen_turns, rejected_turns)
    ]


def _shared_prefix(chosen: list[dict[str, str]], rejected: list[dict[str, str]], columns: dict[str, str]) -> list:
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if n == 0:
        raise DataError(f"field `{columns['chosen']}`: no `prompt` and the two conversations share no first turn")
    if chosen[n - 1]["role"] != "user":
        # Stepping back to the last user turn keeps a shared assistant opening inside both completions.
        while n and chosen[n - 1]["role"] != "user":
            n -= 1
        if n == 0:
            raise DataError(f"field `{columns['chosen']}`: the shared turns hold no user turn to use as the prompt")
    return chosen[:n]


def truncate_pair(row: dict[str, Any], max_length: int) -> dict[str, Any]:
    """`overlong: truncate` for a pair (max_length bounds the pair): each sequence cut to max_length // 2
    tokens. A side left with no trained token makes n_trained 0, so the pair is dropped and counted."""
    split = row["position_ids"].index(0, 1)
    cut = max_length // 2
    sides = [(row["input_ids"][a:b][:cut], row["labels"][a:b][:cut]) for a, b in ((0, split), (split, row["length"]))]
    trained = [sum(1 for label in labels if label != IGNORE) for _, labels in sides]
    (c_ids, c_labels), (r_ids, r_labels) = sides
    return {
        "input_ids": c_ids + r_ids,
        "labels": c_labels + r_labels,
        "position_ids": list(range(len(c_ids))) + list(range(len(r_ids))),
        "length": len(c_ids) + len(r_ids),
        "n_trained": sum(trained) if all(trained) else 0,
    }
