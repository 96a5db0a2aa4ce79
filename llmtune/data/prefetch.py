"""Batches ready before the device asks for them: the next step's prepared in a background thread while the current
one trains, held in pinned host memory and copied to the device without waiting.

A GPU runs the work the host queued for it; whatever the host does between two steps (draw rows from Arrow, collate,
count) it does while the device has nothing queued, unless it is done ahead. A copy from pageable host memory makes
the host wait for every kernel queued before it (CUDA stages it through a pinned buffer, `memcpy_and_sync`); from
pinned memory with `non_blocking=True` it is queued like a kernel.

The thread holds the interpreter's lock while it runs Python (collating is mostly Python): on a host that launches
kernels only just ahead of its GPU it takes time from the launching thread. A step's rows are a few milliseconds of
such work against a step of hundreds.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

import torch

T = TypeVar("T")


class Prefetcher(Generic[T]):
    """`prepare(step)` for step + 1 in a background thread, started as step `step` is handed out (`get`).

    `prepare` must depend on the step alone (the rows of a step are a pure function of it, `batch_for_step`): what
    the thread made ahead is then exactly what the step would have made itself, the same rows in the same order,
    and a resumed run prepares from the step it resumed at. Steps from `end` on are never prepared."""

    def __init__(self, prepare: Callable[[int], T], end: int, device: torch.device) -> None:
        self._prepare, self._end = prepare, end
        self._ahead: dict[int, Future[T]] = {}
        # Pinned memory is allocated in the thread's current CUDA context: without this, every process of a node
        # would open one on GPU 0 (as torch's DataLoader sets it in its pinning thread).
        index = device.index if device.type == "cuda" and device.index is not None else None
        start = (lambda: torch.cuda.set_device(index)) if index is not None else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmtune-prefetch", initializer=start)

    def get(self, step: int) -> T:
        """Step `step`'s (made now where it was not made ahead: the first step, a step redone), step + 1's begun."""
        ahead = self._ahead.pop(step, None)
        result = ahead.result() if ahead is not None else self._prepare(step)
        if step + 1 < self._end and step + 1 not in self._ahead:
            self._ahead[step + 1] = self._pool.submit(self._prepare, step + 1)
        return result

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def pinned(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """`batch`'s tensors in pinned host memory where `device` is a GPU, which copies from there without waiting
    (`llmtune.data.batch.to_device`); anywhere else as they are (pinning needs an accelerator's host allocator)."""
    if device.type != "cuda":
        return batch
    return {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
