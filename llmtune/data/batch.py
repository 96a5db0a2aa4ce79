"""Batching: which rows each process trains on at a step (pure, resumable anywhere), eval shards, and the
collate that turns a micro-batch of rows into tensors."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from llmtune.data.render import IGNORE

if TYPE_CHECKING:
    import datasets


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
    position_ids (padding gets positions 0, 1, ... of its own, a separate block with no labels;
    why, in `llmtune.data.pack`).
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


def with_documents(batch: dict[str, Any]) -> dict[str, Any]:
    """A packed micro-batch with its documents, for attention that runs each one's causal block alone
    (`llmtune.model.attention`, and transformers' flash_attention_2): the rows read as one flattened sequence, each
    document and each row's padding one span, as `cu_seq_lens_q/k` (int32 offsets, [documents + 1]) and
    `max_length_q/k` (the longest, a Python int). Computed here on the host, once per micro-batch, so that no
    layer reads the position ids on the device to find them (a synchronisation). transformers' flash path reads
    them at any micro-batch size; from position ids alone it keeps examples apart only at batch size 1."""
    offsets = document_offsets(batch["position_ids"])
    longest = int(offsets.diff().max())
    return batch | {
        "cu_seq_lens_q": offsets,
        "cu_seq_lens_k": offsets,
        "max_length_q": longest,
        "max_length_k": longest,
    }


def document_offsets(position_ids: torch.Tensor) -> torch.Tensor:
    """int32 offsets of the documents of rows [B, L] read as one sequence of B x L: a document starts at every row
    start and wherever the position does not follow the one before (it restarts), so none crosses a row."""
    positions = position_ids.reshape(-1)
    restart = torch.ones_like(positions, dtype=torch.bool)
    restart[1:] = positions[1:] != positions[:-1] + 1
    restart[:: position_ids.shape[-1]] = True
    starts = restart.nonzero().reshape(-1)
    end = torch.tensor([positions.numel()], device=positions.device)
    return torch.cat([starts, end]).to(torch.int32)


def next_tokens(batch: dict[str, Any], key: str, fill: int) -> torch.Tensor:
    """`batch[key]` at the token each position predicts: shifted left by one, `fill` at each row's end; a sequence
    shard carries it shifted already, as `shift_<key>` (`llmtune.parallel.sequence.shard_batch`)."""
    if f"shift_{key}" in batch:
        return batch[f"shift_{key}"]
    return torch.nn.functional.pad(batch[key], (0, 1), value=fill)[:, 1:]


def to_device(batch: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
    """The batch's tensors on `device`, queued behind the work already there (from pinned memory a copy that does not
    wait: `llmtune.data.prefetch.pinned`); its other values (`with_documents`' lengths, Python ints) as they are."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def sequences_of(row: dict[str, Any]) -> list[tuple[int, int]]:
    """(start, end) of each sequence in a row, from its restarting position ids (one span without them)."""
    positions = row.get("position_ids")
    if positions is None:
        return [(0, len(row["input_ids"]))]
    starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
    return list(zip(starts, starts[1:], strict=False))


def squared_lengths(rows: list[dict]) -> int:
    """Sum of l^2 over the examples in `rows`: a packed row's examples (position_ids restart at 0) count
    apart, since attention is block-diagonal there (MFU counts attention per example)."""
    return sum((b - a) ** 2 for row in rows for a, b in sequences_of(row))
