"""Preparing data: the recipe's sources -> tokenised, masked, split, mixed (and optionally packed) rows.

The stages, in order, each in a module of its own:

1. `load`: read each source with `datasets` (local file or folder, a `save_to_disk` folder, or a hub id);
2. `tokenise`: render every row to `input_ids` + `labels` (-100 = not trained) with `datasets.map` (cached by
   fingerprint, run under `main_process_first` so other processes hit the cache), then apply the length
   policy (`overlong: truncate | drop`), counting every truncated or dropped row;
3. `mix`: hold out `eval_fraction` of each source (when no eval source is given), then mix the train sources
   by weight;
4. `pack`: optionally pack several examples per row, with `position_ids` restarting at 0 for each example;
5. `stats`: count it all, for the log, `llmtune data` and the memory planner.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import datasets

from llmtune.data.chat import ensure_chat_template
from llmtune.data.mix import hold_out, mix_sources, mixture_counts
from llmtune.data.pack import COLUMNS, pack
from llmtune.data.render import DataError
from llmtune.data.stats import DataStats, split_stats, summary
from llmtune.data.tokenise import TokenisedSource, tokenise_source
from llmtune.recipe import DataConfig

logger = logging.getLogger(__name__)


@dataclass
class PreparedData:
    train: datasets.Dataset  # input_ids, labels, length; position_ids when packed
    eval: datasets.Dataset | None
    stats: DataStats
    packed: bool
    eval_stats: DataStats | None = None
    prompt_layout: str = "plain"  # of every train source (data.render.prompt_layout); mixed layouts: plain


def prepare_data(
    cfg: DataConfig,
    tokenizer: Any,
    *,
    seed: int,
    main_process_first: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    first_rows: int | None = None,
) -> PreparedData:
    """Load, render, mask, split, mix and pack the recipe's data. Raises DataError for bad data.

    `first_rows`: only the first rows of each source, prepared as all of them would be (`llmtune estimate`)."""
    if not cfg.train:
        raise DataError("data.train: no training source given")
    if tokenizer.eos_token_id is None:
        raise DataError("tokenizer: has no eos_token; llmtune appends EOS to every example")
    if any(s.format == "messages" for s in [*cfg.train, *cfg.eval]):
        ensure_chat_template(tokenizer)

    # The cached work (reading, tokenising, the length policy); the rest is cheap and in memory.
    with main_process_first():
        train_parts = [tokenise_source(src, cfg, tokenizer, first_rows) for src in cfg.train]
        eval_parts = [tokenise_source(src, cfg, tokenizer, first_rows) for src in cfg.eval]

    held_out: list[datasets.Dataset] = []
    if not cfg.eval and cfg.eval_fraction > 0:
        kept, held_out = hold_out([p.data for p in train_parts], cfg.eval_fraction, seed=seed)
        for part, data in zip(train_parts, kept, strict=True):
            part.data = data
    train, train_stats = _train_split(train_parts, cfg, seed)
    evaluation, eval_stats = _eval_split(eval_parts, train_parts, held_out, cfg, seed)

    logger.info("train data: %s", summary(train_stats))
    if eval_stats is not None:
        logger.info("eval data: %s", summary(eval_stats))
    layouts = {p.layout for p in train_parts}
    layout = layouts.pop() if len(layouts) == 1 else "plain"
    return PreparedData(
        train=train, eval=evaluation, stats=train_stats, packed=packs(cfg), eval_stats=eval_stats, prompt_layout=layout
    )


def packs(cfg: DataConfig) -> bool:
    """Whether rows are packed: as the recipe says, except prompts (grpo), which are generated from one by one."""
    return cfg.packing and not any(src.format == "prompt" for src in cfg.train)


def _train_split(parts: list[TokenisedSource], cfg: DataConfig, seed: int) -> tuple[datasets.Dataset, DataStats]:
    weights = [p.source.weight for p in parts]
    train = mix_sources([p.data for p in parts], weights, seed=seed)
    if len(train) == 0:
        raise DataError(f"data.train: no examples left after the length policy (overlong: {cfg.overlong})")
    counts = mixture_counts([len(p.data) for p in parts], weights)
    return _finish(train, parts, [p.name for p in parts], counts, cfg, seed)


def _eval_split(
    eval_parts: list[TokenisedSource],
    train_parts: list[TokenisedSource],
    held_out: list[datasets.Dataset],
    cfg: DataConfig,
    seed: int,
) -> tuple[datasets.Dataset | None, DataStats | None]:
    """The eval sources, else the rows held out of the train sources, else no eval split."""
    if eval_parts:
        data = datasets.concatenate_datasets([p.data for p in eval_parts])
        names, counts = [p.name for p in eval_parts], [len(p.data) for p in eval_parts]
        return _finish(data, eval_parts, names, counts, cfg, seed)
    if held_out:
        # Held-out rows were counted (read, truncated, dropped) with train; only their tokens count here.
        names, counts = [p.name for p in train_parts], [len(h) for h in held_out]
        return _finish(datasets.concatenate_datasets(held_out), [], names, counts, cfg, seed)
    return None, None


def _finish(
    data: datasets.Dataset,
    parts: list[TokenisedSource],
    names: list[str],
    counts: list[int],
    cfg: DataConfig,
    seed: int,
) -> tuple[datasets.Dataset, DataStats]:
    """Pack if asked, count, and keep only the columns the loop reads."""
    rows = pack(data, cfg.max_length, seed=seed) if packs(cfg) else data
    per_source = zip(names, counts, strict=True)
    stats = split_stats(data, rows, parts, per_source, max_length=cfg.max_length, packed=packs(cfg))
    return rows.select_columns([c for c in COLUMNS if c in rows.column_names]), stats
