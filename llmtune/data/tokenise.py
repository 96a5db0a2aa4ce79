"""Tokenising: one loaded source -> `input_ids`, `labels` (-100 = not trained), `length`, `n_trained`.

Every row is validated (`llmtune.data.validate`) and rendered by its format (`llmtune.data.render`,
`llmtune.data.pairs`) with `datasets.map`, which caches the result by fingerprint: a second run, or another
process waiting behind `main_process_first`, reads the cache. Then the length policy (`overlong: truncate |
drop`) applies, counting every row it truncates or drops.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np

from llmtune.data.load import load_source
from llmtune.data.pairs import render_pair, truncate_pair
from llmtune.data.prompts import render_prompt_row
from llmtune.data.render import (
    IGNORE,
    DataError,
    alpaca_prompt,
    messages_of,
    prompt_layout,
    render_messages,
    render_prompt_completion,
    render_text,
    resolve_columns,
)
from llmtune.data.validate import check_row
from llmtune.recipe import DataConfig, SourceConfig

logger = logging.getLogger(__name__)


@dataclass
class TokenisedSource:
    """One source after tokenisation and the length policy, with the counts its statistics need."""

    source: SourceConfig
    name: str
    data: datasets.Dataset
    source_rows: int  # rows as read, before the length policy
    truncated: int
    drop_reasons: dict[str, int]
    layout: str  # how its prompts reach the model (data.render.prompt_layout)


def tokenise_source(
    src: SourceConfig, cfg: DataConfig, tokenizer: Any, first_rows: int | None = None
) -> TokenisedSource:
    """Load, validate, render and length-police one source (the cached, expensive part of preparing data); only its
    first `first_rows` rows where given (`llmtune estimate`'s sample; training reads every row)."""
    raw = load_source(src)
    if first_rows is not None and len(raw) > first_rows:
        raw = raw.select(range(first_rows))
    columns = resolve_columns(src, raw.column_names)
    tokenised = raw.map(
        tokenise_row,
        with_indices=True,
        remove_columns=raw.column_names,
        num_proc=cfg.num_proc if cfg.num_proc > 1 and len(raw) >= 2 * cfg.num_proc else None,
        fn_kwargs={
            "src": src,
            "columns": columns,
            "tokenizer": tokenizer,
            "train_on": cfg.train_on,
            "train_reasoning": cfg.train_reasoning,
        },
        desc=f"Tokenising {src.path}",
    )
    # A prompt cut short asks another question: overlong prompts are dropped whatever `overlong` says.
    overlong = "drop" if src.format == "prompt" else cfg.overlong
    data, truncated, reasons = apply_length_policy(tokenised, cfg.max_length, overlong)
    if truncated or reasons:
        logger.warning(
            "%s: %d of %d examples longer than %d tokens were truncated, %d dropped %s",
            src.path,
            truncated,
            len(raw),
            cfg.max_length,
            sum(reasons.values()),
            reasons or "",
        )
    return TokenisedSource(src, src.path, data, len(raw), truncated, reasons, prompt_layout(src, columns))


def tokenise_row(
    row: dict[str, Any],
    index: int,
    *,
    src: SourceConfig,
    columns: dict[str, str],
    tokenizer: Any,
    train_on: str,
    train_reasoning: bool = True,
) -> dict[str, Any]:
    """datasets.map function: one source row -> input_ids, labels, length, n_trained."""
    where = f"{src.path}: row {index + 1}"
    canonical = {name: row.get(column) for name, column in columns.items()}
    problem = check_row(canonical, columns)
    if problem:
        raise DataError(f"{where}: field `{problem[0]}`: {problem[1]}")
    if src.format == "preference":
        try:
            return render_pair(canonical, columns, tokenizer, train_reasoning)
        except DataError as err:  # pairs name the field themselves (chosen or rejected)
            raise DataError(f"{where}: {err}") from None
    if src.format == "prompt":
        try:
            return render_prompt_row(row, src.fields, columns["prompt"], tokenizer)
        except DataError as err:
            raise DataError(f"{where}: {err}") from None
        except Exception as err:  # a chat template may raise anything
            first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise DataError(f"{where}: field `{columns['prompt']}`: cannot render: {first_line}") from err
    first_column = next(iter(columns.values()))
    canonical["tools"] = row.get("tools")  # function schemas beside a chat (TRL's column), for its template
    try:
        ids, labels = _render(src.format, canonical, columns, tokenizer, train_on, train_reasoning)
    except DataError as err:
        raise DataError(f"{where}: field `{first_column}`: {err}") from None
    except Exception as err:  # a chat template may raise anything (jinja's raise_exception, TypeError...)
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise DataError(f"{where}: field `{first_column}`: cannot render: {first_line}") from err
    n_trained = sum(1 for label in labels if label != IGNORE)
    if n_trained == 0:
        field_name = columns.get("completion") or columns.get("messages") or columns.get("text")
        raise DataError(f"{where}: field `{field_name}`: renders to zero trained tokens")
    return {"input_ids": ids, "labels": labels, "length": len(ids), "n_trained": n_trained}


def _render(
    fmt: str, values: dict[str, Any], columns: dict[str, str], tokenizer: Any, train_on: str, train_reasoning: bool
) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of a valid text, prompt/completion (Alpaca included) or chat row."""
    if fmt == "text":
        return render_text(values["text"], tokenizer)
    if fmt == "prompt_completion":
        prompt = values.get("prompt")
        if "instruction" in columns:
            prompt = alpaca_prompt(values["instruction"], values.get("input") or "")
        return render_prompt_completion(prompt, values["completion"], tokenizer, train_on)
    messages = messages_of(values["messages"])
    return render_messages(messages, tokenizer, train_on, train_reasoning, tools=values.get("tools"))


def apply_length_policy(
    data: datasets.Dataset, max_length: int, overlong: str
) -> tuple[datasets.Dataset, int, dict[str, int]]:
    """Truncate or drop examples over max_length. Returns (data, truncated, {drop reason: count}).

    A truncated example left with no trained token (its prompt filled max_length) is dropped, and
    counted as `no_trained_tokens_after_truncation`.
    """
    lengths = np.asarray(data["length"], dtype=np.int64)
    over = int((lengths > max_length).sum())
    if over == 0:
        return data, 0, {}
    if overlong == "drop":
        kept = data.filter(lambda length: length <= max_length, input_columns="length", desc="Dropping overlong")
        return kept, 0, {"overlong": over}
    cut = data.map(_truncate, fn_kwargs={"max_length": max_length}, desc="Truncating")
    kept = cut.filter(lambda n: n > 0, input_columns="n_trained", desc="Dropping untrained")
    empty = len(cut) - len(kept)
    return kept, over, ({"no_trained_tokens_after_truncation": empty} if empty else {})


def _truncate(row: dict[str, Any], *, max_length: int) -> dict[str, Any]:
    if row.get("position_ids") is not None:  # a preference pair: each side is cut to half (data.pairs)
        return truncate_pair(row, max_length)
    labels = row["labels"][:max_length]
    return {
        "input_ids": row["input_ids"][:max_length],
        "labels": labels,
        "length": min(row["length"], max_length),
        "n_trained": sum(1 for label in labels if label != IGNORE),
    }
