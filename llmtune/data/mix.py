"""Splitting and mixing: the eval rows held out of each source, then the train sources mixed by weight.

The mixed train set keeps the total size N of its sources; source i contributes round(N * w_i / sum(w)) rows,
as whole passes over the source plus a seeded sample without replacement (`mixture_counts`,
`mixture_indices`). Eval rows are held out of each source before mixing, so an upsampled row can never be in
both. Order is left to `llmtune.data.batch.batch_for_step`.
"""

from __future__ import annotations

from typing import Any

import datasets
import numpy as np

from llmtune.data.render import DataError
from llmtune.data.seeds import subseed


def split_indices(n: int, fraction: float, *, seed: Any) -> tuple[list[int], list[int]]:
    """(keep, held_out) row indices: a seeded round(n * fraction) rows (at least 1) held out, in file order."""
    count = min(n - 1, max(1, round(n * fraction)))
    if count <= 0:
        raise DataError(f"data.eval_fraction: cannot hold out {fraction} of {n} rows and keep any for training")
    chosen = np.sort(np.random.default_rng(seed).permutation(n)[:count])
    mask = np.ones(n, dtype=bool)
    mask[chosen] = False
    return np.flatnonzero(mask).tolist(), chosen.tolist()


def hold_out(
    sources: list[datasets.Dataset], fraction: float, *, seed: int
) -> tuple[list[datasets.Dataset], list[datasets.Dataset]]:
    """(kept, held out) of each source: a seeded `fraction` of its rows taken out for eval."""
    kept, held = [], []
    for i, data in enumerate(sources):
        keep, out = split_indices(len(data), fraction, seed=subseed(seed, "eval", i))
        kept.append(data.select(keep))
        held.append(data.select(out))
    return kept, held


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
            chosen.append(part.select(mixture_indices(len(part), count, seed=subseed(seed, "mix", i))))
    return datasets.concatenate_datasets(chosen)
