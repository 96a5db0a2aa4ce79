"""Reward functions a GRPO recipe can name (`grpo.rewards: [{function: llmtune.rewards:exact_match}]`).

A reward function is called once per completion with keywords: `prompt` (as the row gives it), `completion`
(the decoded text, up to its stop token) and every other field of the row (renamed by the source's `fields:`), and
returns a number. Your own live in any importable module: `function: my_rewards:has_format`.
"""

from __future__ import annotations

from typing import Any


def exact_match(prompt: Any, completion: str, answer: Any = None, **fields: Any) -> float:
    """1.0 when the completion is the row's `answer` (surrounding whitespace ignored), else 0.0."""
    if answer is None:
        raise KeyError(
            "the row has no `answer` field; name the column holding the answer with the source's"
            f" fields: {{answer: <column>}} (its fields are {', '.join(sorted(fields)) or 'none'})"
        )
    return float(completion.strip() == str(answer).strip())
