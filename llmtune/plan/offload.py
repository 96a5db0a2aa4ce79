"""Activation offloading in the trace: saved-tensor hooks of our own around each checkpointed layer, in place of
transformers' `save_on_cpu` (which would copy fake tensors to pinned memory)."""

from __future__ import annotations

import functools
from typing import Any

import torch

from llmtune.plan.counter import TraceCounter


def offload_saved_inputs(model: torch.nn.Module, counter: TraceCounter) -> None:
    """Activation offloading as transformers runs it (`save_on_cpu` around each checkpointed layer's checkpoint,
    on CUDA): what the checkpoint saves -- the layer's tensor inputs, the hidden states -- is copied to pinned host
    memory in forward, its device copy freed, and copied back when backward recomputes the layer. The trace keeps
    only the shape meanwhile and counts the bytes both ways (`Work.host_bytes`)."""

    def pack(t: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
        nbytes = t.numel() * t.element_size()
        counter.work["body"].host_bytes += nbytes
        counter.work["body"].pinned += pinned_bytes(nbytes)
        return t.size(), t.dtype

    def unpack(packed: tuple[torch.Size, torch.dtype]) -> torch.Tensor:
        size, dtype = packed
        counter.work["body"].host_bytes += size.numel() * dtype.itemsize
        return torch.empty(size, dtype=dtype)  # the device copy, allocated where backward needs it

    _hook_checkpoints(model, pack, unpack)


def pinned_bytes(nbytes: int) -> int:
    """The pinned host memory a copy of `nbytes` takes: CachingHostAllocator.cpp's `allocate` rounds every request
    up to the next power of two (`c10::llvm::PowerOf2Ceil`)."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def count_saved_inputs(model: torch.nn.Module, counter: TraceCounter) -> None:
    """What offloading would copy each way, counted without it (`Work.offloadable`): the planner then knows the time
    of every layer offloaded from the trace of every layer, and traces offloading only if it needs its memory."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        counter.work["body"].offloadable += t.numel() * t.element_size()
        return t

    _hook_checkpoints(model, pack, lambda t: t)


def _hook_checkpoints(model: torch.nn.Module, pack: Any, unpack: Any) -> None:
    """Saved-tensor hooks around each checkpointed layer's checkpoint call: they see what the checkpoint itself
    saves (its inputs); what the layer saves inside is the checkpoint's own business."""
    for m in model.modules():
        func = getattr(m, "_gradient_checkpointing_func", None)
        if func is not None and getattr(m, "gradient_checkpointing", False):
            m._gradient_checkpointing_func = functools.partial(_with_saved_tensor_hooks, func, pack, unpack)


def _with_saved_tensor_hooks(func: Any, pack: Any, unpack: Any, *args: Any, **kwargs: Any) -> Any:
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return func(*args, **kwargs)
