"""Data: from the recipe's sources to tokenised, masked (and optionally packed) training rows.

The flow, top to bottom in `prepare_data`:

1. load each source with `datasets` (local file or folder, a `save_to_disk` folder, or a hub id);
2. render every row to `input_ids` + `labels` (-100 = not trained) with `datasets.map` (cached by
   fingerprint, run under `main_process_first` so other processes hit the cache);
3. apply the length policy (`overlong: truncate | drop`), counting every truncated or dropped row;
4. hold out `eval_fraction` of each source (when no eval source is given), then mix the train sources
   by weight;
5. optionally pack several examples per row, with `position_ids` restarting at 0 for each example.

Rendering (step 2) lives in `llmtune.data.render` (text, prompt/completion, chats) and
`llmtune.data.pairs` (preference pairs: a chosen and a rejected sequence stored as one example whose
position ids restart at the rejected one). Rules worth knowing here (each is also said where it is
implemented):

* Mixture: the mixed train set keeps the total size N of its sources; source i contributes
  round(N * w_i / sum(w)) rows, as whole passes over the source plus a seeded sample without
  replacement (`mixture_counts`, `mixture_indices`). Eval rows are held out of each source before
  mixing, so an upsampled row can never be in both.
* Packing: shuffle with the seed, then first-fit (each example into the first row with room); whole
  examples only (an example longer than max_length was already truncated or dropped); a pair's own
  position ids are kept, so its two sequences stay apart as two examples do.
  transformers 5.24 (`masking_utils._preprocess_mask_arguments` / `find_packed_sequence_indices`):
  with `attention_mask=None`, NO cache and `position_ids` that restart, sdpa and eager build a
  block-diagonal causal mask and flash-attention uses varlen. So packed batches carry `position_ids`
  and no `attention_mask`, and the model MUST be called with `use_cache=False`: in train mode with
  the config's default use_cache=True, Llama builds a DynamicCache, the detection is skipped and
  attention crosses examples silently (`tests/test_data.py` checks loss equality for eager and sdpa).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import functools
import json
import logging
import sys
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from llmtune.data.pairs import PAIR_FIELDS, check_pair_value, render_pair, truncate_pair
from llmtune.data.render import (
    CHATML_TEMPLATE,
    IGNORE,
    DataError,
    _source_fields,
    alpaca_prompt,
    check_messages,
    ensure_chat_template,
    messages_of,
    prompt_layout,
    render_messages,
    render_prompt,
    render_prompt_completion,
    render_text,
    resolve_columns,
)
from llmtune.recipe import DataConfig, SourceConfig

__all__ = [  # the package's interface (rendering lives in llmtune.data.render, pairs in llmtune.data.pairs)
    "CHATML_TEMPLATE",
    "IGNORE",
    "DataError",
    "DataStats",
    "PreparedData",
    "batch_for_step",
    "collate",
    "eval_batches",
    "prepare_data",
    "render_prompt",
    "render_report",
    "report_json",
    "squared_lengths",
]

logger = logging.getLogger(__name__)

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}


@dataclass
class DataStats:
    """Counts for the log and `llmtune data`.

    `source_rows`, `truncated` and `dropped` count rows as read from this split's sources (before the
    eval split and mixing; rows held out by eval_fraction are counted with train); the others describe
    the split as it will be used (after mixing and packing).
    """

    examples: int = 0  # examples in this split after mixing
    tokens: int = 0  # tokens in those examples (after truncation)
    trained_tokens: int = 0  # of which have a label (not -100)
    truncated: int = 0
    dropped: int = 0
    rows: int = 0  # rows after packing (== examples when not packed)
    source_rows: int = 0
    drop_reasons: dict[str, int] = field(default_factory=dict)
    per_source: dict[str, int] = field(default_factory=dict)  # examples contributed by each source
    max_length: int = 0
    longest: int = 0  # longest example, in tokens
    mean_length: float = 0.0
    packing_fill: float | None = None  # tokens / (rows * max_length) when packed
    # Most trained tokens in one row, per max_length: bounds the tokens the chunked loss selects (memory plan).
    max_trained_fraction: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class PreparedData:
    train: datasets.Dataset  # input_ids, labels, length; position_ids when packed
    eval: datasets.Dataset | None
    stats: DataStats
    packed: bool
    eval_stats: DataStats | None = None
    prompt_layout: str = "plain"  # of every train source (data.render.prompt_layout); mixed layouts: plain


# ---------------------------------------------------------------- entry point


def prepare_data(
    cfg: DataConfig,
    tokenizer: Any,
    *,
    seed: int,
    main_process_first: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> PreparedData:
    """Load, render, mask, split, mix and pack the recipe's data. Raises DataError for bad data."""
    if not cfg.train:
        raise DataError("data.train: no training source given")
    if tokenizer.eos_token_id is None:
        raise DataError("tokenizer: has no eos_token; llmtune appends EOS to every example")
    if any(s.format == "messages" for s in [*cfg.train, *cfg.eval]):
        ensure_chat_template(tokenizer)

    # The cached work (reading, tokenising, the length policy); the rest is cheap and in memory.
    with main_process_first():
        train_parts = [_load_tokenised(src, cfg, tokenizer) for src in cfg.train]
        eval_parts = [_load_tokenised(src, cfg, tokenizer) for src in cfg.eval]

    held_out: list[datasets.Dataset] = []
    if not cfg.eval and cfg.eval_fraction > 0:
        held_out = _hold_out(train_parts, cfg.eval_fraction, seed)
    weights = [p.source.weight for p in train_parts]
    train = mix_sources([p.data for p in train_parts], weights, seed=seed)
    if len(train) == 0:
        raise DataError(f"data.train: no examples left after the length policy (overlong: {cfg.overlong})")
    counts = mixture_counts([len(p.data) for p in train_parts], weights)
    train, train_stats = _finish(train, train_parts, [p.name for p in train_parts], counts, cfg, seed)

    evaluation, eval_stats = None, None
    if eval_parts:
        eval_data = datasets.concatenate_datasets([p.data for p in eval_parts])
        names, counts = [p.name for p in eval_parts], [len(p.data) for p in eval_parts]
        evaluation, eval_stats = _finish(eval_data, eval_parts, names, counts, cfg, seed)
    elif held_out:
        # Held-out rows were counted (read, truncated, dropped) with train; only their tokens count here.
        names, counts = [p.name for p in train_parts], [len(h) for h in held_out]
        evaluation, eval_stats = _finish(datasets.concatenate_datasets(held_out), [], names, counts, cfg, seed)

    logger.info("train data: %s", _summary(train_stats))
    if eval_stats is not None:
        logger.info("eval data: %s", _summary(eval_stats))
    layouts = {p.layout for p in train_parts}
    layout = layouts.pop() if len(layouts) == 1 else "plain"
    return PreparedData(
        train=train, eval=evaluation, stats=train_stats, packed=cfg.packing, eval_stats=eval_stats, prompt_layout=layout
    )


