"""What the CUDA caching allocator reserves for a sequence of allocations and frees.

Out-of-memory happens against reserved memory (the allocator's segments), not against the bytes of live
tensors: blocks are rounded, segments are cut into blocks that later requests may not fit, and the
allocator keeps freed segments cached. This replays the estimator's trace (every storage allocated and
freed, in order) through a model of c10/cuda/CUDACachingAllocator.cpp (PyTorch 2.x):

- sizes round up to 512 bytes; requests up to 1 MiB come from the small pool, larger ones from the large;
- without expandable segments, a request that no cached free block fits gets a new segment: 2 MiB for the
  small pool, 20 MiB for requests under 10 MiB, otherwise the request rounded up to 2 MiB. The best-fitting
  (smallest) free block is used and split when the rest is >= 512 bytes (small, or any pool with expandable
  segments) or > 1 MiB (large); freed
  blocks merge with free neighbours of the same segment; segments are never returned (no empty_cache);
- with expandable segments (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, llmtune's default on CUDA)
  each pool is one segment whose end grows by pages of 2 MiB (small) or 20 MiB (large), and a free block at
  the end grows with it, so a large request never needs a fresh segment of its own.

Not modelled: several CUDA streams (one per pool here), `max_split_size_mb`, `roundup_power2_divisions`, and
the allocator freeing its cache and retrying before it raises (so this is an upper bound near the limit).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

_MiB = 1024**2
MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = _MiB  # kSmallSize: requests up to this come from the small pool
SMALL_BUFFER = 2 * _MiB  # kSmallBuffer
LARGE_BUFFER = 20 * _MiB  # kLargeBuffer
MIN_LARGE_ALLOC = 10 * _MiB  # kMinLargeAlloc
ROUND_LARGE = 2 * _MiB  # kRoundLarge


def round_size(n: int) -> int:
    return MIN_BLOCK if n < MIN_BLOCK else -(-n // MIN_BLOCK) * MIN_BLOCK


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass
class _Pool:
    small: bool
    expandable: bool
    reserved: int = 0
    # Free blocks as (size, segment, offset), sorted: the first that fits is the best fit.
    free: list[tuple[int, int, int]] = field(default_factory=list)
    # Per segment: offset -> (size, is_free); segment sizes.
    blocks: list[dict[int, tuple[int, bool]]] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)

    def _segment_size(self, n: int) -> int:
        if self.small:
            return SMALL_BUFFER
        return LARGE_BUFFER if n < MIN_LARGE_ALLOC else _round_up(n, ROUND_LARGE)

    def _split_ok(self, rest: int) -> bool:
        # CUDACachingAllocator.cpp `should_split`: the small pool, and every pool under expandable segments, split
        # whenever a minimum block remains; the large pool of fixed segments only when more than 1 MiB does.
        return rest >= MIN_BLOCK if self.small or self.expandable else rest > SMALL_SIZE

    def _add_free(self, seg: int, off: int, size: int) -> None:
        self.blocks[seg][off] = (size, True)
        bisect.insort(self.free, (size, seg, off))

    def _take_free(self, seg: int, off: int) -> int:
        size, _ = self.blocks[seg][off]
        self.free.remove((size, seg, off))
        return size

    def _grow(self, n: int) -> None:
        """No free block fits `n`: a new segment, or (expandable) a longer one."""
        if not self.expandable or not self.sizes:
            size = (
                _round_up(n, SMALL_BUFFER if self.small else LARGE_BUFFER) if self.expandable else self._segment_size(n)
            )
            self.sizes.append(size)
            self.blocks.append({})
            self._add_free(len(self.sizes) - 1, 0, size)
            self.reserved += size
            return
        seg, end = 0, self.sizes[0]
        tail = max(self.blocks[seg])  # offset of the last block
        tail_size, tail_free = self.blocks[seg][tail]
        have = tail_size if tail_free else 0
        grow = _round_up(n - have, SMALL_BUFFER if self.small else LARGE_BUFFER)
        if tail_free:
            self._take_free(seg, tail)
            self._add_free(seg, tail, tail_size + grow)
        else:
            self._add_free(seg, end, grow)
        self.sizes[seg] += grow
        self.reserved += grow

    def malloc(self, n: int) -> tuple[int, int]:
        i = bisect.bisect_left(self.free, (n, -1, -1))
        if i == len(self.free):
            self._grow(n)
            i = bisect.bisect_left(self.free, (n, -1, -1))
        size, seg, off = self.free.pop(i)
        if self._split_ok(size - n):
            self.blocks[seg][off] = (n, False)
            self._add_free(seg, off + n, size - n)
        else:
            self.blocks[seg][off] = (size, False)
        return seg, off

    def release(self, seg: int, off: int) -> None:
        size, _ = self.blocks[seg].pop(off)
        nxt = off + size
        if nxt in self.blocks[seg] and self.blocks[seg][nxt][1]:
            size += self._take_free(seg, nxt)
            del self.blocks[seg][nxt]
        prev = max((o for o in self.blocks[seg] if o < off), default=None)
        if prev is not None and self.blocks[seg][prev][1] and prev + self.blocks[seg][prev][0] == off:
            size += self._take_free(seg, prev)
            off = prev
        self._add_free(seg, off, size)


def reserved_peak(events: list[tuple[int, int]], *, expandable_segments: bool) -> tuple[int, int]:
    """(peak reserved, peak allocated) bytes for `events`: (key, bytes) allocates, (key, 0) frees."""
    pools = {
        True: _Pool(small=True, expandable=expandable_segments),
        False: _Pool(small=False, expandable=expandable_segments),
    }
    where: dict[int, tuple[_Pool, int, int, int]] = {}
    allocated = peak_allocated = 0
    for key, nbytes in events:
        if nbytes == 0:
            if key in where:
                pool, seg, off, n = where.pop(key)
                pool.release(seg, off)
                allocated -= n
            continue
        n = round_size(nbytes)
        pool = pools[n <= SMALL_SIZE]
        where[key] = (pool, *pool.malloc(n), n)
        allocated += n
        peak_allocated = max(peak_allocated, allocated)
    return pools[True].reserved + pools[False].reserved, peak_allocated


__all__ = ["reserved_peak", "round_size"]
