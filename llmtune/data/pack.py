"""Packing: several whole examples per row of at most max_length tokens, position ids restarting per example.

Shuffle with the seed, then first-fit (each example into the first row with room); whole examples only (an
example longer than max_length was already truncated or dropped); a pair's own position ids are kept, so its
two sequences stay apart as two examples do.

Why position ids and no attention mask: in transformers 5.24 (`masking_utils._preprocess_mask_arguments` /
`find_packed_sequence_indices`), with `attention_mask=None`, NO cache and `position_ids` that restart, sdpa
and eager build a block-diagonal causal mask and flash-attention uses varlen. So packed batches carry
`position_ids` and no `attention_mask`, and the model MUST be called with `use_cache=False`: in train mode
with the config's default use_cache=True, Llama builds a DynamicCache, the detection is skipped and attention
crosses examples silently (`tests/test_data.py` checks loss equality for eager and sdpa).
"""

from __future__ import annotations

import datasets
import numpy as np
import pyarrow as pa

from llmtune.data.seeds import subseed

# The columns the loop reads. position_ids: packed rows, and preference pairs (two sequences per example).
COLUMNS = ("input_ids", "labels", "length", "position_ids", "fields")


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
    table = data.select_columns([c for c in COLUMNS if c in data.column_names]).with_format("arrow")[:]
    lengths = table.column("length").to_numpy().astype(np.int64)
    order = np.random.default_rng(subseed(seed, "pack")).permutation(len(lengths))
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
