"""The random streams of data preparation, all derived from the run's seed.

The eval split, mixing and packing each draw from a stream of their own (`subseed(seed, purpose, ...)`), so
changing one stage never reshuffles another; none of them is the (seed, epoch) stream that
`llmtune.data.batch.batch_for_step` orders an epoch with.
"""

from __future__ import annotations

import zlib


def subseed(seed: int, purpose: str, *index: int) -> list[int]:
    """numpy seed entropy for one purpose (and, where a stage draws per source, the source's index)."""
    return [seed, zlib.crc32(purpose.encode()), *index]
