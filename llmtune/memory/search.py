"""The planner's search: the fastest micro-batch and checkpointing that fit a memory budget and divide the global
batch. Every candidate is timed by the time model (`llmtune.timing`) from a few estimates; fastest first, each is
estimated until one fits."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

from llmtune.communication import Traffic, engine_traffic, step_seconds
from llmtune.memory.estimate import MemoryEstimate, estimate_all
from llmtune.memory.plan import BatchPlan, MemoryPlanError
from llmtune.recipe import Checkpointing, checkpointed_layers, checkpointing_of
from llmtune.timing import NOMINAL_RATES, Rates
from llmtune.units import format_bytes

log = logging.getLogger(__name__)

GUESS_MARGIN = 1.5  # a scaled peak above 1.5x the budget is not estimated exactly
# Offloading is weighed as if 2% slower than predicted: what its copies cost beyond the link's time (pinned
# buffers, copies that hold the compute stream) is not modelled, nor yet measured on a GPU; so it is taken where
# it fits a larger micro-batch that is clearly faster, or where nothing else fits, not on a tie. (On a 70B QLoRA
# plan for an H100 it was predicted 0.05% faster than every layer at a quarter of its micro-batch.)
OFFLOAD_MARGIN = 1.02


@dataclass(frozen=True)
class Candidate:
    """One configuration the planner weighed: its predicted peak (None: not estimated) and speed."""

    micro_batch_size: int
    checkpointing: Checkpointing
    step_seconds: float  # predicted time of an optimizer step (all micro-steps and the update)
    tokens_per_s: float  # predicted tokens per second of one process
    peak_bytes: int | None = None
    fits: bool | None = None
    pinned_host_bytes: int | None = None  # offloaded: the host memory its copies pin (llmtune.memory.offload)

    def to_dict(self, num_layers: int) -> dict[str, Any]:
        return {
            "micro_batch_size": self.micro_batch_size,
            "checkpointing": self.checkpointing.describe(num_layers),
            "every_n_layers": self.checkpointing.every_n_layers,
            "selective": self.checkpointing.selective,
            "offload": self.checkpointing.offload,
            "predicted_tokens_per_s": round(self.tokens_per_s, 1),
            "predicted_peak": format_bytes(self.peak_bytes) if self.peak_bytes is not None else None,
            "predicted_peak_bytes": self.peak_bytes,
            "pinned_host_bytes": self.pinned_host_bytes,
            "fits": self.fits,
        }


def checkpointing_choices(num_layers: int, offload: bool = False) -> list[Checkpointing]:
    """What `gradient_checkpointing: auto` weighs: none, every k-th layer for each distinct count of recomputed
    layers (k = 2 .. L), every layer, every layer with its saved inputs offloaded to host memory (`offload`: on
    CUDA), and every layer selectively. Ordered from most memory to least, except selective, whose memory lies
    between none and every layer but depends on the model. Offloading is weighed with every layer only: with
    every k-th, the layers not recomputed keep all their activations on the device, beside which the recomputed
    layers' inputs that offloading would free are small."""
    ks = {checkpointed_layers(k, num_layers): k for k in range(num_layers, 1, -1)}  # the smallest k per count
    partial = [Checkpointing(k) for count, k in sorted(ks.items()) if count < num_layers]
    offloaded = [Checkpointing(1, offload=True)] if offload else []
    return [Checkpointing(0), *partial, Checkpointing(1), *offloaded, Checkpointing(1, selective=True)]


