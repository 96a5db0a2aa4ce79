"""Measuring peak memory: live tensor bytes on CPU, the caching allocator's counters on CUDA.

On CPU there is no allocator statistic for tensors, so `LiveStorageCounter` (a
`TorchDispatchMode`) registers every storage an ATen op returns or reads and subtracts it when
the storage is freed (a weakref finalizer on the storage object, which PyTorch keeps alive
exactly as long as the storage). Views share a storage, so they are counted once. The same
counter runs under `FakeTensorMode`, which is how `estimate` traces a training step without
allocating anything.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# Tags used by the estimator's trace; a plain tracker tags everything "other".
DEFAULT_TAG = "other"

Trackable = torch.nn.Module | torch.optim.Optimizer | torch.Tensor


def iter_baseline_tensors(objs: Iterable[Trackable]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (tag, tensor) for what is alive before a measured region: parameters, buffers,
    their gradients and optimizer states."""
    for obj in objs:
        if isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                yield "weights", p
                if p.grad is not None:
                    yield "gradients", p.grad
            for b in obj.buffers():
                yield "weights", b
        elif isinstance(obj, torch.optim.Optimizer):
            for group in obj.param_groups:
                for p in group["params"]:
                    yield "weights", p
                    if p.grad is not None:
                        yield "gradients", p.grad
            for state in obj.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        yield "optimizer_states", value
        elif isinstance(obj, torch.Tensor):
            yield DEFAULT_TAG, obj
        else:
            raise TypeError(f"baseline accepts modules, optimizers and tensors, got {type(obj)}")


