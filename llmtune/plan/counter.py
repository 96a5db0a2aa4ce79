"""The trace's storage counter: what a step keeps, by tag and by segment of the step, and what it computes."""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from llmtune.ops.measure import LiveStorageCounter
from llmtune.plan.timing import Work


@dataclass
class SegmentPeak:
    """The peak of one segment of the step: its bytes, split by tag, and the phase it happened in."""

    bytes: int
    by_tag: dict[str, int]
    phase: str


class TraceCounter(LiveStorageCounter):
    """Counter that recognises autocast's casts of weights and keeps the peak of each segment
    of the step (embedding, each layer's forward and backward, head and loss, optimizer step),
    so that a trace of a few layers can be extrapolated to many."""

    def __init__(self, trained_fraction: float, chunk_rows: int | None, selective: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.selective = selective
        self.trained_fraction = trained_fraction
        self.chunk_rows = chunk_rows
        self._untraced_rows: dict[int, torch.Tensor] = {}
        self.phase = "forward"  # forward / backward / optimizer_step: where each segment's peak happened
        self.segment: tuple[str, ...] = ()
        self.segments: dict[str, SegmentPeak] = {}
        self.events: list[tuple[int, int]] = []  # (storage, bytes) allocated, (storage, 0) freed, in order
        # What the step computes, for the time model: the head and loss apart, since the chunked loss's loop is
        # traced on two chunks and the rest is scaled from them (`_trained_rows`).
        self.work = {"body": Work(), "head": Work(), "step": Work()}
        self.untraced_factor = 1.0

    def register(self, t: torch.Tensor, tag: str | None = None) -> None:
        # Each storage's first registration is an allocation for the allocator model (allocator.py).
        known = not isinstance(t, torch.Tensor) or t.device.type == "meta" or id(t.untyped_storage()) in self._live
        super().register(t, tag)
        if not known:
            key = id(t.untyped_storage())
            nbytes, tag, _ = self._live[key]
            self.events.append((key, int(nbytes * self.scale.get(tag, 1.0))))

    def _release(self, key: int) -> None:
        if key in self._live:
            self.events.append((key, 0))
        super()._release(key)

    def trained_rows(self, labels: torch.Tensor) -> torch.Tensor:
        """A stand-in for the batch's `loss_rows` (`llmtune.ops.loss.loss_rows`: the trained rows of `labels`, found at
        collation), sized by the data's `trained_fraction`: see `_trained_rows`. Registered as an input."""
        saved, self.tag = self.tag, "inputs"
        try:
            return self._trained_rows(labels.numel(), ()).reshape(-1)
        finally:
            self.tag = saved

    def _trained_rows(self, total: int, index_dims: tuple[int, ...]) -> torch.Tensor:
        """The trained rows of `total` label positions, as indices of shape [rows, *index_dims]. Their number depends
        on the data, which fake tensors do not have: the data's `trained_fraction` (1.0, every token, bounds it) gives
        it.

        The loss then loops over chunks of these rows, each chunk's buffers freed before the next, so the
        loop's peak is that of its second chunk: rows past two chunks are not traced (at 64k tokens that is
        hundreds of identical iterations). A stand-in of their size keeps the index tensor's bytes exact.
        `chunk_rows=None` traces every row (the preference objectives keep the selected rows' hidden states)."""
        rows = math.ceil(total * self.trained_fraction)
        traced = rows if self.chunk_rows is None else min(rows, 2 * self.chunk_rows)
        self.untraced_factor = rows / max(1, traced)
        width = math.prod(index_dims)
        out = torch.empty((traced, *index_dims), dtype=torch.long)
        self.register(out)
        if traced < rows:
            rest = torch.empty(((rows - traced) * width,), dtype=torch.long)
            self.register(rest)
            # Freed with the index tensor it stands for.
            key = id(out.untyped_storage())
            self._untraced_rows[key] = rest
            weakref.finalize(out.untyped_storage(), self._untraced_rows.pop, key, None)
        return out

    def set_segment(self, *names: str) -> None:
        """Peaks from now on count for `names` (a model's only layer is its first and its last)."""
        self.segment = names
        self._check()

    def _check(self) -> None:
        super()._check()
        now = self.live_bytes + self.extra_bytes
        for name in self.segment:
            seg = self.segments.get(name)
            if seg is None or now > seg.bytes:
                by_tag = {k: int(round(v)) for k, v in self._by_tag.items() if v > 0.5}
                if self.extra_bytes:
                    by_tag["sharding_buffers"] = int(self.extra_bytes)
                self.segments[name] = SegmentPeak(int(round(now)), by_tag, self.phase)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.prim.device.default:
            # `tensor.device` of a fake tensor (the autograd engine and checkpointing ask ~1400 times a layer): an
            # attribute read in a real step, so neither memory nor work; answered here, as FakeTensorMode would,
            # without its dispatch cache's hashing (a third of a deep model's trace time).
            t = args[0]
            return t.fake_device if isinstance(t, FakeTensor) and not t.fake_mode.in_kernel_invocation else func(*args)
        if func is torch.ops.aten.nonzero.default:  # the chunked paths' `trained_rows` where no batch carried them
            return self._trained_rows(args[0].numel(), (args[0].dim(),))
        if func is torch.ops.aten._to_copy.default and self.tag_of(args[0]) == "weights":
            saved, self.tag = self.tag, "autocast_weight_copies"
            try:
                out = super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                self.tag = saved
        else:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        bucket = (
            "step" if self.phase == "optimizer_step" else "head" if {"head", "loss_bwd"} & set(self.segment) else "body"
        )
        # Selective checkpointing runs every op of a layer, in forward and in recomputation, through torch's
        # policy dispatch mode: a second Python dispatch each.
        in_layer = any(n.startswith(("fwd_", "bwd_")) for n in self.segment)
        # The first layer's backward segment runs on through the embedding's backward, which no block compiles.
        in_block = in_layer and func is not torch.ops.aten.embedding_dense_backward.default
        self.work[bucket].add(func, args, kwargs or {}, out, 2.0 if self.selective and in_layer else 1.0, in_block)
        return out

    def total_work(self) -> Work:
        """Forward and backward: the chunked loss's two traced chunks stand for all of them."""
        return self.work["body"] + self.work["head"] * self.untraced_factor
