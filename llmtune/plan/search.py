"""The planner's search: the fastest micro-batch and checkpointing that fit a memory budget and divide the global
batch. Every candidate is timed by the time model (`llmtune.plan.timing`) from a few estimates; fastest first, each is
estimated until one fits."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

from llmtune.errors import SetupError
from llmtune.model.tiling import mlp_tiles
from llmtune.parallel.sequence import off_node_share
from llmtune.plan.batch_plan import BatchPlan, MemoryPlanError, SequenceParallelError
from llmtune.plan.communication import Traffic, engine_traffic, step_seconds
from llmtune.plan.estimate import MemoryEstimate, estimate_all
from llmtune.plan.timing import NETWORK_BYTES_PER_S, NOMINAL_RATES, Rates, alltoall_seconds
from llmtune.recipe import Checkpointing, checkpointed_layers, checkpointing_of
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
    pinned_host_bytes: int | None = None  # offloaded: the host memory its copies pin (llmtune.plan.offload)
    sequence_parallel: int = 1
    tiled_mlp: bool = False

    def to_dict(self, num_layers: int) -> dict[str, Any]:
        return {
            "sequence_parallel": self.sequence_parallel,
            "tiled_mlp": self.tiled_mlp,
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
    sequence_parallel: int | str = 1,
    tiled_mlp: bool | str = False,
    processes_per_node: int | None = None,
    **estimate_kwargs: Any,
) -> BatchPlan:
    """The fastest predicted micro-batch and checkpointing that fit `budget_bytes` and divide the global batch, and
    with them the sequence-parallel degree and the MLP's tiling (how: `_weigh_degrees`).

    `gradient_checkpointing` (in `estimate_kwargs`): a `Checkpointing` or bool fixes it; "auto" weighs
    `checkpointing_choices`. `micro_batch_size` fixes the micro-batch. `rates` (llmtune.plan.timing) turn the traced
    work into seconds; without them every candidate is ranked by its work at nominal rates. `host_bytes`: the host
    memory this process may pin; an offloaded candidate that would pin more does not fit (None: not known).
    `sequence_parallel`: N splits every row across groups of N of the `num_processes` (`llmtune.parallel.sequence`; the
    data-parallel processes are num_processes / N, global = micro x accumulation x those); "auto" weighs every
    degree that divides the processes and the model's heads and keeps its groups on a node (`sequence_degrees`);
    a fixed degree whose groups span nodes has its all-to-alls timed over the network
    (`llmtune.plan.timing.alltoall_seconds`). `processes_per_node`: the processes a node holds (None: not known, taken
    as `NODE_PROCESSES`). `tiled_mlp`: True computes the MLPs in sequence tiles (`llmtune.model.tiling`); "auto"
    weighs it where no degree fits whole MLPs: it costs recomputation.
    """
    text = getattr(config, "get_text_config", lambda: config)()
    layers = int(text.num_hidden_layers)
    requested = estimate_kwargs.pop("gradient_checkpointing", "auto")
    fixed = None if requested is None else checkpointing_of(requested)
    on_gpu = estimate_kwargs.get("device", "cuda") == "cuda"
    # Offloading copies to host memory: on a CPU that is the memory it already uses.
    modes = checkpointing_choices(layers, offload=on_gpu) if fixed is None else [fixed]
    degrees, per_node = _degrees_to_weigh(
        config, num_processes, sequence_parallel, processes_per_node, seq_len if on_gpu else None
    )
    log.info(
        "planning: %d checkpointing setting(s) x sequence-parallel degree(s) %s x %d tokens against %s",
        len(modes),
        "/".join(map(str, degrees)),
        seq_len,
        format_bytes(budget_bytes),
    )
    space = _Space(
        config, layers, int(text.hidden_size), seq_len, num_processes, global_batch_size, micro_batch_size,
        rates or NOMINAL_RATES, estimate_kwargs, host_bytes, tiled_mlp == "auto", modes, budget_bytes, fixed is None,
        per_node,
    )  # fmt: skip
    weighed: list[_Weighed] = []
    # Tiled MLPs (auto) only where no degree fits whole ones: their recomputation costs more than a degree's
    # all-to-alls (a third of the MLP's FLOPs against a fraction of a percent of the step at 128k tokens).
    for tiled in [False, True] if tiled_mlp == "auto" else [bool(tiled_mlp)]:
        _weigh_degrees(space, degrees, tiled, weighed)
        if _fastest(weighed) is not None:
            break
    return _plan_of(weighed, modes, budget_bytes, micro_batch_size is not None)


@dataclass(frozen=True)
class _Space:
    """What every degree and tiling of one `plan_micro_batch` is weighed with."""

    config: Any
    layers: int
    hidden: int
    seq_len: int
    num_processes: int
    global_batch_size: int
    micro_batch_size: int | None  # fixed by the recipe, or None: searched
    rates: Rates
    estimate_kwargs: dict[str, Any]
    host_bytes: int | None
    auto_tiling: bool  # tiled_mlp: auto
    modes: list[Checkpointing]
    budget_bytes: int
    auto_checkpointing: bool
    per_node: int  # processes a node holds: where a sequence group's all-to-alls go (`off_node_share`)

    def search_at(self, degree: int, tiled: bool) -> _Search | None:
        sizes = _sizes(self.global_batch_size, self.num_processes // degree, self.micro_batch_size)
        if not sizes:  # a fixed micro-batch that does not divide this degree's rows a process
            return None
        if tiled and self.auto_tiling and mlp_tiles(self.seq_len // degree, self.hidden) == 1:
            return None  # a row's part in one tile: tiling changes nothing
        rows = self.global_batch_size // (self.num_processes // degree)  # a process trains a part of its group's rows
        settings = (self.config, self.layers, self.seq_len, self.num_processes, rows, sizes[0], self.rates)
        return _Search(*settings, self.estimate_kwargs, self.host_bytes, degree, tiled, sizes, per_node=self.per_node)


def _weigh_degrees(space: _Space, degrees: list[int], tiled: bool, weighed: list[_Weighed]) -> None:
    """Weigh each degree (ascending) at one tiling, appending to `weighed`.

    The time of every candidate comes from one estimate per uniform setting (none, every layer, selective, offloaded)
    at the smallest micro-batch -- work is affine in the micro-batch and in the number of recomputed layers
    (llmtune.plan.timing) -- plus the all-to-alls it sends over the link. Then, fastest first, each candidate's peak
    is estimated (traces are cached, so every-k settings reuse the none / every-layer traces) until one fits; a
    candidate whose setting uses no less memory than one that did not fit at no larger a micro-batch is skipped
    unestimated. Offloading (on CUDA) is timed from every layer's trace and traced only for its memory, if the search
    reaches it. A degree whose fastest candidate is no faster than the choice so far is not weighed further, and once
    a degree's choice is its fastest candidate (nothing traded for memory), larger degrees are not tried: they only
    add all-to-alls to the same work."""
    probed = False
    for degree in degrees:
        search = space.search_at(degree, tiled)
        if search is None:
            continue
        try:
            if not (probed or space.micro_batch_size) and weighed and _fastest(weighed) is None:
                # Something did not fit: where the largest degree with the least memory does not either,
                # nothing will (a process's activations shrink with the degree), and the rest is not weighed.
                probed, probe = True, space.search_at(degrees[-1], tiled)
                why = _over_at_least(probe, _least_memory(space.modes), space.budget_bytes) if probe else None
                if why:
                    weighed.append(_Weighed(probe, [], [], None, why))
                    return
            fastest = _fastest(weighed)
            weighed.append(_weigh(search, space.modes, space.budget_bytes, space.auto_checkpointing, fastest))
        except SetupError as err:  # a model whose MLP cannot be tiled (llmtune.model.tiling), weighed by auto
            if not space.auto_tiling:
                raise
            weighed.append(_Weighed(search, [], [], None, str(err)))
            return
        best = _fastest(weighed)
        if best is not None and _key(best.chosen) == _key(best.candidates[0]):
            return  # nothing was traded for memory: larger degrees only add all-to-alls to the same work
        if degree == 1 and not _one_row_binds(weighed[-1]):
            return  # split rows hold what a fraction of a micro-batch would: only where one row does not fit


@dataclass
class _Weighed:
    """One degree and tiling's search: its candidates, fastest first, those weighed against the budget (with their
    peaks), and the first that fits (None: none did, or `why` it was not weighed)."""

    search: _Search
    candidates: list[Candidate]
    weighed: list[Candidate]
    chosen: Candidate | None
    why: str = ""


def _one_row_binds(w: _Weighed) -> bool:
    """Whether one whole row a micro-batch is what memory refuses at degree 1: nothing fit, the choice recomputes at
    micro-batch 1, or a micro-batch-1 setting did not fit. Otherwise a degree d holding d rows' parts a micro-batch
    keeps what degree 1 keeps at micro-batch 1 (which then fits, no slower than the choice) plus all-to-alls, and
    fewer rows than d (a fraction of a micro-batch) buy memory nothing needs."""
    chosen = w.chosen
    if chosen is None or (chosen.micro_batch_size == 1 and chosen.checkpointing != Checkpointing(0)):
        return True
    return any(c.micro_batch_size == 1 and not c.fits for c in w.weighed)


def _weigh(
    search: _Search, modes: list[Checkpointing], budget_bytes: int, auto: bool, best: _Weighed | None
) -> _Weighed:
    """`search`'s candidates timed and, unless its fastest is no faster than the choice so far (`best`), weighed
    against the budget. Offloading weighed by `auto` is traced only when the search reaches it (its memory): its work
    is every layer's plus the copies of what every layer's checkpoints save (`Work.offloadable`), both ways."""
    search.time_uniform(modes, lazy={mode for mode in modes if mode.offload} if auto else set())
    candidates = sorted((search.timed(mode, m) for mode in modes for m in search.sizes), key=_search_order)
    if best is not None and _search_order(candidates[0]) >= _search_order(best.chosen):
        return _Weighed(search, candidates, [], None, "no faster than the choice")
    chosen, weighed = _first_fit(search, candidates, modes, budget_bytes)
    return _Weighed(search, candidates, weighed, chosen)


def _key(c: Candidate) -> tuple[int, Checkpointing]:
    return c.micro_batch_size, c.checkpointing


def _least_memory(modes: list[Checkpointing]) -> Checkpointing:
    """The setting of `modes` that keeps the least: every layer recomputed (offloaded where weighed), else the one."""
    return next((m for m in reversed(modes) if m.enabled and not m.selective), modes[0])


def _over_at_least(search: _Search, least: Checkpointing, budget_bytes: int) -> str | None:
    """Why even `search`'s smallest micro-batch with the `least` memory does not fit, or None where it does."""
    est = search.predict(search.m0, least)
    pinned = est.pinned_host_bytes if least.offload else None
    if est.reserved_bytes <= budget_bytes and (
        pinned is None or search.host_bytes is None or pinned <= search.host_bytes
    ):
        return None
    return f"even {least.describe(search.layers)} at micro-batch {search.m0}: {format_bytes(est.reserved_bytes)}"


