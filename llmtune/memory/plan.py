"""Pick the micro-batch from the memory estimate; the recipe's global batch never changes."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from llmtune.memory.estimate import MemoryEstimate, estimate
from llmtune.recipe import Recipe
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
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "estimate"}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> BatchPlan:
        return cls(**state)

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


def plan_micro_batch(
    config: Any,
    *,
    global_batch_size: int,
    num_processes: int = 1,
    budget_bytes: int,
    seq_len: int,
    **estimate_kwargs: Any,
) -> BatchPlan:
    """Largest micro-batch whose estimated peak fits `budget_bytes` and divides the global batch.

    The peak grows with the micro-batch (it is affine in it at a fixed length), so a binary
    search over the allowed micro-batches needs about log2(#divisors + 1) estimates.
    """
    candidates = _candidates(global_batch_size, num_processes)
    # Each estimate traces a training step on fake tensors: a second or more on a large config.
    log.info(
        "estimating peak memory: micro-batches %s x %d tokens against %s (a few estimates, ~1-4 s each)",
        "/".join(map(str, candidates)),
        seq_len,
        format_bytes(budget_bytes),
    )

    def predict(m: int) -> MemoryEstimate:
        accum = global_batch_size // (m * num_processes)
        return estimate(
            config,
            micro_batch_size=m,
            seq_len=seq_len,
            num_processes=num_processes,
            grad_accum_steps=accum,
            **estimate_kwargs,
        )

    # Binary search over all candidates: ceil(log2(n + 1)) estimates (3 for 1/2/4/8/16/32).
    lo, hi = 0, len(candidates) - 1
    best: tuple[int, MemoryEstimate] | None = None
    smallest: MemoryEstimate | None = None
    while lo <= hi:
        mid = (lo + hi) // 2
        est = predict(candidates[mid])
        if mid == 0:
            smallest = est
        if est.reserved_bytes <= budget_bytes:
            best = (candidates[mid], est)
            lo = mid + 1
        else:
            hi = mid - 1
    if best is None:
        assert smallest is not None  # the search ends below the smallest candidate only after trying it
        raise MemoryPlanError(
            f"micro-batch 1 x {seq_len} tokens is predicted to peak at "
            f"{format_bytes(smallest.reserved_bytes)} ({smallest.peak_phase}), over the budget of "
            f"{format_bytes(budget_bytes)}. Try: {', '.join(_remedies(estimate_kwargs))}. Breakdown at the peak: "
            + ", ".join(f"{k}={format_bytes(v)}" for k, v in smallest.breakdown.items())
        )
    m, est = best
    return BatchPlan(
        micro_batch_size=m,
        grad_accum_steps=global_batch_size // (m * num_processes),
        num_processes=num_processes,
        source="planner",
        predicted_peak_bytes=est.reserved_bytes,
        budget_bytes=budget_bytes,
        estimate=est,
    )


def _remedies(settings: dict[str, Any]) -> list[str]:
    """What would lower the peak, leaving out what the run already does."""
    remedies = [
        ("gradient checkpointing", not settings.get("gradient_checkpointing")),
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


def recipe_for_model(
    name: str, config: Any, *, method: str, seq_len: int, device: str, global_batch_size: int = 32
) -> Recipe:
    """The recipe `llmtune estimate --model NAME` plans when no recipe is given: common fine-tuning defaults.

    Checkpointing on, the micro-batch planned for a global batch of 32; LoRA / QLoRA as in
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
        gradient_checkpointing=t.gradient_checkpointing,
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


def plan_for_budget(recipe: Recipe, config: Any, settings: dict[str, Any], *, budget_bytes: int, num_processes: int):
    """The largest micro-batch for the recipe's global batch and max_length within `budget_bytes`; a fixed
    `training.micro_batch_size` is estimated as given (whether it fits or not: `BatchPlan.fits`)."""
    t = recipe.training
    if t.micro_batch_size != "auto":
        m = t.micro_batch_size
        accum = max(1, t.global_batch_size // (m * num_processes))
        est = estimate(
            config,
            micro_batch_size=m,
            seq_len=recipe.data.max_length,
            num_processes=num_processes,
            grad_accum_steps=accum,
            **settings,
        )
        return BatchPlan(m, accum, num_processes, "recipe", est.reserved_bytes, budget_bytes, est)
    return plan_micro_batch(
        config,
        global_batch_size=recipe.training.global_batch_size,
        num_processes=num_processes,
        budget_bytes=budget_bytes,
        seq_len=recipe.data.max_length,
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
        f"{s['precision']}, checkpointing {'on' if s['gradient_checkpointing'] else 'off'},"
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
    return "\n".join(lines)