def _hold_out(parts: list[_Part], fraction: float, seed: int) -> list[datasets.Dataset]:
    """Take a seeded `fraction` of each train source out for eval (before mixing, so repeats never leak)."""
    held_out = []
    for i, part in enumerate(parts):
        keep, out = split_indices(len(part.data), fraction, seed=_subseed(seed, "eval", i))
        held_out.append(part.data.select(out))
        part.data = part.data.select(keep)
    return held_out


def _finish(
    data: datasets.Dataset,
    parts: list[_Part],
    names: list[str],
    counts: list[int],
    cfg: DataConfig,
    seed: int,
) -> tuple[datasets.Dataset, DataStats]:
    """Count, pack if asked, and keep only the columns the loop reads."""
    stats = DataStats(max_length=cfg.max_length)
    for part in parts:
        stats.source_rows += part.source_rows
        stats.truncated += part.truncated
        for reason, count in part.drop_reasons.items():
            stats.drop_reasons[reason] = stats.drop_reasons.get(reason, 0) + count
    stats.dropped = sum(stats.drop_reasons.values())
    for name, count in zip(names, counts, strict=True):
        stats.per_source[name] = stats.per_source.get(name, 0) + count
    lengths = np.asarray(data["length"], dtype=np.int64)
    stats.examples = len(data)
    stats.tokens = int(lengths.sum())
    stats.trained_tokens = int(np.asarray(data["n_trained"], dtype=np.int64).sum())
    stats.longest = int(lengths.max(initial=0))
    stats.mean_length = float(lengths.mean()) if len(lengths) else 0.0
    if cfg.packing:
        data = pack(data, cfg.max_length, seed=seed)
        stats.packing_fill = stats.tokens / max(1, len(data) * cfg.max_length)
    stats.rows = len(data)
    stats.max_trained_fraction = _max_trained(data) / cfg.max_length
    # position_ids: packed rows, and preference pairs (two sequences per example) packed or not.
    return data.select_columns([c for c in _COLUMNS if c in data.column_names]), stats