def _fastest(weighed: list[_Weighed]) -> _Weighed | None:
    """The search whose choice is the fastest, or None where nothing fits."""
    fitting = [w for w in weighed if w.chosen is not None]
    return min(fitting, key=lambda w: _search_order(w.chosen), default=None)


def _plan_of(weighed: list[_Weighed], modes: list[Checkpointing], budget_bytes: int, fixed_micro: bool) -> BatchPlan:
    """The plan of the fastest choice; a fixed micro-batch that fits nowhere as given, with the least memory at the
    largest degree weighed; else why nothing fits (`_does_not_fit`)."""
    least = _least_memory(modes)
    best = _fastest(weighed)
    if best is None and not weighed:
        raise MemoryPlanError("no sequence-parallel degree divides the micro-batch the recipe fixes")
    last = weighed[-1]
    if best is None and fixed_micro:
        best = replace(last, chosen=_as_given(last.search, least))
    if best is None:
        raise _does_not_fit(last.search, least, budget_bytes)
    source = "recipe" if fixed_micro else "planner"
    frontier = _with_estimates(best.candidates, best.weighed)
    degrees = [_summary(w, budget_bytes, w is best) for w in weighed]
    return best.search.plan(best.chosen, budget_bytes, source, frontier, degrees)


def _summary(w: _Weighed, budget_bytes: int, chosen: bool) -> dict[str, Any]:
    """What `llmtune estimate` shows of one degree and tiling: its choice, or its fastest candidate and why it lost
    (none where it could not be weighed)."""
    c = w.chosen or (w.weighed[-1] if w.weighed else next(iter(w.candidates), None))
    return {
        "sequence_parallel": w.search.degree,
        "tiled_mlp": w.search.tiled,
        "tokens_per_process": w.search.shard,
        "micro_batch_size": c and c.micro_batch_size,
        "checkpointing": c and c.checkpointing.describe(w.search.layers),
        "predicted_peak_bytes": c and c.peak_bytes,
        "predicted_tokens_per_s": c and round(c.tokens_per_s, 1),
        "fits": w.chosen is not None,
        "chosen": chosen,
        "why": w.why or _lost(w, chosen, budget_bytes),
    }


