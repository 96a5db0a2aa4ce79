"""Traces, cached by what they depend on and run in parallel: the planner asks for the same traces again and
again (every k-th layer checkpointed is composed from the traces of none and of every layer), and each is seconds
of Python on a deep model."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from llmtune.plan.extrapolate import layer_period, with_layers
from llmtune.plan.settings import Settings
from llmtune.plan.trace import Trace, trace_step

log = logging.getLogger(__name__)

# Traces by (config, layers, settings, period); the cache starts afresh when it holds _MAX_TRACES (a few KiB each):
# planning every engine at every sequence-parallel degree and tiling asks for more than 64, which thrashed.
_TRACES: dict[tuple, Trace] = {}
_MAX_TRACES = 512
# Why forked traces failed in this process, once they have (then every trace runs in the process itself).
_FORK_REFUSED: list[str] = []
# How long the forked traces may take before they are given up and run here (each is seconds on <= 4 layers): a
# child forked while another thread of this process held a lock (a logger's, a writer thread's) waits forever.
FORKED_TRACES_TIMEOUT_S = 120.0


def cached_trace(config: Any, layers: int, s: Settings, period: int) -> Trace:
    """The trace of `config` cut to `layers` layers, run once."""
    key = (config.to_json_string(use_diff=False), layers, s, period)
    if key not in _TRACES:
        if len(_TRACES) >= _MAX_TRACES:
            _TRACES.clear()
        _TRACES[key] = trace_step(with_layers(config, layers), s, period)
    return _TRACES[key]


def _trace_job(config: Any, layers: int, s: Settings, period: int) -> Trace:
    torch.set_num_threads(1)  # in a forked worker: fake tensors compute nothing, and OpenMP's pool is the parent's
    return trace_step(with_layers(config, layers), s, period)


def prefetch(config: Any, jobs: list[tuple[int, Settings]]) -> None:
    """Trace what `jobs` need and the cache lacks, in parallel over the CPU cores when there are several: traces
    are independent and each is seconds of Python on a deep model (fork: the workers inherit the imports)."""
    import multiprocessing as mp
    import os
    import threading

    period = layer_period(config)
    text = config.to_json_string(use_diff=False)
    missing = list(dict.fromkeys((n, s) for n, s in jobs if (text, n, s, period) not in _TRACES))
    workers = min(len(missing), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    if workers < 2 or mp.current_process().daemon or "fork" not in mp.get_all_start_methods() or _FORK_REFUSED:
        return
    if threading.active_count() > 1:
        # A child forked while another thread (tqdm's monitor, a watchdog) holds a lock inherits it held and can wait
        # forever: the traces run here instead.
        return
    if len(_TRACES) + len(missing) > _MAX_TRACES:
        _TRACES.clear()
    if not FakeTensorMode.cache:
        # The first trace in a process fills FakeTensorMode's dispatch cache (a class attribute, ~0.5 s on a deep
        # model): done here once, the workers inherit it instead of each filling its own.
        n, s = missing.pop(0)
        cached_trace(config, n, s, period)
        if len(missing) < 2:
            return
        workers = min(workers, len(missing))
    try:
        with mp.get_context("fork").Pool(workers) as pool:  # leaving it terminates the workers, a stuck one too
            pending = pool.starmap_async(_trace_job, [(config, n, s, period) for n, s in missing])
            done = pending.get(timeout=FORKED_TRACES_TIMEOUT_S)
    except (RuntimeError, mp.TimeoutError) as err:
        # torch 2.11 refuses autograd in a child forked after the parent ran a backward ("Unable to handle
        # autograd's threading in combination with fork-based multiprocessing"; 2.13 allows it on a CPU), and a
        # child can deadlock on a lock it inherited held: the traces then run in this process (the caller's), and
        # no later plan forks again.
        why = str(err) or f"no forked trace in {FORKED_TRACES_TIMEOUT_S:.0f} s"
        log.debug("traces run in one process: %s", why)
        _FORK_REFUSED.append(why)
        return
    _TRACES.update({(text, n, s, period): t for (n, s), t in zip(missing, done, strict=True)})


def clear_traces() -> None:
    """Forget every cached trace (the next estimate traces again)."""
    _TRACES.clear()
