"""The training loop: `fit` runs the optimizer steps of a built run (llmtune.run.setup.build), explicit from top to
bottom, then writes `final/`.

Each optimizer step takes this process's share of the global batch (llmtune.run.batches, made ahead in the
background), splits it into micro-batches as the plan says, and normalises the loss by the objective's units (trained
tokens, or pairs) of the whole window on all processes, so the update is the same whatever the micro-batch or process
count. Evaluation (llmtune.run.evaluate) and checkpoints (llmtune.run.saving) come between steps.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.contrib.logging import logging_redirect_tqdm

from llmtune.data.batch import to_device
from llmtune.data.prefetch import Prefetcher
from llmtune.ops.measure import PeakMemoryTracker
from llmtune.parallel import engines
from llmtune.plan.planning import shrink_plan
from llmtune.recipe import Recipe, dump_recipe
from llmtune.run import checkpoint
from llmtune.run.batches import batches_for, prepare_ahead, step_batches
from llmtune.run.evaluate import evaluate_and_log, evaluation_due
from llmtune.run.metrics import MetricsLogger
from llmtune.run.preemption import Preemption
from llmtune.run.resilience import (
    NonFiniteGuard,
    stop_after_out_of_memory,
)
from llmtune.run.saving import save_final, save_or_stop
from llmtune.run.schedule import set_learning_rate
from llmtune.run.setup import build
from llmtune.run.state import Run, StepBatches, StepResult
from llmtune.run.summary import Measured, log_step, run_summary

log = logging.getLogger(__name__)


def fit(run: Run) -> dict[str, Any]:
    """`loop`, then the output_dir's lock released: another run may use the folder once this one has ended."""
    try:
        return loop(run)
    finally:
        run.lock.release()
        engines.close_host_group(run.host_group)


def loop(run: Run) -> dict[str, Any]:
    r, acc = run.recipe, run.accelerator
    out = Path(r.output_dir)
    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "recipe.yaml").write_text(dump_recipe(r))
    metrics = MetricsLogger(acc, out, r, total_steps=r.training.max_steps, start_step=run.start_step)
    guard = NonFiniteGuard(r.training.max_nonfinite_steps, checkpoint.checkpoints_root(out))
    eval_loss = None
    measured = Measured()
    step = run.start_step
    started = time.perf_counter()
    # from_pretrained returns the model in eval mode, and transformers checkpoints activations (and applies
    # dropout) only in training mode: without this the steps before the first evaluation ran with neither.
    run.model.train()
    # Log lines go through the progress bar's own writer where one is drawn: printed straight to the terminal, they
    # land on the bar's line. The next step's rows are drawn and collated in the background while this one trains
    # (`prepare_ahead`).
    with (
        Preemption(first_grace_s=r.distributed.timeout, release=run.lock.release) as preemption,
        logging_redirect_tqdm() if metrics.drawn else contextlib.nullcontext(),
        Prefetcher(lambda s: prepare_ahead(run, s), end=r.training.max_steps, device=acc.device) as upcoming,
    ):
        while step < r.training.max_steps:
            begun = time.perf_counter()  # the whole step, rollout (GRPO) to checkpoint: the grace a signal gives
            batches = batches_for(run, upcoming.get(step), step)
            lr = set_learning_rate(run.optimizer, r, step)
            t0 = time.perf_counter()  # the optimizer step alone: its speed
            result, peak, reserved = measured_step(run, batches, step)
            if result is None:  # out of memory: the plan shrank; redo the same step
                continue
            guard.check(step, result.finite, result.loss, result.grad_norm, result.loss_scale)
            run.counters["skipped_steps"] += int(not result.finite or result.overflow)  # overflow: fp16's scaler
            step += 1
            run.counters["trained_tokens"] += result.trained_tokens
            measured.memory(run, step, peak, reserved, len(batches.rows))
            seconds = time.perf_counter() - t0
            measured.time(run, step, seconds)
            log_step(run, metrics, step, result, lr=lr, seconds=seconds, peak=peak, reserved=reserved)
            if evaluation_due(run, step):
                eval_loss = evaluate_and_log(run, metrics, step, len(batches.rows))
            if save_or_stop(run, step, preemption, checkpoint_ok=not guard.in_a_row):
                metrics.close()
                # Still under the handler: once one process has exited the launcher SIGTERMs the others, and one that
                # died holding the lock would leave it to refuse a requeue on another host until its lease expires.
                run.lock.release()
                return {"preempted_at_step": step}
            preemption.timed(time.perf_counter() - begun)
        # Under the handler: a signal now lets the final model be written whole (the run is done: exit 0), where the
        # default action cut the write and, without checkpoints, lost the whole run.
        preemption.then = "finishing the final save (the run is done), then exiting"
        with preemption.saving():
            final = save_final(run, step, eval_loss)
    summary = run_summary(run, metrics, measured.peaks, time.perf_counter() - started, step, eval_loss, final)
    metrics.close(summary)
    return summary


def measured_step(run: Run, batches: StepBatches, step: int) -> tuple[StepResult | None, int | None, int | None]:
    """`train_step`, and its peak live and reserved bytes where 0-based `step` is measured. On CUDA the allocator
    counts for free; on a CPU counting live tensors slows a step down (~1.5x on tiny models), so only the first steps
    and the logged ones are measured there. Steps 3 and 4 are never counted: they time the step for the time model
    (`check_speed`)."""
    acc = run.accelerator
    every = run.recipe.logging.every_n_steps
    if not (acc.device.type == "cuda" or step < 2 or (step > 3 and (step + 1) % every == 0)):
        return train_step(run, batches), None, None
    tracker = PeakMemoryTracker(acc.device, baseline=[run.model, run.optimizer])
    with tracker:
        result = train_step(run, batches)
    # The reserved bytes are what the budget is held against.
    return result, tracker.peak_bytes, tracker.peak_reserved_bytes