_COLUMNS = ("input_ids", "labels", "length", "position_ids")


def _max_trained(data: datasets.Dataset) -> int:
    """The most labels other than -100 in any one row (packed or not)."""
    labels = data.data.column("labels").combine_chunks()
    if len(labels) == 0:
        return 0
    trained = np.asarray(labels.flatten()) != -100
    return int(np.bincount(np.asarray(pc.list_parent_indices(labels)), weights=trained, minlength=1).max())


def _subseed(seed: int, purpose: str, *index: int) -> list[int]:
    """numpy seed entropy from the run seed and a purpose, so the eval split, mixing and packing draw
    independent streams (and never the (seed, epoch) stream of batch_for_step)."""
    return [seed, zlib.crc32(purpose.encode()), *index]


def _summary(s: DataStats) -> str:
    text = (
        f"{s.examples} examples, {s.rows} rows, {s.tokens} tokens ({s.trained_tokens} trained), "
        f"{s.truncated} truncated, {s.dropped} dropped"
    )
    if s.drop_reasons:
        text += f" {s.drop_reasons}"
    if s.packing_fill is not None:
        text += f", packing fill {s.packing_fill:.1%}"
    return text


# ---------------------------------------------------------------- loading


@dataclass
class _Part:
    """One source after tokenisation and the length policy."""

    source: SourceConfig
    name: str
    data: datasets.Dataset
    source_rows: int
    truncated: int
    drop_reasons: dict[str, int]
    layout: str  # how its prompts reach the model (data.render.prompt_layout)


def load_source(src: SourceConfig) -> datasets.Dataset:
    """Read one source into a Dataset. Local paths by extension; anything else is a hub dataset id."""
    path = Path(src.path).expanduser()
    try:
        if path.is_file():
            builder = FILE_BUILDERS.get(_suffix(path))
            if builder is None:
                raise DataError(f"{path}: unsupported file type (use one of {', '.join(FILE_BUILDERS)})")
            if path.stat().st_size == 0:
                raise DataError(f"{path}: row 1: file is empty")
            extra = {"features": _csv_as_text(path)} if builder == "csv" else {}
            ds = datasets.load_dataset(builder, data_files=str(path), split="train", **extra)
        elif path.is_dir():
            if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
                loaded = datasets.load_from_disk(str(path))
                ds = loaded[src.split] if isinstance(loaded, datasets.DatasetDict) else loaded
            else:
                ds = datasets.load_dataset(str(path), split=src.split)
        elif path.exists() or src.path.startswith((".", "/", "~")) or Path(src.path).suffix in FILE_BUILDERS:
            raise DataError(f"{src.path}: no such file or folder")
        else:
            ds = datasets.load_dataset(src.path, src.subset, split=src.split)
    except DataError:
        raise
    except Exception as err:  # datasets raises many types; each one means the same thing here
        raise DataError(_explain_unreadable(src, path, err)) from err
    if len(ds) == 0:
        raise DataError(f"{src.path}: row 1: no rows (empty file or split {src.split!r})")
    return ds