def plan_micro_batch(
    config: Any,
    *,
    global_batch_size: int,
    num_processes: int = 1,
    budget_bytes: int,
    seq_len: int,
    micro_batch_size: int | None = None,
    rates: Rates | None = None,
    host_bytes: int | None = None,
    **estimate_kwargs: Any,
) -> BatchPlan:
    """The fastest predicted micro-batch and checkpointing that fit `budget_bytes` and divide the global batch.

    `gradient_checkpointing` (in `estimate_kwargs`): a `Checkpointing` or bool fixes it; "auto" weighs
    `checkpointing_choices`. `micro_batch_size` fixes the micro-batch. `rates` (llmtune.timing) turn the traced
    work into seconds; without them every candidate is ranked by its work at nominal rates. `host_bytes`: the host
    memory this process may pin; an offloaded candidate that would pin more does not fit (None: not known).

    How: the time of every candidate comes from one estimate per uniform setting (none, every layer, selective,
    offloaded) at the smallest micro-batch -- work is affine in the micro-batch and in the number of recomputed
    layers (llmtune.timing). Then, fastest first, each candidate's peak is estimated (traces are cached, so every-k
    settings reuse the none / every-layer traces) until one fits; a candidate whose setting uses no less memory
    than one that did not fit at no larger a micro-batch is skipped unestimated. Offloading (on CUDA) is timed
    from every layer's trace and traced only for its memory, if the search reaches it.
    """
    layers = int(getattr(config, "get_text_config", lambda: config)().num_hidden_layers)
    requested = estimate_kwargs.pop("gradient_checkpointing", "auto")
    fixed = None if requested is None else checkpointing_of(requested)
    # Offloading copies to host memory: on a CPU that is the memory it already uses.
    offload = estimate_kwargs.get("device", "cuda") == "cuda"
    modes = checkpointing_choices(layers, offload) if fixed is None else [fixed]
    sizes = [micro_batch_size] if micro_batch_size else _candidates(global_batch_size, num_processes)
    rates = rates or NOMINAL_RATES
    log.info(
        "planning: %d checkpointing setting(s) x micro-batches %s x %d tokens against %s",
        len(modes),
        "/".join(map(str, sizes)),
        seq_len,
        format_bytes(budget_bytes),
    )
    per_process = global_batch_size // num_processes
    search = _Search(config, layers, seq_len, num_processes, per_process, sizes[0], rates, estimate_kwargs, host_bytes)
    # Offloading weighed by `auto` is traced only when the search reaches it (its memory): its work is every
    # layer's plus the copies of what every layer's checkpoints save (`Work.offloadable`), both ways.
    search.time_uniform(modes, lazy={mode for mode in modes if mode.offload} if fixed is None else set())
    candidates = sorted((search.timed(mode, m) for mode in modes for m in sizes), key=_search_order)
    chosen, weighed = _first_fit(search, candidates, modes, budget_bytes)
    least = next((m for m in reversed(modes) if m.enabled and not m.selective), modes[0])  # the least memory
    if chosen is None and micro_batch_size:
        chosen = _as_given(search, least)
    if chosen is None:
        raise _does_not_fit(search, least, budget_bytes)
    source = "planner" if not micro_batch_size else "recipe"
    return search.plan(chosen, budget_bytes, source, _with_estimates(candidates, weighed))


