"""What a run says about itself: the setup lines before the first step, each step's metrics, what its measured steps
showed (the steady peaks, held against the budget; the time model's check on steps 3 and 4), and `run_summary.json`
at the end."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from llmtune.parallel import engines
from llmtune.run.launch import host_load
from llmtune.run.metrics import MetricsLogger
from llmtune.run.resilience import check_budget
from llmtune.run.schedule import lr_factor
from llmtune.run.state import Run, StepResult

log = logging.getLogger(__name__)


def log_setup(run: Run, trainable: int, total: int) -> None:
    r, p = run.recipe, run.plan
    lines = [
        f"model          {r.model.name_or_path} ({total / 1e6:.1f}M params, {trainable / 1e6:.2f}M trainable)",
        f"launch         {run.engine} ({run.accelerator.distributed_type.value}) x {run.accelerator.num_processes}"
        f" on {run.accelerator.device}",
        f"precision      {run.precision} ({run.precision_why})",
        f"checkpointing  {p.checkpointing.describe(run.num_layers)} ({'planned' if p.frontier else 'the recipe'})",
        f"batch          global {r.training.global_batch_size} = micro {p.micro_batch_size} x accumulation "
        f"{p.grad_accum_steps} x processes {p.num_processes // p.sequence_parallel} (micro-batch from {p.source})",
        *[f"sequence       each row split across {p.sequence_parallel} processes"] * (p.sequence_parallel > 1),
        f"memory         {p.describe()}",
        f"MFU peak       {run.peak_flops / 1e12:.1f} TFLOP/s ({run.peak_flops_source})",
        f"data           {run.data.stats.examples} examples -> {len(run.data.train)} rows, "
        f"{run.data.stats.trained_tokens} trained tokens",
        f"steps          {run.start_step} -> {r.training.max_steps}",
    ]
    if r.training.warmup_steps > r.training.max_steps:
        lines.append(
            f"warmup         {r.training.warmup_steps} steps, longer than the run: the learning rate stops at"
            f" {lr_factor(r.training.max_steps - 1, r):.0%} of its peak"
        )
    log.info("llmtune run\n  " + "\n  ".join(lines))


def slow_cause(device_type: str, load: float, cores: int) -> str:
    """The likeliest cause of a run slower than its forecast that the run can see: on a CPU, a host busier than its
    cores (this run's own threads included), before the plan itself."""
    if device_type == "cpu" and load > cores + 0.5:
        return (
            f"the host is busy (load average {load:.1f} on {cores} cores): other processes take the cores the rates"
            " were measured on; OMP_NUM_THREADS=1 helps where they spin-wait"
        )
    return "the plan may not be the fastest here; `llmtune estimate --recipe` shows what it weighed"


def check_speed(run: Run, seconds: float) -> dict[str, Any] | None:
    """The time model's predicted tokens/s against the run's own (steps 3 and 4), logged when 15% or more below."""
    predicted = run.plan.predicted_tokens_per_s
    if predicted is None:
        return None
    # A process's tokens: its rows, or under sequence parallelism its part of its group's rows.
    tokens = run.recipe.training.global_batch_size * run.recipe.data.max_length // run.plan.num_processes
    measured = tokens / seconds
    speed = {
        "predicted_tokens_per_s": round(predicted, 1),
        "measured_tokens_per_s": round(measured, 1),
        "measured_over_predicted": round(measured / predicted, 3),
        "rates": run.plan.rates_source,
        "measured_on_steps": [3, 4],
    }
    if measured < 0.85 * predicted:
        log.warning(
            "the time model predicted %.0f tokens/s per process (every position of its rows) for this plan and the"
            " run makes %.0f (%.0f%% below): %s",
            predicted,
            measured,
            100 * (1 - measured / predicted),
            slow_cause(run.accelerator.device.type, *host_load()),
        )
    else:
        log.info(
            "speed: %.0f tokens/s per process (every position of its rows), the time model predicted %.0f",
            measured,
            predicted,
        )
    return speed


def run_summary(
    run: Run,
    metrics: MetricsLogger,
    peaks: dict[str, int],
    seconds: float,
    step: int,
    eval_loss: float | None,
    final: Path,
) -> dict[str, Any]:
    return {
        "precision": run.precision,
        "gradient_checkpointing": run.plan.checkpointing.enabled,
        "checkpointing": asdict(run.plan.checkpointing),
        "time_model": run.speed,
        "micro_batch_size": run.plan.micro_batch_size,
        "grad_accum_steps": run.plan.grad_accum_steps,
        "num_processes": run.plan.num_processes,
        "sequence_parallel": run.plan.sequence_parallel,
        "engine": run.engine,
        "optimizer_updates": engines.optimizer_updates(run.optimizer),
        # This (the main) process's parameter bytes: its shards under FSDP2 and ZeRO-3.
        "local_parameter_bytes": engines.local_parameter_bytes(run.model),
        "global_batch_size": run.recipe.training.global_batch_size,
        "steps": step,
        "trained_tokens": run.counters["trained_tokens"],
        "seconds": seconds,
        "tokens_per_s": metrics.tokens_per_s(),
        **peaks,  # steady-state (after step 1) peaks of live tensors and, on CUDA, of the allocator's reserve
        "memory_plan": run.plan.to_dict(),
        "skipped_steps": run.counters["skipped_steps"],
        "eval_loss": eval_loss,
        "final_dir": str(final),
    }


def log_step(
    run: Run,
    metrics: MetricsLogger,
    step: int,
    result: StepResult,
    *,
    lr: float,
    seconds: float,
    peak: int | None,
    reserved: int | None,
) -> None:
    metrics.log_step(
        step,
        loss=result.loss,
        lr=lr,
        grad_norm=result.grad_norm,
        trained_tokens=result.trained_tokens,
        seconds=seconds,
        tokens_per_s=result.trained_tokens / seconds,
        mfu=result.flops / seconds / run.peak_flops / run.accelerator.num_processes,
        peak_memory_bytes=peak,
        peak_reserved_bytes=reserved,
        skipped_steps=run.counters["skipped_steps"],
        micro_batch_size=run.plan.micro_batch_size,
        memory_tracked=peak is not None,
        **result.extra,
    )


@dataclass
class Measured:
    """What `fit` keeps of its measured steps: the steady-state peaks (AdamW's states appear during step 1, so from
    step 2 on), held against the budget, and the seconds of steps 3 and 4, which check the time model's speed."""

    peaks: dict[str, int] = field(default_factory=lambda: {"peak_memory_bytes": 0, "peak_reserved_bytes": 0})
    timed: list[float] = field(default_factory=list)  # the first two steps are warm-up and memory measurement

    def memory(self, run: Run, step: int, peak: int | None, reserved: int | None, rows: int) -> None:
        """Optimizer step `step` (1-based), over `rows` rows a process, peaked at `peak` live and `reserved` bytes
        (None where it was not measured)."""
        if step > 1 and peak:
            self.peaks["peak_memory_bytes"] = max(self.peaks["peak_memory_bytes"], peak)
            self.peaks["peak_reserved_bytes"] = max(self.peaks["peak_reserved_bytes"], reserved)
            check_budget(run, step, reserved, per_process=rows)

    def time(self, run: Run, step: int, seconds: float) -> None:
        """Optimizer step `step` took `seconds`."""
        if step in (3, 4):
            self.timed.append(seconds)
            if step == 4 or step == run.recipe.training.max_steps:
                run.speed = check_speed(run, sum(self.timed) / len(self.timed))