def _storage_nbytes(storage: torch.UntypedStorage, round_to: int) -> int:
    n = storage.nbytes()
    if round_to > 1:
        # The CUDA caching allocator hands out blocks in multiples of 512 bytes (and at least 512).
        n = max(round_to, -(-n // round_to) * round_to)
    return n


class LiveStorageCounter(TorchDispatchMode):
    """Counts the bytes of live tensor storages; keeps the peak and, per tag, what was live at it.

    `tag` is read when a storage is first seen, so a caller can label regions ("activations",
    "optimizer_step_temporaries"); `retag` moves a storage (e.g. a tensor that became a `.grad`).
    `scale` weights a tag's bytes (the estimator uses it to model sharded states).
    """

    def __init__(
        self,
        *,
        limit_bytes: int | None = None,
        round_to: int = 1,
    ) -> None:
        super().__init__()
        self.limit_bytes = limit_bytes
        self.round_to = round_to
        self.tag = DEFAULT_TAG
        self.scale: dict[str, float] = {}
        self.extra_bytes = 0  # modelled buffers that exist in no tensor here (e.g. FSDP all-gathers)
        self.live_bytes = 0
        self.peak_bytes = 0
        self._by_tag: dict[str, float] = {}
        # id(storage) -> (bytes, tag, weakref). The weakref's callback subtracts the storage when
        # PyTorch frees it; dropping the dict (stop()) drops the callbacks, leaving nothing behind
        # in long-lived tensors (weakref.finalize would stay registered until they die).
        self._live: dict[int, tuple[int, str, weakref.ref]] = {}

    # -- registration --------------------------------------------------------------------------
    def register(self, t: torch.Tensor, tag: str | None = None) -> None:
        """Start counting a tensor's storage (no-op if already counted)."""
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        # An FSDP2 DTensor's own storage has the global size; this process holds only its local shard.
        t = t.to_local() if isinstance(t, DTensor) else t
        st = t.untyped_storage()
        key = id(st)
        if key in self._live:
            return
        nbytes = _storage_nbytes(st, self.round_to)
        tag = tag or self.tag
        self._live[key] = (nbytes, tag, weakref.ref(st, lambda _ref, key=key: self._release(key)))
        self._add(tag, nbytes)
        self._check()

    def retag(self, t: torch.Tensor, tag: str) -> None:
        key = id(t.untyped_storage())
        if key not in self._live:
            self.register(t, tag)
            return
        nbytes, old, ref = self._live[key]
        if old != tag:
            self._add(old, -nbytes)
            self._live[key] = (nbytes, tag, ref)
            self._add(tag, nbytes)
            self._check()

    def tag_of(self, t: torch.Tensor) -> str | None:
        entry = self._live.get(id(t.untyped_storage()))
        return entry[1] if entry else None

    def stop(self) -> None:
        """Stop following storages (the peak is kept)."""
        self._live.clear()

    def _release(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self._add(entry[1], -entry[0])

    def _add(self, tag: str, nbytes: int) -> None:
        weighted = nbytes * self.scale.get(tag, 1.0)
        self._by_tag[tag] = self._by_tag.get(tag, 0.0) + weighted
        self.live_bytes += weighted

    # -- peak bookkeeping ----------------------------------------------------------------------
    def current_bytes(self) -> int:
        return int(round(self.live_bytes + self.extra_bytes))

    def _check(self) -> None:
        now = self.live_bytes + self.extra_bytes
        if now > self.peak_bytes:
            self.peak_bytes = int(round(now))
        if self.limit_bytes is not None and now > self.limit_bytes:
            # The wording of a real CPU allocation failure, so handlers that match messages
            # (accelerate's find_executable_batch_size) treat it as out-of-memory too.
            raise torch.OutOfMemoryError(
                f"DefaultCPUAllocator: can't allocate memory: live tensor bytes {int(now)} would exceed "
                f"limit_bytes={self.limit_bytes} (budget enforced by PeakMemoryTracker)"
            )

    def reset_peak(self) -> None:
        self.peak_bytes = 0
        self._check()

    def set_scale(self, tag: str, factor: float) -> None:
        """Weight a tag's bytes by `factor` from now on (re-weights what is already live)."""
        old = self.scale.get(tag, 1.0)
        self.scale[tag] = factor
        raw = sum(n for n, t, _ in self._live.values() if t == tag)
        delta = raw * (factor - old)
        self._by_tag[tag] = self._by_tag.get(tag, 0.0) + delta
        self.live_bytes += delta

    # -- dispatch ------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Inputs first: tensors created before entering (a batch, a buffer) are live too.
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in self._live:
                self.register(t)
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.register(t)
        return out


class PeakMemoryTracker:
    """Peak memory of a region of code, on CPU or CUDA.

    Usage::

        with PeakMemoryTracker("cpu", baseline=[model, optimizer]) as t:
            train_step()          # first step: optimizer states appear here
            t.reset_peak()        # measure the steady state from now on
            train_step()
        t.peak_bytes

    On CPU the peak is the maximum of live tensor bytes. What was alive before entering is
    counted only if given in `baseline` (modules: parameters, buffers and grads; optimizers:
    parameters, grads and states; tensors) or used by an op inside the region; anything else
    alive outside is invisible. On CUDA it is `torch.cuda.max_memory_allocated()` since entry,
    which counts every allocation of the process (the baseline is implicit) but not the CUDA
    context, cuBLAS workspace or allocator fragmentation. On CPU, torch.compile'd code runs eagerly
    inside the region: the figure is that of the eager step.

    `limit_bytes` makes the budget real: on CPU a `torch.OutOfMemoryError` is raised as soon as
    live bytes exceed it; on CUDA the process is capped with
    `torch.cuda.set_per_process_memory_fraction` (restored on exit), so the allocator raises.
    """

    def __init__(
        self,
        device: str | torch.device = "cpu",
        *,
        baseline: Iterable[Trackable] = (),
        limit_bytes: int | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.baseline = list(baseline)
        self.limit_bytes = limit_bytes
        self._counter: LiveStorageCounter | None = None
        self._cuda_peak_after_exit: int | None = None
        self._cuda_reserved_after_exit: int | None = None
        self._eager: Any = None  # the force_eager stance held while counting on CPU
        self._final_bytes: int | None = None  # live bytes at exit (CPU)
        self.entry_bytes = 0  # live bytes at entry (the baseline); peak_bytes - entry_bytes is the growth

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def _index(self) -> int:
        # One process on one GPU has the device "cuda" (Accelerate's): the memory fraction wants an index.
        return self.device.index if self.device.index is not None else torch.cuda.current_device()

    def __enter__(self) -> PeakMemoryTracker:
        if self.is_cuda:
            # No `synchronize`, here or at exit: the caching allocator counts on the host, as the host queues each
            # allocation (in stream order), so its figures are the step's before the device has run it. Waiting for
            # the device would only empty its queue, every measured step.
            if self.limit_bytes is not None:
                total = torch.cuda.get_device_properties(self.device).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, self.limit_bytes / total), self._index())
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_peak_after_exit = self._cuda_reserved_after_exit = None
            self.entry_bytes = torch.cuda.memory_allocated(self.device)
            return self
        self._counter = LiveStorageCounter(limit_bytes=None)
        self._final_bytes = None
        for tag, t in iter_baseline_tensors(self.baseline):
            self._counter.register(t, tag)
        self.entry_bytes = self._counter.current_bytes()
        # The limit applies from here on, so a baseline that is already over it fails at the
        # first op inside the region rather than in __enter__.
        self._counter.limit_bytes = self.limit_bytes
        # Compiled code hides its allocations from a dispatch mode, and Dynamo meeting a frame under one
        # marks that frame "skip" for good (the run would never compile). Counting needs eager ops anyway.
        self._eager = torch.compiler.set_stance("force_eager")
        self._eager.__enter__()
        self._counter.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.is_cuda:
            self._cuda_peak_after_exit = torch.cuda.max_memory_allocated(self.device)
            self._cuda_reserved_after_exit = torch.cuda.max_memory_reserved(self.device)
            if self.limit_bytes is not None:
                torch.cuda.set_per_process_memory_fraction(1.0, self._index())
            return
        assert self._counter is not None
        self._counter.__exit__(*exc)
        self._eager.__exit__(*exc)
        self._final_bytes = self._counter.current_bytes()
        self._counter.limit_bytes = None
        self._counter.stop()

    @property
    def peak_bytes(self) -> int:
        if self.is_cuda:
            if self._cuda_peak_after_exit is not None:
                return self._cuda_peak_after_exit
            return torch.cuda.max_memory_allocated(self.device)
        return self._counter.peak_bytes if self._counter else 0

    @property
    def peak_reserved_bytes(self) -> int:
        """What out-of-memory is decided against: on CUDA the caching allocator's reserved peak
        (`max_memory_reserved`, fragmentation and cached blocks included); on a CPU the live-tensor peak."""
        if self.is_cuda:
            if self._cuda_reserved_after_exit is not None:
                return self._cuda_reserved_after_exit
            return torch.cuda.max_memory_reserved(self.device)
        return self.peak_bytes

    @property
    def current_bytes(self) -> int:
        """Live bytes now (after exit: at exit)."""
        if self.is_cuda:
            return torch.cuda.memory_allocated(self.device)
        if self._final_bytes is not None:
            return self._final_bytes
        return self._counter.current_bytes() if self._counter else 0

    def reset_peak(self) -> None:
        """Forget the peak so far; the new peak starts at the bytes live now."""
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self._counter is not None:
            self._counter.reset_peak()
