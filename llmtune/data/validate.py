"""Row validation: the first problem with one source row's values, before anything renders it.

Pure, and shared by tokenising (`llmtune.data.tokenise`) and by diagnosing a file the reader refused
(`llmtune.data.load`), so both name the same field with the same words.
"""

from __future__ import annotations

from typing import Any

from llmtune.data.pairs import PAIR_FIELDS, check_pair_value
from llmtune.data.render import check_messages


def check_row(values: dict[str, Any], columns: dict[str, str]) -> tuple[str, str] | None:
    """First (column, problem) of a row's values keyed by llmtune field, or None."""
    for name, column in columns.items():
        value = values.get(name)
        if name in PAIR_FIELDS:
            problem = check_pair_value(name, value)
            if problem:
                return column, problem
            continue
        if name == "input":  # Alpaca's input is optional
            if value is not None and not isinstance(value, str):
                return column, f"must be a string, got {type(value).__name__}"
            continue
        if value is None:
            return column, "missing or null"
        if name == "messages":
            problem = check_messages(value)
            if problem:
                return column, problem
        elif not isinstance(value, str):
            return column, f"must be a string, got {type(value).__name__} {value!r:.40}"
        elif not value.strip():
            return column, "is empty"
    return None
