"""Statistics of a prepared split: what was read, truncated, dropped, mixed and packed, for the log and
`llmtune data`, and the densest row for the memory planner."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow.compute as pc

from llmtune.data.render import IGNORE

if TYPE_CHECKING:
    import datasets

    from llmtune.data.tokenise import TokenisedSource


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


def split_stats(
    examples: datasets.Dataset,
    rows: datasets.Dataset,
    sources: list[TokenisedSource],
    per_source: Iterable[tuple[str, int]],
    *,
    max_length: int,
    packed: bool,
) -> DataStats:
    """The statistics of one split: its examples before packing, its rows after (the same when not packed).

    `sources` are those whose reading is counted here (none for held-out eval rows, counted with train);
    `per_source` pairs each source's name with the examples it contributed.
    """
    stats = DataStats(max_length=max_length)
    for source in sources:
        stats.source_rows += source.source_rows
        stats.truncated += source.truncated
        for reason, count in source.drop_reasons.items():
            stats.drop_reasons[reason] = stats.drop_reasons.get(reason, 0) + count
    stats.dropped = sum(stats.drop_reasons.values())
    for name, count in per_source:
        stats.per_source[name] = stats.per_source.get(name, 0) + count
    lengths = np.asarray(examples["length"], dtype=np.int64)
    stats.examples = len(examples)
    stats.tokens = int(lengths.sum())
    stats.trained_tokens = int(np.asarray(examples["n_trained"], dtype=np.int64).sum())
    stats.longest = int(lengths.max(initial=0))
    stats.mean_length = float(lengths.mean()) if len(lengths) else 0.0
    if packed:
        stats.packing_fill = stats.tokens / max(1, len(rows) * max_length)
    stats.rows = len(rows)
    stats.max_trained_fraction = _max_trained(rows) / max_length
    return stats


def _max_trained(data: datasets.Dataset) -> int:
    """The most trained labels (not IGNORE) in any one row (packed or not)."""
    labels = data.data.column("labels").combine_chunks()
    if len(labels) == 0:
        return 0
    trained = np.asarray(labels.flatten()) != IGNORE
    return int(np.bincount(np.asarray(pc.list_parent_indices(labels)), weights=trained, minlength=1).max())


def summary(s: DataStats) -> str:
    """One line of the split's counts, for the log and the report."""
    text = (
        f"{s.examples} examples, {s.rows} rows, {s.tokens} tokens ({s.trained_tokens} trained), "
        f"{s.truncated} truncated, {s.dropped} dropped"
    )
    if s.drop_reasons:
        text += f" {s.drop_reasons}"
    if s.packing_fill is not None:
        text += f", packing fill {s.packing_fill:.1%}"
    return text
