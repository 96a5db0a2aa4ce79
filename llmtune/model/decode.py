"""Where a reply ends and what pads it: the stop ids of a model and its tokenizer (its generation_config's eos ids, the
tokenizer's eos, a chat template's end-of-turn), shared by `llmtune generate` and GRPO's sampling."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llmtune.data.chat import end_of_turn_ids


def stop_ids(model: Any, tokenizer: Any, chat: bool) -> list[int]:
    """The ids that end a reply: the model's generation_config eos ids, the tokenizer's eos and, for a prompt
    rendered with the chat template, the end-of-turn token that template writes after a reply (a chat model ends its
    reply with it, and it is often not the tokenizer's eos_token; `data.chat.end_of_turn_ids`), deduplicated, in
    that order."""
    config = getattr(model, "generation_config", None)
    ids = [*_as_ids(getattr(config, "eos_token_id", None)), *_as_ids(tokenizer.eos_token_id)]
    if chat:
        ids += end_of_turn_ids(tokenizer)
    return list(dict.fromkeys(ids))


def _as_ids(value: int | Sequence[int] | None) -> list[int]:
    # generation_config.eos_token_id is an int or a list (Gemma-2-it: [1, 107]); a tokenizer's may be None.
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def until_stop(row: list[int], stop: Sequence[int]) -> list[int]:
    """`row` up to (without) its first stop id."""
    return next((row[:k] for k, token in enumerate(row) if token in stop), row)


def pad_id(tokenizer: Any, stop: Sequence[int]) -> int | None:
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return tokenizer.eos_token_id if tokenizer.eos_token_id is not None else next(iter(stop), None)
