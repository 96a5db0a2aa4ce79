"""Pick the micro-batch from the memory estimate; the recipe's global batch never changes."""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import torch

from llmtune.memory.estimate import MemoryEstimate, estimate_all
from llmtune.memory.speed import Rates
from llmtune.recipe import Checkpointing, Recipe, checkpointed_layers, checkpointing_of
from llmtune.units import format_bytes

log = logging.getLogger(__name__)

_GiB = 1024**3


class MemoryPlanError(ValueError):
    """Even micro-batch 1 does not fit the memory budget."""


@dataclass
class BatchPlan:
    """How the global batch is split (global = micro x accumulation x processes) and what that costs in memory.

    `source` says who chose the micro-batch: "recipe", "planner", or "planner, shrunk after out-of-memory".
    A plan from the planner also carries its predicted peak, the budget it fits and the estimate behind it.
    The predicted peak is what the budget is held against: on CUDA the allocator's reserved bytes
    (`MemoryEstimate.reserved_bytes`), on a CPU the live tensor bytes.
    """

    micro_batch_size: int
    grad_accum_steps: int
    num_processes: int = 1
    source: str = "planner"
    predicted_peak_bytes: int | None = None
    budget_bytes: int | None = None
    checkpointing: Checkpointing = Checkpointing(0)
    predicted_tokens_per_s: float | None = None  # the time model's (memory.speed), for this process
    rates_source: str | None = None
    frontier: list[dict[str, Any]] = field(default_factory=list)  # what the planner weighed (Candidate.to_dict)
    estimate: MemoryEstimate | None = field(default=None, repr=False, compare=False)

    @property
    def fits(self) -> bool:
        """False only when an estimate says the peak is over the budget."""
        return self.predicted_peak_bytes is None or self.predicted_peak_bytes <= self.budget_bytes

    def describe(self) -> str:
        if self.predicted_peak_bytes is None:
            return "micro-batch fixed by the recipe (set training.micro_batch_size: auto to plan it)"
        return f"predicted peak {format_bytes(self.predicted_peak_bytes)} of a {format_bytes(self.budget_bytes)} budget"

    def state(self) -> dict[str, Any]:
        """The plan without its estimate: what a checkpoint keeps and `from_state` reads back."""
        state = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "estimate"}
        return state | {"checkpointing": asdict(self.checkpointing)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> BatchPlan:
        return cls(**state | {"checkpointing": Checkpointing(**state.get("checkpointing") or {"every_n_layers": 0})})

    def to_dict(self) -> dict[str, Any]:
        """The plan, readable sizes and (from the planner) the estimate: `llmtune estimate --json`, run_summary.json."""
        out = self.state()
        if self.predicted_peak_bytes is not None:
            out["predicted_peak"] = format_bytes(self.predicted_peak_bytes)
            out["fits"] = self.fits
        if self.budget_bytes is not None:
            out["budget"] = format_bytes(self.budget_bytes)
        if self.estimate is not None:
            out |= {
                "peak_bytes": self.estimate.peak_bytes,
                "peak_phase": self.estimate.peak_phase,
                "breakdown": self.estimate.breakdown,
                "estimate": self.estimate.to_dict(),
            }
        return out


def _candidates(global_batch_size: int, num_processes: int) -> list[int]:
    """Micro-batches m with global % (m * processes) == 0, ascending."""
    if global_batch_size < 1 or num_processes < 1 or global_batch_size % num_processes:
        raise ValueError(
            f"global_batch_size={global_batch_size} must be a positive multiple of num_processes={num_processes}"
        )
    per_process = global_batch_size // num_processes
    return [m for m in range(1, per_process + 1) if per_process % m == 0]


@dataclass(frozen=True)
class Candidate:
    """One configuration the planner weighed: its predicted peak (None: not estimated) and speed."""

    micro_batch_size: int
    checkpointing: Checkpointing
    step_seconds: float  # predicted time of an optimizer step (all micro-steps and the update)
    tokens_per_s: float  # predicted tokens per second of one process
    peak_bytes: int | None = None
    fits: bool | None = None

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
    **estimate_kwargs: Any,
) -> BatchPlan:
    """The fastest predicted micro-batch and checkpointing that fit `budget_bytes` and divide the global batch.

    `gradient_checkpointing` (in `estimate_kwargs`): a `Checkpointing` or bool fixes it; "auto" weighs
    `checkpointing_choices`. `micro_batch_size` fixes the micro-batch. `rates` (memory.speed) turn the traced
    work into seconds; without them every candidate is ranked by its work at nominal rates.

    How: the time of every candidate comes from one estimate per uniform setting (none, every layer, selective,
    offloaded) at the smallest micro-batch -- work is affine in the micro-batch and in the number of recomputed
    layers (memory.speed). Then, fastest first, each candidate's peak is estimated (traces are cached, so every-k
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
    per_process = global_batch_size // num_processes
    rates = rates or NOMINAL_RATES
    log.info(
        "planning: %d checkpointing setting(s) x micro-batches %s x %d tokens against %s",
        len(modes),
        "/".join(map(str, sizes)),
        seq_len,
        format_bytes(budget_bytes),
    )
    cache: dict[tuple[int, Checkpointing], MemoryEstimate] = {}

    def kwargs(m: int, mode: Checkpointing) -> dict[str, Any]:
        accum = max(1, per_process // m)
        return dict(micro_batch_size=m, seq_len=seq_len, num_processes=num_processes, grad_accum_steps=accum)

    def predict_all(pairs: list[tuple[int, Checkpointing]]) -> list[MemoryEstimate]:
        todo = [p for p in dict.fromkeys(pairs) if p not in cache]
        settings = [kwargs(m, mode) | {"gradient_checkpointing": mode} | estimate_kwargs for m, mode in todo]
        cache.update(zip(todo, estimate_all(config, settings), strict=True))
        return [cache[p] for p in pairs]

    def predict(m: int, mode: Checkpointing) -> MemoryEstimate:
        return predict_all([(m, mode)])[0]

    m0 = sizes[0]
    # Offloading weighed by `auto` is traced only when the search reaches it (its memory): its work is every
    # layer's plus the copies of what every layer's checkpoints save (`Work.offloadable`), both ways.
    lazy = {mode for mode in modes if mode.offload} if fixed is None else set()
    traced = _uniform_modes([mode for mode in modes if mode not in lazy])
    uniform = dict(zip(traced, predict_all([(m0, u) for u in traced]), strict=True))
    for mode in lazy:
        every = uniform[replace(mode, offload=False)]
        uniform[mode] = replace(every, work=replace(every.work, host_bytes=2 * every.work.offloadable))

    def timed(mode: Checkpointing, m: int) -> Candidate:
        return _timed(uniform, mode, m, m0, layers, per_process, seq_len, rates)

    candidates = sorted((timed(mode, m) for mode in modes for m in sizes), key=_search_order)
    chosen: Candidate | None = None
    too_big: list[Candidate] = []
    weighed: list[Candidate] = []
    for c in candidates:
        if any(_no_smaller(c, t, modes) for t in too_big):
            continue
        # Scaled from the smallest micro-batch first (no trace): the scaling over-states as often as not (by 11%
        # from 1 to 8 on a small Llama), so only a guess far over the budget rules a candidate out unestimated.
        guess = predict(m0, c.checkpointing).scaled_peak(c.micro_batch_size / m0)
        if guess <= GUESS_MARGIN * budget_bytes:
            guess = predict(c.micro_batch_size, c.checkpointing).reserved_bytes
        c = replace(c, peak_bytes=guess, fits=guess <= budget_bytes)
        weighed.append(c)
        if c.fits:
            chosen = c
            break
        too_big.append(c)
    least = next((m for m in reversed(modes) if m.enabled and not m.selective), modes[0])  # the least memory
    if chosen is None and micro_batch_size:
        # A fixed micro-batch is planned as given, fitting or not (BatchPlan.fits): with the least memory.
        est = predict(m0, least)
        chosen = replace(
            _timed(uniform | {least: est}, least, m0, m0, layers, per_process, seq_len, rates),
            peak_bytes=est.reserved_bytes,
            fits=False,
        )
    if chosen is None:
        smallest = predict(sizes[0], least)
        raise MemoryPlanError(
            f"micro-batch {sizes[0]} x {seq_len} tokens is predicted to peak at "
            f"{format_bytes(smallest.reserved_bytes)} ({smallest.peak_phase}), over the budget of "
            f"{format_bytes(budget_bytes)}. Try: {', '.join(_remedies(estimate_kwargs, least))}. Breakdown at"
            " the peak: " + ", ".join(f"{k}={format_bytes(v)}" for k, v in smallest.breakdown.items())
        )
    est = predict(chosen.micro_batch_size, chosen.checkpointing)
    return BatchPlan(
        micro_batch_size=chosen.micro_batch_size,
        grad_accum_steps=per_process // chosen.micro_batch_size,
        num_processes=num_processes,
        source="planner" if not micro_batch_size else "recipe",
        predicted_peak_bytes=est.reserved_bytes,
        budget_bytes=budget_bytes,
        checkpointing=chosen.checkpointing,
        predicted_tokens_per_s=chosen.tokens_per_s,
        rates_source=rates.source,
        frontier=[c.to_dict(layers) for c in _with_estimates(candidates, weighed)],
        estimate=est,
    )


GUESS_MARGIN = 1.5  # a scaled peak above 1.5x the budget is not estimated exactly
# Offloading is weighed as if 2% slower than predicted: what its copies cost beyond the link's time (pinned
# buffers, copies that hold the compute stream) is not modelled, nor yet measured on a GPU; so it is taken where
# it fits a larger micro-batch that is clearly faster, or where nothing else fits, not on a tie. (On a 70B QLoRA
# plan for an H100 it was predicted 0.05% faster than every layer at a quarter of its micro-batch.)
OFFLOAD_MARGIN = 1.02


def _search_order(c: Candidate) -> float:
    return c.step_seconds * (OFFLOAD_MARGIN if c.checkpointing.offload else 1.0)


NOMINAL_RATES = Rates(1e12, 1e12, 1e-5, "nominal rates (no device to measure): a ranking, not a forecast")


def _uniform_modes(modes: list[Checkpointing]) -> list[Checkpointing]:
    """The settings whose estimates give every candidate's work: none and every layer span every k."""
    needed = set()
    for mode in modes:
        if 1 < mode.every_n_layers:
            needed |= {Checkpointing(0), replace(mode, every_n_layers=1)}
        else:
            needed.add(mode)
    return sorted(needed, key=lambda m: (m.every_n_layers, m.selective))