def _csv_as_text(path: Path) -> datasets.Features:
    """Every CSV column as text: pandas would otherwise turn a column of answers like "42" into ints."""
    with path.open(newline="", encoding="utf-8", errors="replace") as f:
        header = next(csv.reader(f), [])
    return datasets.Features({name: datasets.Value("string") for name in header})


def _suffix(path: Path) -> str:
    return path.suffix.lower()


def _explain_unreadable(src: SourceConfig, path: Path, err: Exception) -> str:
    """Name the first bad row of an unreadable JSON Lines file; otherwise pass on the reader's error."""
    if path.is_file() and _suffix(path) == ".jsonl":
        with path.open(encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as bad:
                    return f"{path}: row {number}: not valid JSON ({bad.msg} at column {bad.colno})"
                if not isinstance(row, dict):
                    return f"{path}: row {number}: expected a JSON object, got {type(row).__name__}"
                fields = _source_fields(src, list(row))
                problem = _check_row({name: row.get(column) for name, column in fields.items()}, fields)
                if problem:
                    return f"{path}: row {number}: field `{problem[0]}`: {problem[1]}"
    message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    cause = err.__cause__
    if cause is not None and str(cause).strip():
        message += f" ({str(cause).strip().splitlines()[0]})"
    return f"{src.path}: cannot read: {message}"


def _load_tokenised(src: SourceConfig, cfg: DataConfig, tokenizer: Any) -> _Part:
    raw = load_source(src)
    columns = resolve_columns(src, raw.column_names)
    tokenised = raw.map(
        _tokenise_row,
        with_indices=True,
        remove_columns=raw.column_names,
        num_proc=cfg.num_proc if cfg.num_proc > 1 and len(raw) >= 2 * cfg.num_proc else None,
        fn_kwargs={"src": src, "columns": columns, "tokenizer": tokenizer, "train_on": cfg.train_on},
        desc=f"Tokenising {src.path}",
    )
    data, truncated, reasons = apply_length_policy(tokenised, cfg.max_length, cfg.overlong)
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
    return _Part(src, src.path, data, len(raw), truncated, reasons, prompt_layout(src, columns))


# ---------------------------------------------------------------- rows


def _check_row(values: dict[str, Any], columns: dict[str, str]) -> tuple[str, str] | None:
    """First (column, problem) of a row's values keyed by llmtune field, or None. Pure; shared by
    tokenising and by diagnosing a file the reader refused."""
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


def _tokenise_row(
    row: dict[str, Any], index: int, *, src: SourceConfig, columns: dict[str, str], tokenizer: Any, train_on: str
) -> dict[str, Any]:
    """datasets.map function: one source row -> input_ids, labels, length, n_trained."""
    canonical = {name: row.get(column) for name, column in columns.items()}
    problem = _check_row(canonical, columns)
    if problem:
        raise DataError(f"{src.path}: row {index + 1}: field `{problem[0]}`: {problem[1]}")
    if src.format == "preference":
        try:
            return render_pair(canonical, columns, tokenizer)
        except DataError as err:  # pairs name the field themselves (chosen or rejected)
            raise DataError(f"{src.path}: row {index + 1}: {err}") from None
    try:
        if src.format == "text":
            ids, labels = render_text(canonical["text"], tokenizer)
        elif src.format == "prompt_completion":
            prompt = canonical.get("prompt")
            if "instruction" in columns:
                prompt = alpaca_prompt(canonical["instruction"], canonical.get("input") or "")
            ids, labels = render_prompt_completion(prompt, canonical["completion"], tokenizer, train_on)
        else:
            ids, labels = render_messages(messages_of(canonical["messages"]), tokenizer, train_on)
    except DataError as err:
        raise DataError(f"{src.path}: row {index + 1}: field `{next(iter(columns.values()))}`: {err}") from None
    except Exception as err:  # a chat template may raise anything (jinja's raise_exception, TypeError...)
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise DataError(
            f"{src.path}: row {index + 1}: field `{next(iter(columns.values()))}`: cannot render: {first_line}"
        ) from err
    n_trained = sum(1 for label in labels if label != IGNORE)
    if n_trained == 0:
        field_name = columns.get("completion") or columns.get("messages") or columns.get("text")
        raise DataError(f"{src.path}: row {index + 1}: field `{field_name}`: renders to zero trained tokens")
    return {"input_ids": ids, "labels": labels, "length": len(ids), "n_trained": n_trained}


# ---------------------------------------------------------------- length policy


def _truncate(row: dict[str, Any], *, max_length: int) -> dict[str, Any]:
    if row.get("position_ids") is not None:
        return truncate_pair(row, max_length)
    labels = row["labels"][:max_length]
    return {
        "input_ids": row["input_ids"][:max_length],
        "labels": labels,
        "length": min(row["length"], max_length),
        "n_trained": sum(1 for label in labels if label != IGNORE),
    }


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


# ---------------------------------------------------------------- splitting and mixing


def split_indices(n: int, fraction: float, *, seed: Any) -> tuple[list[int], list[int]]:
    """(keep, held_out) row indices: a seeded round(n * fraction) rows (at least 1) held out, in file order."""
    count = min(n - 1, max(1, round(n * fraction)))
    if count <= 0:
        raise DataError(f"data.eval_fraction: cannot hold out {fraction} of {n} rows and keep any for training")
    chosen = np.sort(np.random.default_rng(seed).permutation(n)[:count])
    mask = np.ones(n, dtype=bool)
    mask[chosen] = False
    return np.flatnonzero(mask).tolist(), chosen.tolist()


def mixture_counts(sizes: list[int], weights: list[float]) -> list[int]:
    """Rows each source contributes to the mixture.

    The mixture keeps the total size N = sum(sizes); source i contributes round(N * w_i / sum(w)) rows
    (largest-remainder rounding, so the counts sum to N). A single source contributes all its rows.
    """
    if len(sizes) == 1:
        return list(sizes)
    if any(w <= 0 for w in weights):
        raise DataError(f"data.train: source weights must be positive, got {weights}")
    total = sum(sizes)
    exact = np.asarray(weights, dtype=np.float64) / sum(weights) * total
    counts = np.floor(exact).astype(np.int64)
    for i in np.argsort(-(exact - counts), kind="stable")[: total - int(counts.sum())]:
        counts[i] += 1
    return counts.tolist()


def mixture_indices(size: int, count: int, *, seed: Any) -> np.ndarray:
    """`count` rows of a source of `size` rows: whole passes over the source, then a seeded sample
    without replacement for the remainder (so no row repeats more than once more than another)."""
    passes, rest = divmod(count, size)
    sample = np.sort(np.random.default_rng(seed).permutation(size)[:rest])
    return np.concatenate([np.tile(np.arange(size), passes), sample]).astype(np.int64)


def mix_sources(parts: list[datasets.Dataset], weights: list[float], *, seed: int) -> datasets.Dataset:
    """Weighted mixture (see mixture_counts / mixture_indices); order is left to batch_for_step."""
    if len(parts) == 1:
        return parts[0]
    counts = mixture_counts([len(p) for p in parts], weights)
    chosen = []
    for i, (part, count) in enumerate(zip(parts, counts, strict=True)):
        if count and len(part) == 0:
            raise DataError(f"data.train[{i}]: no examples left to mix")
        if count:
            chosen.append(part.select(mixture_indices(len(part), count, seed=_subseed(seed, "mix", i))))
    return datasets.concatenate_datasets(chosen)


# ---------------------------------------------------------------- packing


def first_fit(lengths: list[int] | np.ndarray, capacity: int) -> list[list[int]]:
    """First-fit bin packing in the given order: each example goes into the first row with room.

    O(n log n) with a max-segment-tree over the rows' free space; unused rows have full capacity, so
    the leftmost fitting leaf is either an open row or the next new one.
    """
    n = len(lengths)
    if n == 0:
        return []
    size = 1 << max(1, (n - 1).bit_length())
    free = [capacity] * (2 * size)
    rows: list[list[int]] = []
    for i, length in enumerate(lengths):
        length = int(length)
        if length > capacity:
            raise ValueError(f"example {i} has {length} tokens, more than the row capacity {capacity}")
        node = 1
        while node < size:
            node = 2 * node if free[2 * node] >= length else 2 * node + 1
        leaf = node - size
        free[node] -= length
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
        if leaf == len(rows):
            rows.append([])
        rows[leaf].append(i)
    return rows


def pack(data: datasets.Dataset, max_length: int, *, seed: int) -> datasets.Dataset:
    """Pack examples into rows of at most max_length tokens: shuffle with the seed, then first-fit.

    Each row holds whole examples; position_ids restart at 0 for each example (that is how attention
    is kept inside an example, see the module docstring). Labels already mask each example's first token.
    """
    table = data.select_columns([c for c in _COLUMNS if c in data.column_names]).with_format("arrow")[:]
    lengths = table.column("length").to_numpy().astype(np.int64)
    order = np.random.default_rng(_subseed(seed, "pack")).permutation(len(lengths))
    rows = [[int(order[i]) for i in row] for row in first_fit(lengths[order], max_length)]
    flat_order = np.asarray([i for row in rows for i in row], dtype=np.int64)
    values_ids, starts = _flat(table.column("input_ids"))
    values_labels, label_starts = _flat(table.column("labels"))
    assert np.array_equal(starts, label_starts), "input_ids and labels differ in length"
    ex_len = lengths[flat_order]
    # Gather every token of every example in packed order with one fancy index.
    token_index = np.repeat(starts[flat_order] - np.cumsum(ex_len) + ex_len, ex_len) + np.arange(ex_len.sum())
    if "position_ids" in table.column_names:  # preference pairs: each example is already two sequences
        positions = _flat(table.column("position_ids"))[0][token_index]
    else:
        positions = np.arange(ex_len.sum()) - np.repeat(np.cumsum(ex_len) - ex_len, ex_len)
    row_len = np.asarray([int(lengths[row].sum()) for row in rows], dtype=np.int64)
    offsets = pa.array(np.concatenate([[0], np.cumsum(row_len)]).astype(np.int32))
    packed = pa.table(
        {
            "input_ids": pa.ListArray.from_arrays(offsets, pa.array(values_ids[token_index].astype(np.int32))),
            "labels": pa.ListArray.from_arrays(offsets, pa.array(values_labels[token_index].astype(np.int32))),
            "position_ids": pa.ListArray.from_arrays(offsets, pa.array(positions.astype(np.int32))),
            "length": pa.array(row_len),
        }
    )
    return datasets.Dataset(datasets.table.InMemoryTable(packed))


def _flat(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(all values, start of each list) of a list column; flatten() honours slices, unlike .values."""
    array = column.combine_chunks()
    offsets = array.offsets.to_numpy()
    return array.flatten().to_numpy(zero_copy_only=False), (offsets - offsets[0])[:-1]


# ---------------------------------------------------------------- batching


@functools.lru_cache(maxsize=4)
def _epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    # Cached: consecutive steps of one epoch reuse the permutation (O(n) to draw).
    return np.random.default_rng([seed, epoch]).permutation(n)


def _rows(data: datasets.Dataset, indices: list[int]) -> list[dict[str, Any]]:
    if not indices:
        return []
    columns = data[indices]
    return [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)]


def global_batch(n: int, *, step: int, global_batch_size: int, seed: int) -> np.ndarray:
    """Row indices of the whole global batch at `step`: slice `step % steps_per_epoch` of epoch
    `step // steps_per_epoch`'s permutation, seeded by (seed, epoch). Pure; O(n) once per epoch."""
    steps = n // global_batch_size if global_batch_size > 0 else 0
    if steps == 0:
        raise ValueError(f"the training set has {n} rows, fewer than one global batch ({global_batch_size})")
    epoch, position = divmod(step, steps)
    return _epoch_order(n, seed, epoch)[position * global_batch_size : (position + 1) * global_batch_size]


def share_of_batch(batch: np.ndarray, lengths: np.ndarray | None, *, rank: int, world_size: int) -> list[int]:
    """This process's disjoint share of a global batch: a contiguous slice, or (with lengths) the batch
    sorted longest first and dealt out rank::world_size. Pure."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size} processes")
    if len(batch) % world_size:
        raise ValueError(f"global_batch_size {len(batch)} is not divisible by world_size {world_size}")
    if lengths is None:
        share = len(batch) // world_size
        return batch[rank * share : (rank + 1) * share].tolist()
    # Longest first, so each process's first micro-batch is its largest (memory peaks surface at once).
    ordered = batch[np.argsort(-lengths, kind="stable")]
    return ordered[rank::world_size].tolist()


def batch_for_step(
    data: datasets.Dataset,
    *,
    step: int,
    global_batch_size: int,
    seed: int,
    rank: int,
    world_size: int,
    group_by_length: bool,
) -> list[dict]:
    """The examples this process trains on at optimizer step `step` (0-based); pure and deterministic.

    Epoch e = step // (len(data) // global_batch_size) (the tail that does not fill a batch is left out
    of that epoch); its order is a permutation seeded by (seed, e). Each process takes a disjoint
    global_batch_size // world_size of the global batch: a contiguous slice, or with group_by_length
    the global batch sorted by length (longest first) dealt out rank::world_size, so every process gets
    similar lengths and its consecutive micro-batches have little padding. Resuming at any step costs
    the same as step 0: nothing before `step` is read.
    """
    if global_batch_size % world_size:
        raise ValueError(f"global_batch_size {global_batch_size} is not divisible by world_size {world_size}")
    batch = global_batch(len(data), step=step, global_batch_size=global_batch_size, seed=seed)
    lengths = None
    if group_by_length:  # only the global batch's lengths are read, not its tokens
        lengths = np.asarray(data.select_columns(["length"])[batch.tolist()]["length"], dtype=np.int64)
    return _rows(data, share_of_batch(batch, lengths, rank=rank, world_size=world_size))


def steps_per_epoch(data: datasets.Dataset, global_batch_size: int) -> int:
    return len(data) // global_batch_size


def eval_batches(data: datasets.Dataset, *, batch_size: int, rank: int, world_size: int) -> Iterator[list[dict]]:
    """Process `rank`'s disjoint strided shard (rows rank, rank + W, ...) in fixed order, in batches.

    Every process yields the same number of batches: a shard one row short is topped up with a copy
    of row 0 whose labels are all -100, which adds nothing to a loss summed over trained tokens.
    """
    n = len(data)
    per_rank = -(-n // world_size)
    shard = list(range(rank, n, world_size))
    for start in range(0, per_rank, batch_size):
        rows = _rows(data, shard[start : start + batch_size])
        missing = min(batch_size, per_rank - start) - len(rows)
        for _ in range(missing):
            filler = _rows(data, [0])[0]
            filler["labels"] = [IGNORE] * len(filler["labels"])
            rows.append(filler)
        yield rows


def collate(
    examples: list[dict], *, pad_token_id: int, packed: bool, pad_to_multiple_of: int | None = None
) -> dict[str, torch.Tensor]:
    """One micro-batch, right-padded to its longest row.

    Not packed: input_ids, labels (-100 on padding), attention_mask. Packed: input_ids, labels,
    position_ids and NO attention_mask, so transformers derives the block-diagonal mask from the
    position_ids (padding gets positions 0, 1, ... of its own, a separate block with no labels).
    """
    if not examples:
        raise ValueError("collate: empty micro-batch")
    width = max(len(e["input_ids"]) for e in examples)
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    input_ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    positions = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        input_ids[i, :n] = torch.as_tensor(e["input_ids"], dtype=torch.long)
        labels[i, :n] = torch.as_tensor(e["labels"], dtype=torch.long)
        mask[i, :n] = 1
        if packed:
            positions[i, :n] = torch.as_tensor(e["position_ids"], dtype=torch.long)
            positions[i, n:] = torch.arange(width - n)
    if packed:
        return {"input_ids": input_ids, "labels": labels, "position_ids": positions}
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}


def squared_lengths(rows: list[dict]) -> int:
    """Sum of l^2 over the examples in `rows`: a packed row's examples (position_ids restart at 0) count
    apart, since attention is block-diagonal there (MFU counts attention per example)."""
    total = 0
    for row in rows:
        positions = row.get("position_ids")
        if positions is None:
            total += len(row["input_ids"]) ** 2
            continue
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
        total += sum((b - a) ** 2 for a, b in zip(starts, starts[1:], strict=False))
    return total


# ---------------------------------------------------------------- reports


def _spans(row: dict[str, Any]) -> list[tuple[list[int], bool, bool]]:
    """(ids, trained, starts a new example) runs of one row."""
    positions = row.get("position_ids") or list(range(len(row["input_ids"])))
    spans: list[tuple[list[int], bool, bool]] = []
    for i, (token, label) in enumerate(zip(row["input_ids"], row["labels"], strict=True)):
        trained, boundary = label != IGNORE, i > 0 and positions[i] == 0
        if spans and not boundary and spans[-1][1] == trained:
            spans[-1][0].append(token)
        else:
            spans.append(([token], trained, boundary))
    return spans


def render_row(row: dict[str, Any], tokenizer: Any, color: bool = False) -> str:
    """One row as text; trained tokens in [[...]] (or green when color), packed examples split by ' ║ '."""
    out = []
    for ids, trained, boundary in _spans(row):
        if boundary:
            out.append("\n║ next example ║\n" if not color else "\n\x1b[2m║ next example ║\x1b[0m\n")
        text = tokenizer.decode(ids, skip_special_tokens=False)
        if trained:
            out.append(f"\x1b[32m{text}\x1b[0m" if color else f"[[{text}]]")
        else:
            out.append(text)
    return "".join(out)


def render_report(data: PreparedData, tokenizer: Any, n: int, color: bool | None = None) -> str:
    """`llmtune data --show N`: N training rows with trained tokens marked, then the statistics."""
    if color is None:
        color = sys.stdout.isatty()
    marker = "green" if color else "[[...]]"
    lines = [f"Trained tokens are shown {marker}; the rest is context the loss ignores.", ""]
    for i in range(min(n, len(data.train))):
        row = data.train[i]
        trained = sum(1 for label in row["labels"] if label != IGNORE)
        lines += [
            f"── row {i}: {len(row['input_ids'])} tokens, {trained} trained ──",
            render_row(row, tokenizer, color),
            "",
        ]
    lines.append("train: " + _summary(data.stats))
    lines += [f"  {k}: {v}" for k, v in data.stats.to_dict().items()]
    if data.eval_stats is not None:
        lines.append("eval: " + _summary(data.eval_stats))
    return "\n".join(lines)


def report_json(data: PreparedData, n: int) -> dict:
    """Machine-readable `llmtune data --show N --json`."""
    keep = ["input_ids", "labels", "position_ids"] if data.packed else ["input_ids", "labels"]
    rows = [{k: data.train[i][k] for k in keep} for i in range(min(n, len(data.train)))]
    out: dict[str, Any] = {"rows": rows, "stats": data.stats.to_dict(), "packed": data.packed}
    if data.eval_stats is not None:
        out["eval_stats"] = data.eval_stats.to_dict()
    return out