def train_step(run: Run, batches: StepBatches | list[dict]) -> StepResult | None:
    """One optimizer step over this process's batches (or rows, split here), or None when it ran out of memory in a
    forward or backward and the plan was shrunk (one process without DeepSpeed; otherwise `stop_after_out_of_memory`).

    The host waits for the device once a step, whatever the micro-batches: the window's counts are host integers
    (summed over processes on the host), every micro-batch is copied from pinned memory without waiting, and the
    loss, statistics and gradient norm are read together (`clip_and_update`)."""
    acc, model = run.accelerator, run.model
    if not isinstance(batches, StepBatches):
        batches = step_batches(run, batches)
    # The loss is summed per unit (trained token, or pair) and divided by the units of the whole window on all
    # processes, so long and short examples weigh the same whatever the micro-batching. DDP averages gradients
    # over processes, hence the factor num_processes.
    total, processed, squares, units = engines.sum_on_host(batches.counts, run.host_group)
    scale = acc.num_processes / max(units, 1)
    sums = torch.zeros((), device=acc.device)  # [loss, *the objective's stats], summed
    oom = False
    try:
        for i, batch in enumerate(batches.micro_batches):
            with engines.micro_step(acc, run.engine, model, last=i == len(batches.micro_batches) - 1):
                out = model(**to_device(batch, acc.device)).reshape(-1)
                engines.backward(acc, run.engine, out[0] * scale)
            sums = sums + out.detach().float()
    except torch.OutOfMemoryError:
        if not engines.can_redo_step(acc, run.engine):
            stop_after_out_of_memory(run, "forward/backward", len(batches.rows))
        oom = True
    if oom:  # nothing was updated yet: the same step is redone with smaller micro-batches
        run.optimizer.zero_grad(set_to_none=True)
        run.plan = shrink_plan(run.plan, len(batches.rows))
        log.warning(
            "out of memory: micro-batch now %d, accumulation %d", run.plan.micro_batch_size, run.plan.grad_accum_steps
        )
        return None
    try:
        loss, stats, grad_norm, overflow, finite, loss_scale = clip_and_update(run, acc.reduce(sums, reduction="sum"))
    except torch.OutOfMemoryError:  # the weights may be half-updated: only the last checkpoint is sound
        stop_after_out_of_memory(run, "clipping/optimizer step", len(batches.rows))
    run.optimizer.zero_grad(set_to_none=True)
    flops = run.flops.step(processed, total, squares)
    metrics = run.objective.metrics(stats, units)
    return StepResult(loss / max(units, 1), total, flops, grad_norm, overflow, finite, metrics, loss_scale)


def clip_and_update(run: Run, sums: torch.Tensor) -> tuple[float, list[float], float, bool, bool, float | None]:
    """Clip, and update unless the loss or the gradients are non-finite; (loss summed, the objective's stats summed,
    grad norm, overflow, finite, loss scale) read from the device in one copy: each `float()` or `.item()` of a
    device tensor waits for all the work queued before it.

    Where the loop decides the skip itself, the read comes before the update. fp16's scaler and DeepSpeed keep inf/nan
    gradients out of the weights themselves: there the update comes first and the read after it, so a non-finite
    loss whose gradients are finite would be stepped (a non-finite loss comes from non-finite logits, whose gradients
    are not finite either); it is counted by the guard all the same. fp16: an overflow skips the update and halves
    the scale, which above 1 is the scaler finding its level; at 1 or below the gradients overflow unscaled:
    non-finite, and counted by the guard like any other, or a run that overflows every step would never stop.
    """
    acc, engine, optimizer = run.accelerator, run.engine, run.optimizer
    norm = engines.clip_grad_norm(acc, engine, run.model, run.recipe.training.max_grad_norm)
    if not engines.skips_nonfinite_updates(acc, engine):
        loss, *stats, grad_norm = read_once(sums, norm)
        # A finite loss can still give inf/nan gradients: stepping would write them into the weights and the next
        # checkpoint.
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if finite:
            engines.optimizer_step(optimizer, None)
        return loss, stats, grad_norm, False, finite, None
    fp16 = engines.optimizer_step(optimizer, acc.scaler)
    if fp16 is None:  # DeepSpeed: the engine stepped, or skipped, inside the window's last backward
        loss, *stats, grad_norm = read_once(sums, norm)
        scale, overflow = None, engines.step_was_skipped(optimizer)
    else:
        loss, *stats, grad_norm, scale, skipped = read_once(sums, norm, fp16)
        overflow = bool(skipped)
    finite = math.isfinite(loss) and not (overflow and scale is not None and scale <= 1)
    return loss, stats, grad_norm, overflow, finite, scale


def read_once(*tensors: torch.Tensor) -> list[float]:
    """The tensors' values on the host, in one copy from the device."""
    return torch.cat([t.detach().reshape(-1).float() for t in tensors]).tolist()


def train(recipe: Recipe) -> dict[str, Any]:
    return fit(build(recipe))
