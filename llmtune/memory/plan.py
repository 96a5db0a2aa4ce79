"""Pick the micro-batch from the memory estimate; the recipe's global batch never changes."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from llmtune.memory.estimate import MemoryEstimate, estimate, format_bytes
from llmtune.recipe import Recipe

_GiB = 1024**3


class MemoryPlanError(ValueError):
    """Even micro-batch 1 does not fit the memory budget."""


@dataclass
class MemoryPlan:
    micro_batch_size: int
    grad_accum_steps: int
    predicted_peak_bytes: int
    budget_bytes: int
    estimate: MemoryEstimate

    def to_dict(self) -> dict[str, Any]:
        return {
            "micro_batch_size": self.micro_batch_size,
            "grad_accum_steps": self.grad_accum_steps,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_peak": format_bytes(self.predicted_peak_bytes),
            "budget_bytes": self.budget_bytes,
            "budget": format_bytes(self.budget_bytes),
            "peak_bytes": self.predicted_peak_bytes,
            "peak_phase": self.estimate.peak_phase,
            "breakdown": self.estimate.breakdown,
            "estimate": self.estimate.to_dict(),
        }


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
) -> MemoryPlan:
    """Largest micro-batch whose estimated peak fits `budget_bytes` and divides the global batch.

    The peak grows with the micro-batch (it is affine in it at a fixed length), so a binary
    search over the allowed micro-batches needs about log2(#divisors) estimates.
    """
    candidates = _candidates(global_batch_size, num_processes)

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

    lo, hi = 0, len(candidates) - 1
    best: tuple[int, MemoryEstimate] | None = None
    first = predict(candidates[0])
    if first.peak_bytes > budget_bytes:
        raise MemoryPlanError(
            f"micro-batch 1 x {seq_len} tokens is predicted to peak at "
            f"{format_bytes(first.peak_bytes)} ({first.peak_phase}), over the budget of "
            f"{format_bytes(budget_bytes)}. Try: {', '.join(_remedies(estimate_kwargs))}. Breakdown at the peak: "
            + ", ".join(f"{k}={format_bytes(v)}" for k, v in first.breakdown.items())
        )
    best = (candidates[0], first)
    lo = 1
    while lo <= hi:
        mid = (lo + hi) // 2
        est = predict(candidates[mid])
        if est.peak_bytes <= budget_bytes:
            best = (candidates[mid], est)
            lo = mid + 1
        else:
            hi = mid - 1
    m, est = best
    return MemoryPlan(
        micro_batch_size=m,
        grad_accum_steps=global_batch_size // (m * num_processes),
        predicted_peak_bytes=est.peak_bytes,
        budget_bytes=budget_bytes,
        estimate=est,
    )


def _remedies(settings: dict[str, Any]) -> list[str]:
    """What would lower the peak, leaving out what the run already does."""
    remedies = [
        ("gradient checkpointing", not settings.get("gradient_checkpointing")),
        ("bf16 (or bf16-true)", not str(settings.get("precision", "")).startswith("bf16")),
        ("LoRA", settings.get("lora") is None),
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
    `max_memory_allocated`, which leaves out the cuBLAS workspace, NCCL buffers and the caching
    allocator's fragmentation (reserved minus allocated, typically 5-15% in training).
    CPU: MemAvailable less max(1 GiB, 10%): live tensor bytes leave out Python objects, the
    data pipeline, malloc fragmentation, and whatever else the machine runs meanwhile.
    """
    device = torch.device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return max(0, free - int(0.10 * total) - 512 * 1024**2)
    available = _mem_available_bytes()
    return max(0, available - max(_GiB, int(0.10 * available)))


# ---------------------------------------------------------------- from a recipe


def estimate_settings(recipe: Recipe, *, loss: str, device: str, sharding: str = "none", precision: str | None = None):
    """The estimator's keyword arguments for `recipe` run on `device` as the training loop would run it.

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
    if peft.method != "none":  # DoRA's magnitude vectors and QLoRA's 4-bit base are not modelled: LoRA's figure
        target = peft.target_modules if isinstance(peft.target_modules, str) else tuple(peft.target_modules)
        lora = LoraSpec(rank=peft.rank, target_modules=target, dropout=peft.dropout > 0, alpha=int(peft.alpha))
    optimizer = t.optimizer
    if optimizer == "adamw":
        # What optim.make_optimizer builds: BF16AdamW for bf16 weights (bf16-true without adapters, whose
        # adapters are fp32), fused AdamW otherwise.
        optimizer = "adamw_bf16" if precision == "bf16-true" and peft.method == "none" else "adamw_fused"
    return dict(
        precision=precision,
        gradient_checkpointing=t.gradient_checkpointing,
        attn_implementation=recipe.model.attn_implementation,
        optimizer=optimizer,
        loss=loss,
        lora=lora,
        sharding=sharding,
        device=device,
    )


def resolve_budget(text: str, device: str | torch.device) -> int:
    """`memory.budget` in bytes: a size like 20GiB, or `auto` (default_budget of the device)."""
    from llmtune.memory.estimate import parse_bytes

    return default_budget(device) if text == "auto" else parse_bytes(text)


def plan_for_budget(recipe: Recipe, config: Any, settings: dict[str, Any], *, budget_bytes: int, num_processes: int):
    """The largest micro-batch for the recipe's global batch and max_length within `budget_bytes`."""
    return plan_micro_batch(
        config,
        global_batch_size=recipe.training.global_batch_size,
        num_processes=num_processes,
        budget_bytes=budget_bytes,
        seq_len=recipe.data.max_length,
        **settings,
    )


def format_plan(plan: MemoryPlan, title: str) -> str:
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
        + (f", LoRA r={s['lora']['rank']}" if s.get("lora") else ""),
        f"predicted peak {format_bytes(plan.predicted_peak_bytes)} of a {format_bytes(plan.budget_bytes)} budget"
        " (tensors only: the CUDA context, cuBLAS/NCCL workspaces and fragmentation are outside it)",
    ]
    return "\n".join(lines)
