"""The CUDA caching allocator model (llmtune/plan/allocator.py) on sequences worked out by hand."""

from __future__ import annotations

from llmtune.plan.allocator import reserved_peak, round_size

MiB = 1024**2


def test_block_rounding():
    assert round_size(1) == 512 and round_size(512) == 512 and round_size(513) == 1024


def test_a_freed_block_too_small_for_the_next_request_costs_a_segment():
    # A, B: 12 MiB segments each (>= 10 MiB: rounded to 2 MiB). A freed; C (18 MiB) fits no free block.
    events = [(1, 12 * MiB), (2, 12 * MiB), (1, 0), (3, 18 * MiB)]
    assert reserved_peak(events, expandable_segments=False) == (42 * MiB, 30 * MiB)
    # Expandable: one 20 MiB page holds A (+8 MiB free); B grows it to 40; C grows the free 16 MiB tail to 36.
    assert reserved_peak(events, expandable_segments=True) == (60 * MiB, 30 * MiB)


def test_requests_under_10_mib_share_20_mib_segments_and_freed_blocks_merge():
    events = [(1, 4 * MiB), (2, 4 * MiB), (3, 4 * MiB), (1, 0), (2, 0), (4, 8 * MiB)]
    # 1-3 split one 20 MiB segment; freeing 1 and 2 merges 8 MiB at its start, which 4 then takes.
    assert reserved_peak(events, expandable_segments=False) == (20 * MiB, 12 * MiB)


def test_small_requests_come_from_2_mib_segments_and_are_reused():
    events = [(k, 1000) for k in range(2048)] + [(k, 0) for k in range(2048)] + [(k, 1024) for k in range(2048)]
    assert reserved_peak(events, expandable_segments=False) == (2 * MiB, 2 * MiB)


def test_a_step_repeated_reserves_nothing_more():
    step = [(10, 30 * MiB), (11, 3 * MiB), (10, 0), (12, 25 * MiB), (11, 0), (12, 0)]
    once = reserved_peak(step, expandable_segments=False)
    assert reserved_peak(step * 3, expandable_segments=False) == once


def test_expandable_segments_split_a_block_whenever_a_minimum_block_remains():
    # CUDACachingAllocator.cpp `should_split`: under expandable segments any pool splits when >= 512 B remain (fixed
    # large segments only when > 1 MiB does). A and B fill one 20 MiB page but its last 0.5 MiB, which stays a free
    # block at the segment's end; C (20.25 MiB) grows that tail by one page. Unsplit, B would hold the 0.5 MiB and C
    # would need two pages of its own: 60 MiB.
    events = [(1, 10 * MiB), (2, 19 * MiB // 2), (3, 81 * MiB // 4)]
    assert reserved_peak(events, expandable_segments=True) == (40 * MiB, 159 * MiB // 4)