def _lost(w: _Weighed, chosen: bool, budget_bytes: int) -> str:
    if chosen:
        return ""
    return "fits, slower than the choice" if w.chosen else f"over the budget of {format_bytes(budget_bytes)}"


# auto on a GPU splits a row no finer than this many tokens a process: a part's matmuls (as many rows as its tokens at
# micro-batch 1) would leave the tensor cores underfed, which the time model, charging FLOPs at one rate, does not see;
# the loss's chunks stop at the same size for the same reason (llmtune.ops.loss.GPU_MIN_CHUNK_ROWS). A fixed degree
# splits as asked.
GPU_MIN_SHARD_TOKENS = 1024
# The processes a node holds where nothing says (`llmtune estimate`; a launched run reads LOCAL_WORLD_SIZE): the
# common GPU server's 8 GPUs, or all the processes where there are fewer.
NODE_PROCESSES = 8


def _degrees_to_weigh(
    config: Any, num_processes: int, requested: int | str, processes_per_node: int | None, gpu_seq_len: int | None
) -> tuple[list[int], int]:
    """`sequence_degrees` on nodes of `processes_per_node` (None: not known, `NODE_PROCESSES` taken, and said so),
    auto's on a GPU (`gpu_seq_len`: the rows' tokens) no finer than `GPU_MIN_SHARD_TOKENS` a process; and the
    processes a node holds. A fixed degree whose groups span nodes is weighed as asked: what of its all-to-alls
    crosses the network is timed there, and said so."""
    per_node = min(num_processes, processes_per_node or NODE_PROCESSES)
    if processes_per_node is None and num_processes > 1:
        log.info("planning: the processes a node holds are not known; taken as %d", per_node)
    degrees = sequence_degrees(config, num_processes, requested, per_node)
    if requested == "auto":
        fine = [d for d in degrees if d == 1 or gpu_seq_len is None or gpu_seq_len // d >= GPU_MIN_SHARD_TOKENS]
        return fine, per_node
    share = off_node_share(degrees[0], per_node, num_processes)
    if share:
        log.info(
            "parallel.sequence_parallel=%d spans nodes of %d processes: %.0f%% of its all-to-alls' bytes are timed over"
            " the network at a nominal %.0f GB/s",
            degrees[0],
            per_node,
            100 * share,
            NETWORK_BYTES_PER_S / 1e9,
        )
    return degrees, per_node


def sequence_degrees(config: Any, num_processes: int, requested: int | str, per_node: int | None = None) -> list[int]:
    """The sequence-parallel degrees to weigh, ascending: `requested` alone, or for "auto" every divisor of the
    processes whose groups stay on a node of `per_node` processes (None: one node holds them all;
    `llmtune.parallel.sequence.off_node_share`) and that the model can be split across
    (`llmtune.parallel.sequence.refusal`). A fixed degree that does not divide the processes, or that the model cannot
    take, is refused in one line."""
    from llmtune.parallel.sequence import refusal

    if requested != "auto":
        degree = int(requested)
        if num_processes % degree:
            raise SequenceParallelError(
                f"parallel.sequence_parallel={degree} does not divide the {num_processes} process(es): a row is split"
                " across a group of that many processes"
            )
        why = refusal(config, degree)
        if why is not None:
            raise SequenceParallelError(f"parallel.sequence_parallel={degree}: {why}")
        return [degree]
    node = per_node or num_processes
    return [
        d
        for d in range(1, num_processes + 1)
        if num_processes % d == 0 and not off_node_share(d, node, num_processes) and refusal(config, d) is None
    ]


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
    degree: int = 1  # processes a row is split across (`per_process`: the rows of each, its group's)
    tiled: bool = False  # the MLPs computed in sequence tiles
    sizes: list[int] = field(default_factory=list)  # the micro-batches weighed, ascending (`m0` the first)
    per_node: int | None = None  # the processes a node holds (None: one node holds them all)
    estimates: dict[tuple[int, Checkpointing], MemoryEstimate] = field(default_factory=dict)
    uniform: dict[Checkpointing, MemoryEstimate] = field(default_factory=dict)

    def plan(
        self,
        chosen: Candidate,
        budget_bytes: int,
        source: str,
        frontier: list[Candidate],
        degrees: list[dict[str, Any]],
    ) -> BatchPlan:
        """The plan of the `chosen` candidate, with its estimate and what was weighed (`frontier`, fastest first;
        `degrees`: each sequence-parallel degree and tiling's outcome)."""
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
            sequence_parallel=self.degree,
            tiled_mlp=self.tiled,
            degrees=degrees,
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
        return dict(
            micro_batch_size=m,
            seq_len=self.seq_len,
            num_processes=self.num_processes,
            grad_accum_steps=accum,
            sequence_parallel=self.degree,
            tiled_mlp=self.tiled,
        )

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
        search's): forward and backward work scales with the tokens, except the op count, at the FLOP rate of the
        process's `m` x `seq_len` / degree rows; the optimizer's is once per step; the engine's collectives overlap
        the micro-steps they run in (`llmtune.plan.communication.step_seconds`); sequence parallelism's all-to-alls add
        to each micro-step (`alltoall_bytes`). Every k-th layer recomputed: none's work plus the recomputed layers'
        share of the difference to every layer."""
        uniform = self.uniform if uniform is None else uniform
        if 1 < mode.every_n_layers:
            none, full = uniform[Checkpointing(0)], uniform[replace(mode, every_n_layers=1)]
            share = checkpointed_layers(mode.every_n_layers, self.layers) / self.layers
            work = none.work + (full.work - none.work) * share
            update = none.optimizer_work
        else:
            work, update = uniform[mode].work, uniform[mode].optimizer_work
        scaled = replace(work * (m / self.m0), ops=work.ops, block_ops=work.block_ops)
        off_node = off_node_share(self.degree, self.per_node or self.num_processes, self.num_processes)
        alltoall = alltoall_seconds(self.alltoall_bytes(mode, m), self.rates, off_node)
        micro = self.rates.seconds(scaled, rows=m * self.shard) + alltoall
        seconds = step_seconds(
            micro, self.per_process // m, self.rates.seconds(update), self.traffic(), self.rates.link_bytes_per_s
        )
        tokens = self.per_process * self.seq_len / self.degree  # this process's share of its group's rows
        return Candidate(m, mode, seconds, tokens / seconds, sequence_parallel=self.degree, tiled_mlp=self.tiled)

    @property
    def shard(self) -> int:
        """Tokens of each row a process holds: its rows padded to a multiple of the degree, as training pads them."""
        return -(-self.seq_len // self.degree)

    def alltoall_bytes(self, mode: Checkpointing, m: int) -> int:
        """Bytes this process sends to the rest of its sequence group in a micro-step of `m` rows (`alltoall_bytes`)."""
        tokens = m * self.shard * self.degree
        s = self.settings
        return alltoall_bytes(self.config, tokens, self.degree, s["precision"], mode)

    def traffic(self) -> Traffic:
        """What the engine sends between the processes a step (`llmtune.plan.communication`)."""
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
    """Why nothing fits: the smallest micro-batch's peak with the least memory (at the largest degree weighed), its
    breakdown, and what may help: first what would fit, where a larger degree on more processes would."""
    smallest = search.predict(search.m0, least)
    split = f" ({search.shard} a process: sequence parallel {search.degree})" if search.degree > 1 else ""
    split += " with MLPs in tiles" if search.tiled else ""
    hidden = int(search.config.get_text_config().hidden_size)
    tileable = not search.tiled and mlp_tiles(search.seq_len // search.degree, hidden) > 1
    remedies = _remedies(search.settings, least, tileable)
    error = MemoryPlanError(
        f"micro-batch {search.m0} x {search.seq_len} tokens{split} is predicted to peak at "
        f"{format_bytes(smallest.reserved_bytes)} ({smallest.peak_phase}), over the budget of "
        f"{format_bytes(budget_bytes)}. Try: {', '.join([*_more_processes(search, least, budget_bytes), *remedies])}."
        " Breakdown at the peak: " + ", ".join(f"{k}={format_bytes(v)}" for k, v in smallest.breakdown.items())
    )
    error.estimate = smallest  # what an engine's row reads its reason from (`llmtune.plan.planning.plan_engines`)
    return error


# How far beyond the launch's processes `_more_processes` looks: sequence groups 2, 4 and 8 times as large.
MORE_PROCESSES = (2, 4, 8)


def _more_processes(search: _Search, least: Checkpointing, budget_bytes: int) -> list[str]:
    """The smallest larger sequence-parallel degree at which the smallest micro-batch with the least memory fits, with
    its peak: on these processes where they divide by it (fewer data-parallel groups, each training more rows), else
    on as many more processes (the data-parallel ones as they are); nothing where none fits (a remedy that does not
    fit is none) or the model's heads allow no larger degree."""
    from llmtune.parallel.sequence import refusal

    for k in MORE_PROCESSES:
        degree = search.degree * k
        if refusal(search.config, degree) is not None:
            continue
        n = search.num_processes
        if n % degree == 0:  # these processes take it (auto leaves out a degree whose groups span nodes)
            larger = replace(search, degree=degree, per_process=search.per_process * k, estimates={}, uniform={})
            where = f"parallel.sequence_parallel={degree} on these {n} processes"
            if off_node_share(degree, search.per_node or n, n):
                where += " (its groups span nodes: all-to-alls over the network)"
        else:
            larger = replace(search, num_processes=n * k, degree=degree, estimates={}, uniform={})
            where = f"sequence parallel {degree} on {larger.num_processes} processes"
        peak = larger.predict(search.m0, least).reserved_bytes
        if peak <= budget_bytes:
            return [
                f"{where} ({larger.shard} tokens a process{', MLPs in tiles' if search.tiled else ''}; predicted peak"
                f" {format_bytes(peak)}, fits)"
            ]
    return []


def alltoall_bytes(config: Any, tokens: int, degree: int, precision: str, checkpointing: Checkpointing) -> int:
    """Bytes one process of a sequence group of `degree` sends to the others in a micro-step of `tokens` tokens (the
    group's, padded rows): every layer's forward all-to-alls (`llmtune.parallel.sequence.alltoall_bytes_per_layer`), as
    many again in backward, and once more in each layer `checkpointing` recomputes.

    In the dtype attention computes in: fp32 in fp32, else 16-bit (under autocast q and k leave rotary in fp32, and
    `llmtune.model.attention.autocast_inputs` casts them down before the all-to-all, as SDPA would after it)."""
    from llmtune.parallel.sequence import alltoall_bytes_per_layer

    layers = int(config.get_text_config().num_hidden_layers)
    per_layer = alltoall_bytes_per_layer(config, tokens, degree, 4 if precision == "fp32" else 2)
    return per_layer * (2 * layers + checkpointed_layers(checkpointing.every_n_layers, layers))


def _sizes(global_batch_size: int, data_parallel: int, fixed: int | None) -> list[int]:
    """Micro-batches m with global % (m * data-parallel processes) == 0, ascending; `fixed` alone where it divides
    them (else none)."""
    if global_batch_size < 1 or data_parallel < 1 or global_batch_size % data_parallel:
        raise ValueError(
            f"global_batch_size={global_batch_size} must be a positive multiple of the {data_parallel} data-parallel"
            " processes"
        )
    per_process = global_batch_size // data_parallel
    if fixed:
        return [fixed] if per_process % fixed == 0 else []
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
    known = {_key(c): c for c in weighed}
    return [known.get(_key(c), c) for c in candidates]


def _remedies(settings: dict[str, Any], checkpointing: Checkpointing, tileable: bool) -> list[str]:
    """What would lower the peak, leaving out what the run already does (`tileable`: MLPs not tiled, over rows
    long enough for more than one tile)."""
    remedies = [
        ("an MLP in sequence tiles (parallel.tiled_mlp: true)", tileable),
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