def _timed(
    uniform: dict[Checkpointing, MemoryEstimate],
    mode: Checkpointing,
    m: int,
    m0: int,
    layers: int,
    per_process: int,
    seq_len: int,
    rates: Rates,
) -> Candidate:
    """Predicted step time of `mode` at micro-batch `m` from the estimates at `m0`: forward and backward work
    scales with the tokens, except the op count, at the FLOP rate of `m` x `seq_len` rows; the optimizer's is once
    per step. Every k-th layer recomputed:
    none's work plus the recomputed layers' share of the difference to every layer."""
    if 1 < mode.every_n_layers:
        none, full = uniform[Checkpointing(0)], uniform[replace(mode, every_n_layers=1)]
        share = checkpointed_layers(mode.every_n_layers, layers) / layers
        work = none.work + (full.work - none.work) * share
        update = none.optimizer_work
    else:
        work, update = uniform[mode].work, uniform[mode].optimizer_work
    scaled = replace(work * (m / m0), ops=work.ops)
    seconds = rates.seconds(scaled, rows=m * seq_len) * (per_process // m) + rates.seconds(update)
    return Candidate(m, mode, seconds, per_process * seq_len / seconds)


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


def _mem_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file says kB, meaning KiB
    except OSError:
        pass
    # No /proc (macOS): total physical memory is the best we can do without psutil.
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_budget(device: str | torch.device = "cuda") -> int:
    """Budget for `memory.budget: auto`: what the device has free, less a margin.

    CUDA: free memory from `mem_get_info` (the CUDA context, already created by that call, is
    outside it) less 10% of the card + 512 MiB, because the estimate is of
    the caching allocator's reserved bytes (`allocator.reserved_peak`), which leave out the cuBLAS
    workspace and NCCL buffers, and model the allocator without several streams or its retry.
    CPU: MemAvailable less max(1 GiB, 10%): live tensor bytes leave out Python objects, the
    data pipeline, malloc fragmentation, and whatever else the machine runs meanwhile.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return _cuda_budget(*torch.cuda.mem_get_info(device))
    available = _mem_available_bytes()
    return max(0, available - max(_GiB, int(0.10 * available)))


def _cuda_budget(free: int, total: int) -> int:
    return max(0, free - int(0.10 * total) - 512 * 1024**2)


# The CUDA context of a card we cannot ask (`--gpu NAME`): ~0.3-0.6 GiB with lazy module loading (CUDA >= 11.7).
CUDA_CONTEXT_BYTES = 512 * 1024**2


@dataclass(frozen=True)
class Target:
    """The device a plan is for, its budget per process, and how both were chosen (shown with the plan)."""

    device: str  # "cuda" or "cpu"
    budget_bytes: int
    why: str


def planning_target(
    *, device_memory: str | None, gpu: str | None, device: str | None, recipe_budget: str = "auto"
) -> Target:
    """Where `llmtune estimate` plans for: a size (`--device-memory`), a known card (`--gpu`), the recipe's
    `memory.budget`, or else this machine's own device as `train` would use it (a GPU if there is one, else
    the CPU's free RAM). `device` ("cuda"/"cpu", `--device`) names the kind of device when it is not this
    machine's."""
    from llmtune.catalogue import gpu_memory
    from llmtune.units import parse_bytes

    if device_memory:
        try:
            budget = parse_bytes(device_memory)
        except ValueError as err:
            raise MemoryPlanError(f"--device-memory: {err}") from None
        return Target(device or "cuda", budget, f"--device-memory {device_memory}")
    if gpu:
        total = gpu_memory(gpu)
        return Target(
            "cuda",
            _cuda_budget(total - CUDA_CONTEXT_BYTES, total),
            f"--gpu {gpu}: {format_bytes(total)} less the CUDA context, 10% and 512 MiB for workspaces",
        )
    here = "cuda" if torch.cuda.is_available() else "cpu"
    if recipe_budget != "auto":
        return Target(device or here, parse_bytes(recipe_budget), f"memory.budget {recipe_budget}")
    if device == "cuda" and here != "cuda":
        raise MemoryPlanError(
            "--device cuda: no GPU here to read free memory from; name the card (--gpu h100-80gb) or its memory"
            " (--device-memory 80GiB)"
        )
    if here == "cuda":
        return Target("cuda", default_budget("cuda"), "this machine's GPU: free memory less 10% and 512 MiB")
    return Target(
        "cpu",
        default_budget("cpu"),
        "this machine's CPU (no GPU here; plan for one with --gpu NAME or --device-memory 24GiB):"
        " available RAM less max(1 GiB, 10%)",
    )


def plan_rates(device: str, precision: str, config: Any, gpu: str | None = None) -> Rates:
    """The time model's rates for the device planned for: a GPU named with --gpu from its datasheet, this machine's
    own device measured (memory.speed.measure_rates), else nominal rates that rank candidates but forecast nothing."""
    from llmtune.memory.speed import datasheet_rates, measure_rates

    if gpu:
        return datasheet_rates(gpu, precision) or NOMINAL_RATES
    here = "cuda" if torch.cuda.is_available() else "cpu"
    if device != here:
        return NOMINAL_RATES
    dtype = {"bf16": torch.bfloat16, "bf16-true": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    return measure_rates(device, dtype, config)


def recipe_for_model(
    name: str, config: Any, *, method: str, seq_len: int, device: str, global_batch_size: int = 32
) -> Recipe:
    """The recipe `llmtune estimate --model NAME` plans when no recipe is given: common fine-tuning defaults.

    Checkpointing and the micro-batch planned (the fastest that fits) for a global batch of 32; LoRA / QLoRA as in
    recipes/llama3-8b-lora.yaml (rank 16 on every linear layer, base weights in bf16 on a GPU, since mixed
    precision would keep an fp32 copy of weights that never change); a full fine-tune in mixed precision;
    SDPA attention, or eager for a model without an SDPA path (Gemma-2), as transformers falls back.
    """
    from llmtune.model import SetupError, check_attn_implementation
    from llmtune.recipe import DataConfig, ModelConfig, PeftConfig, TrainingConfig

    try:
        check_attn_implementation(config, "sdpa", installed=False)
        attn = "sdpa"
    except SetupError:
        attn = "eager"
    adapters = method in ("lora", "qlora")
    precision = "bf16-true" if adapters and device == "cuda" else "auto"
    return Recipe(
        model=ModelConfig(name_or_path=name, attn_implementation=attn),
        data=DataConfig(max_length=seq_len),
        training=TrainingConfig(precision=precision, global_batch_size=global_batch_size, micro_batch_size="auto"),
        peft=PeftConfig(method="none" if method == "full" else method, rank=16, alpha=32.0),
    )


# ---------------------------------------------------------------- from a recipe


def expandable_segments(recipe: Recipe) -> bool:
    """Whether CUDA's caching allocator runs with expandable segments: PYTORCH_CUDA_ALLOC_CONF's word, else
    the recipe's `memory.expandable_segments` (which training then applies)."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments" in conf:
        return "expandable_segments:true" in conf.replace(" ", "").lower()
    return recipe.memory.expandable_segments


def estimate_settings(
    recipe: Recipe,
    *,
    loss: str,
    device: str,
    sharding: str = "none",
    precision: str | None = None,
    trained_fraction: float = 1.0,
):
    """The estimator's keyword arguments for `recipe` run on `device` as the training loop would run it.

    `trained_fraction` is the data's `DataStats.max_trained_fraction` where the data is at hand (training);
    without it (`llmtune estimate`) every token is taken as trained, the upper bound.

    `precision` is the resolved mode; left out, the recipe's `auto` is taken as bf16 on CUDA (every GPU
    worth planning for has it) and as the local CPU's choice otherwise.
    """
    from llmtune.memory.estimate import LoraSpec
    from llmtune.model import resolve_precision

    t, peft = recipe.training, recipe.peft
    if precision is None and device == "cuda":  # planning for a GPU that may not be this machine's
        precision = "bf16" if t.precision == "auto" else t.precision
    elif precision is None:
        precision = resolve_precision(t.precision, device)
    lora = None
    if peft.method != "none":
        target = peft.target_modules if isinstance(peft.target_modules, str) else tuple(peft.target_modules)
        lora = LoraSpec(
            rank=peft.rank, target_modules=target, dropout=peft.dropout > 0, alpha=int(peft.alpha), method=peft.method
        )
    optimizer = t.optimizer
    if optimizer == "adamw":
        # What optim.make_optimizer builds: BF16AdamW for bf16 weights (bf16-true without adapters, whose
        # adapters are fp32), fused AdamW otherwise.
        optimizer = "adamw_bf16" if precision == "bf16-true" and peft.method == "none" else "adamw_fused"
    return dict(
        precision=precision,
        layout="packed" if recipe.data.packing else "padded",
        gradient_checkpointing=checkpointing_of(t.gradient_checkpointing) or "auto",
        attn_implementation=recipe.model.attn_implementation,
        optimizer=optimizer,
        loss=loss,
        lora=lora,
        sharding=sharding,
        device=device,
        trained_fraction=max(trained_fraction, 1 / recipe.data.max_length),
        expandable_segments=expandable_segments(recipe),
        objective=t.objective,
        reference=_reference(recipe),
    )


def _reference(recipe: Recipe) -> str:
    if recipe.training.objective == "sft":
        return "none"
    # Only here: llmtune.preference brings in the data pipeline (datasets, pyarrow: ~1 s of imports).
    from llmtune.preference import resolve_reference

    return resolve_reference(recipe.training.objective, recipe.preference, recipe.peft.method)


def resolve_budget(text: str, device: str | torch.device) -> int:
    """`memory.budget` in bytes: a size like 20GiB, or `auto` (default_budget of the device)."""
    from llmtune.units import parse_bytes

    return default_budget(device) if text == "auto" else parse_bytes(text)


def plan_for_budget(
    recipe: Recipe,
    config: Any,
    settings: dict[str, Any],
    *,
    budget_bytes: int,
    num_processes: int,
    rates: Rates | None = None,
) -> BatchPlan:
    """The fastest micro-batch and checkpointing for the recipe's global batch and max_length within
    `budget_bytes`, as far as the recipe leaves them open; a fixed `training.micro_batch_size` is planned as given
    (whether it fits or not: `BatchPlan.fits`)."""
    t = recipe.training
    return plan_micro_batch(
        config,
        global_batch_size=t.global_batch_size,
        num_processes=num_processes,
        budget_bytes=budget_bytes,
        seq_len=recipe.data.max_length,
        micro_batch_size=None if t.micro_batch_size == "auto" else t.micro_batch_size,
        rates=rates,
        **settings,
    )


_METHOD_NAMES = {"lora": "LoRA", "dora": "DoRA", "qlora": "QLoRA (4-bit NF4 base)"}


def format_plan(plan: BatchPlan, title: str) -> str:
    """A readable table: the breakdown at the predicted peak, then the choice."""
    e = plan.estimate
    width = max(len(k) for k in e.breakdown) + 2
    lines = [title, "", f"{'at the peak':<{width}}{'bytes':>12}  share"]
    for name, value in e.breakdown.items():
        lines.append(f"{name:<{width}}{format_bytes(value):>12}  {value / e.peak_bytes:6.1%}")
    s = e.settings
    lines += [
        f"{'peak':<{width}}{format_bytes(e.peak_bytes):>12}  during {e.peak_phase}",
        "",
        f"micro-batch {plan.micro_batch_size} x {s['seq_len']} tokens, gradient accumulation {plan.grad_accum_steps},"
        f" {s['num_processes']} process(es), sharding {s['sharding']}",
        f"{s['precision']}, checkpointing {plan.checkpointing.describe(e.settings['layers'])},"
        f" {s['attn_implementation']} attention, {s['optimizer']}, {s['loss']} loss"
        + (f", {s['objective']} on pairs (reference: {s['reference']})" if s.get("objective", "sft") != "sft" else "")
        + (f", {_METHOD_NAMES[s['lora']['method']]} r={s['lora']['rank']}" if s.get("lora") else ""),
        f"predicted peak {format_bytes(plan.predicted_peak_bytes)} of a {format_bytes(plan.budget_bytes)} budget"
        + ("" if plan.fits else ": DOES NOT FIT")
        + (
            f" (reserved by the caching allocator, {format_bytes(e.peak_bytes)} of it in live tensors,"
            f" expandable segments {'on' if s['expandable_segments'] else 'off'}; the CUDA context and"
            " cuBLAS/NCCL workspaces are outside it)"
            if s["device"] == "cuda"
            else " (live tensors only: Python objects and the data pipeline are outside it)"
        ),
    ]
    if len(plan.frontier) > 1:
        lines += ["", *format_frontier(plan)]
    return "\n".join(lines)


def format_frontier(plan: BatchPlan) -> list[str]:
    """What the planner weighed, fastest first: memory saved against speed paid, the choice marked. One row per
    setting -- its fastest candidate that fits, else its smallest micro-batch weighed (why it was ruled out),
    else its fastest not weighed -- and the choice. Nominal rates (no device to measure) give speeds relative to
    the fastest candidate only."""
    nominal = plan.rates_source == NOMINAL_RATES.source
    top = max((c["predicted_tokens_per_s"] for c in plan.frontier), default=1.0)

    def is_chosen(c: dict[str, Any]) -> bool:
        ckpt = plan.checkpointing
        return (c["micro_batch_size"], c["every_n_layers"], c["selective"], c.get("offload", False)) == (
            plan.micro_batch_size,
            ckpt.every_n_layers,
            ckpt.selective,
            ckpt.offload,
        )

    shown: dict[str, dict[str, Any]] = {}
    for c in plan.frontier:  # fastest first
        kept = shown.get(c["checkpointing"])
        if kept is None or kept["fits"] is None or (c["fits"] is not None and not kept["fits"]) or is_chosen(c):
            shown[c["checkpointing"]] = c
    rows = [("checkpointing", "micro", "peak", "x fastest" if nominal else "tokens/s", "fits", "")]
    for c in sorted(shown.values(), key=lambda c: -c["predicted_tokens_per_s"]):
        speed = c["predicted_tokens_per_s"]
        rows.append(
            (
                c["checkpointing"],
                str(c["micro_batch_size"]),
                c["predicted_peak"] or "-",
                f"{speed / top:.2f}" if nominal else f"{speed:,.0f}",
                {True: "yes", False: "no", None: "-"}[c["fits"]],
                "<- chosen" if is_chosen(c) else "",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = [
        f"weighed (time model: {plan.rates_source}; '-': not estimated, ruled out by a setting that did not fit or"
        " slower than the choice):"
    ]
    for r in rows:
        lines.append(
            "  "
            + r[0].ljust(widths[0])
            + "".join(f"  {r[i].rjust(widths[i])}" for i in range(1, 5))
            + (f"  {r[5]}" if r[5] else "")
        )
    return lines