@dataclass
class _Search:
    """What one search holds: the estimator's settings (less the micro-batch and checkpointing), the estimates made
    so far, and the uniform settings' estimates at the smallest micro-batch `m0`, which time every candidate."""

    config: Any
    layers: int
    seq_len: int
    num_processes: int
    per_process: int
    m0: int
    rates: Rates
    settings: dict[str, Any]
    host_bytes: int | None = None  # host memory offloading may pin (None: not known)
    estimates: dict[tuple[int, Checkpointing], MemoryEstimate] = field(default_factory=dict)
    uniform: dict[Checkpointing, MemoryEstimate] = field(default_factory=dict)

    def plan(self, chosen: Candidate, budget_bytes: int, source: str, frontier: list[Candidate]) -> BatchPlan:
        """The plan of the `chosen` candidate, with its estimate and what was weighed (`frontier`, fastest first)."""
        est = self.predict(chosen.micro_batch_size, chosen.checkpointing)
        return BatchPlan(
            micro_batch_size=chosen.micro_batch_size,
            grad_accum_steps=self.per_process // chosen.micro_batch_size,
            num_processes=self.num_processes,
            source=source,
            predicted_peak_bytes=est.reserved_bytes,
            budget_bytes=budget_bytes,
            checkpointing=chosen.checkpointing,
            predicted_tokens_per_s=chosen.tokens_per_s,
            rates_source=self.rates.source,
            frontier=[c.to_dict(self.layers) for c in frontier],
            chunk_rows=est.settings["chunk_size"],
            estimate=est,
        )

    def predict_all(self, pairs: list[tuple[int, Checkpointing]]) -> list[MemoryEstimate]:
        """The estimates of (micro-batch, checkpointing) `pairs`; those not made yet traced together."""
        todo = [p for p in dict.fromkeys(pairs) if p not in self.estimates]
        settings = [self._kwargs(m) | {"gradient_checkpointing": mode} | self.settings for m, mode in todo]
        self.estimates.update(zip(todo, estimate_all(self.config, settings), strict=True))
        return [self.estimates[p] for p in pairs]

    def predict(self, m: int, mode: Checkpointing) -> MemoryEstimate:
        return self.predict_all([(m, mode)])[0]

    def _kwargs(self, m: int) -> dict[str, Any]:
        accum = max(1, self.per_process // m)
        return dict(micro_batch_size=m, seq_len=self.seq_len, num_processes=self.num_processes, grad_accum_steps=accum)

    def time_uniform(self, modes: list[Checkpointing], lazy: set[Checkpointing]) -> None:
        """Estimate at `m0` the uniform settings that time `modes`; the `lazy` (offloaded) ones from every layer's."""
        traced = _uniform_modes([mode for mode in modes if mode not in lazy])
        self.uniform = dict(zip(traced, self.predict_all([(self.m0, u) for u in traced]), strict=True))
        for mode in lazy:
            every = self.uniform[replace(mode, offload=False)]
            self.uniform[mode] = replace(every, work=replace(every.work, host_bytes=2 * every.work.offloadable))

    def timed(
        self, mode: Checkpointing, m: int, uniform: dict[Checkpointing, MemoryEstimate] | None = None
    ) -> Candidate:
        """Predicted step time of `mode` at micro-batch `m` from the estimates at `m0` (`uniform`, by default the
        search's): forward and backward work scales with the tokens, except the op count, at the FLOP rate of `m` x
        `seq_len` rows; the optimizer's is once per step; the engine's collectives overlap the micro-steps they
        run in (`llmtune.communication.step_seconds`). Every k-th layer recomputed: none's work plus the
        recomputed layers' share of the difference to every layer."""
        uniform = self.uniform if uniform is None else uniform
        if 1 < mode.every_n_layers:
            none, full = uniform[Checkpointing(0)], uniform[replace(mode, every_n_layers=1)]
            share = checkpointed_layers(mode.every_n_layers, self.layers) / self.layers
            work = none.work + (full.work - none.work) * share
            update = none.optimizer_work
        else:
            work, update = uniform[mode].work, uniform[mode].optimizer_work
        scaled = replace(work * (m / self.m0), ops=work.ops, block_ops=work.block_ops)
        micro = self.rates.seconds(scaled, rows=m * self.seq_len)
        seconds = step_seconds(
            micro, self.per_process // m, self.rates.seconds(update), self.traffic(), self.rates.link_bytes_per_s
        )
        return Candidate(m, mode, seconds, self.per_process * self.seq_len / seconds)

    def traffic(self) -> Traffic:
        """What the engine sends between the processes a step (`llmtune.communication`)."""
        totals = next(iter(self.uniform.values())).totals
        return engine_traffic(
            self.settings.get("sharding", "none"),
            self.num_processes,
            self.settings["precision"],
            totals["parameters"],
            totals["trainable_parameters"],
        )


def _first_fit(
    search: _Search, candidates: list[Candidate], modes: list[Checkpointing], budget_bytes: int
) -> tuple[Candidate | None, list[Candidate]]:
    """The first of `candidates` (fastest first) whose peak fits, and every candidate weighed, with its peak. A
    candidate whose setting uses no less memory than one that did not fit at no larger a micro-batch is skipped."""
    too_big: list[Candidate] = []
    weighed: list[Candidate] = []
    for c in candidates:
        if any(_no_smaller(c, t, modes) for t in too_big):
            continue
        # Scaled from the smallest micro-batch first (no trace): the scaling over-states as often as not (by 11%
        # from 1 to 8 on a small Llama), so only a guess far over the budget rules a candidate out unestimated.
        guess = search.predict(search.m0, c.checkpointing).scaled_peak(c.micro_batch_size / search.m0)
        pinned = None
        if guess <= GUESS_MARGIN * budget_bytes:
            est = search.predict(c.micro_batch_size, c.checkpointing)
            guess, pinned = est.reserved_bytes, est.pinned_host_bytes if c.checkpointing.offload else None
        host_fits = pinned is None or search.host_bytes is None or pinned <= search.host_bytes
        c = replace(c, peak_bytes=guess, fits=guess <= budget_bytes and host_fits, pinned_host_bytes=pinned)
        weighed.append(c)
        if c.fits:
            return c, weighed
        too_big.append(c)
    return None, weighed


def _as_given(search: _Search, least: Checkpointing) -> Candidate:
    """A fixed micro-batch is planned as given, fitting or not (BatchPlan.fits): with the least memory."""
    est = search.predict(search.m0, least)
    timed = search.timed(least, search.m0, search.uniform | {least: est})
    return replace(timed, peak_bytes=est.reserved_bytes, fits=False)


def _does_not_fit(search: _Search, least: Checkpointing, budget_bytes: int) -> MemoryPlanError:
    """Why nothing fits: the smallest micro-batch's peak with the least memory, its breakdown, and what may help."""
    smallest = search.predict(search.m0, least)
    return MemoryPlanError(
        f"micro-batch {search.m0} x {search.seq_len} tokens is predicted to peak at "
        f"{format_bytes(smallest.reserved_bytes)} ({smallest.peak_phase}), over the budget of "
        f"{format_bytes(budget_bytes)}. Try: {', '.join(_remedies(search.settings, least))}. Breakdown at"
        " the peak: " + ", ".join(f"{k}={format_bytes(v)}" for k, v in smallest.breakdown.items())
    )


def _candidates(global_batch_size: int, num_processes: int) -> list[int]:
    """Micro-batches m with global % (m * processes) == 0, ascending."""
    if global_batch_size < 1 or num_processes < 1 or global_batch_size % num_processes:
        raise ValueError(
            f"global_batch_size={global_batch_size} must be a positive multiple of num_processes={num_processes}"
        )
    per_process = global_batch_size // num_processes
    return [m for m in range(1, per_process + 1) if per_process % m == 0]


def _search_order(c: Candidate) -> float:
    return c.step_seconds * (OFFLOAD_MARGIN if c.checkpointing.offload else 1.0)


def _uniform_modes(modes: list[Checkpointing]) -> list[Checkpointing]:
    """The settings whose estimates give every candidate's work: none and every layer span every k."""
    needed = set()
    for mode in modes:
        if 1 < mode.every_n_layers:
            needed |= {Checkpointing(0), replace(mode, every_n_layers=1)}
        else:
            needed.add(mode)
    return sorted(needed, key=lambda m: (m.every_n_layers, m.selective))


def _no_smaller(c: Candidate, too_big: Candidate, modes: list[Checkpointing]) -> bool:
    """`c` cannot fit when a candidate that did not fit keeps no more memory: at no larger a micro-batch and a
    setting no lower in `checkpointing_choices`' order (selective only compares with itself)."""
    if c.micro_batch_size < too_big.micro_batch_size:
        return False
    if c.checkpointing.selective or too_big.checkpointing.selective:
        return c.checkpointing == too_big.checkpointing
    return modes.index(c.checkpointing) <= modes.index(too_big.checkpointing)


def _with_estimates(candidates: list[Candidate], weighed: list[Candidate]) -> list[Candidate]:
    """Every candidate, fastest first, with its peak where one was estimated."""
    known = {(c.micro_batch_size, c.checkpointing): c for c in weighed}
    return [known.get((c.micro_batch_size, c.checkpointing), c) for c in candidates]


def _remedies(settings: dict[str, Any], checkpointing: Checkpointing) -> list[str]:
    """What would lower the peak, leaving out what the run already does."""
    remedies = [
        ("gradient checkpointing", checkpointing.every_n_layers != 1),
        (
            "activation offloading (gradient_checkpointing: {every_n_layers: 1, offload: true})",
            settings.get("device", "cuda") == "cuda" and not checkpointing.offload,
        ),
        ("bf16 (or bf16-true)", not str(settings.get("precision", "")).startswith("bf16")),
        ("LoRA", settings.get("lora") is None),
        (
            "QLoRA (a 4-bit base, on a CUDA GPU)",
            settings.get("lora") is not None and settings["lora"].method != "qlora",
        ),
        ("a chunked loss", settings.get("loss") != "chunked"),
        ("a shorter max_length", True),
        ("sharding (fsdp/zero) over more processes", True),
    ]
    return [what for what, applies in remedies if applies]
