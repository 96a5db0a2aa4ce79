"""The training loop: recipe in, checkpoints, metrics and a saved model out.

`build` does everything before the first step, in the order data flows (launch and precision -> tokenizer and
data -> memory plan -> model -> `parallelize` -> the objective's pre-training pass -> resume); `fit` is the loop
itself, explicit from top to bottom. Each optimizer step takes this process's share of the global batch, splits it
into micro-batches as the memory plan says, and normalises the loss by the objective's units (trained tokens, or
pairs) of the whole window on all processes, so the update is the same whatever the micro-batch or process count.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.contrib.logging import logging_redirect_tqdm

from llmtune import checkpoint, parallel, rundir, sequence
from llmtune.data import DataError, batch_for_step, eval_batches, prepare_data, squared_lengths
from llmtune.data.batch import to_device
from llmtune.data.prefetch import Prefetcher, pinned
from llmtune.errors import EXIT_PREEMPTED
from llmtune.launch import make_accelerator
from llmtune.loss import resolve_loss_impl
from llmtune.memory import BatchPlan, PeakMemoryTracker
from llmtune.metrics import MetricsLogger, peak_flops
from llmtune.model import load_config, load_model, load_tokenizer
from llmtune.objectives import AttachContext, Objective, objective_for, trained_tokens
from llmtune.objectives.base import FromData
from llmtune.parallelize import parallelize
from llmtune.planning import PlanError, TrainingError, plan_run, shrink_plan
from llmtune.preemption import Preemption
from llmtune.recipe import Recipe, dump_recipe, flatten
from llmtune.resilience import (
    OOM_FILE,
    NonFiniteGuard,
    plan_after_out_of_memory,
    stop_after_out_of_memory,
    stop_out_of_memory,
)
from llmtune.run import Run, StepBatches, StepResult
from llmtune.schedule import lr_factor, set_learning_rate
from llmtune.summary import Measured, log_setup, log_step, run_summary

# Names the tests, scripts and users import from here.
__all__ = ["EXIT_PREEMPTED", "OOM_FILE", "PlanError", "Run", "TrainingError", "build", "fit", "lr_factor", "train"]

log = logging.getLogger(__name__)


def build(recipe: Recipe) -> Run:
    # The first line of a run: where to look (the folder is created when the run claims it, below).
    log.info(
        "llmtune run -> %s (recipe.yaml, metrics.jsonl, run_summary.json, checkpoints/, final/)",
        Path(recipe.output_dir).resolve(),
    )
    objective = objective_for(recipe)
    engine = parallel.launched_engine()
    accelerator, precision, precision_why = make_accelerator(recipe, engine, objective)
    engine = parallel.engine_in_use(engine)
    # Before anything heavy loads: a refusal costs nothing.
    resume_from = checkpoint.agreed_resume_point(accelerator, recipe, engine)
    lock = rundir.claim(accelerator, recipe.output_dir, resuming=resume_from is not None, overwrite=recipe.overwrite)
    try:
        run = assemble(recipe, objective, engine, accelerator, precision, precision_why, resume_from, lock)
    except BaseException:
        lock.release()
        raise
    return run


def assemble(
    recipe: Recipe,
    objective: Objective,
    engine: parallel.Engine,
    accelerator: Accelerator,
    precision: str,
    precision_why: str,
    resume_from: Path | None,
    lock: rundir.RunLock,
) -> Run:
    """Tokenizer and data -> memory plan -> model -> `parallelize` -> the objective's pre-training pass -> resume.
    `lock`: the output_dir's, the Run's to release when `fit` ends, however it ends."""
    set_seed(recipe.seed)
    tokenizer = load_tokenizer(recipe.model)
    data = prepare_data(recipe.data, tokenizer, seed=recipe.seed, main_process_first=accelerator.main_process_first)
    enough_rows(len(data.train), objective.draw(0, recipe.training.global_batch_size)[1])
    config = load_config(recipe.model)
    loss_impl = resolve_loss_impl(recipe.training.loss, config)
    plan = resumed_plan(recipe, accelerator, resume_from)
    if plan is None:
        plan = plan_run(recipe, config, precision, accelerator, engine, data.stats.max_trained_fraction)
    # Before the objective's pre-training pass: DPO's reference runs at the plan's micro-batch.
    plan = plan_after_out_of_memory(recipe.output_dir, accelerator, plan)
    # Before the model loads (its attention is the group's) and the data is drawn (a group trains the same rows).
    acc = accelerator
    group = sequence.mesh_group(acc.device.type, acc.process_index, acc.num_processes, plan.sequence_parallel)
    sequence.use(group)
    model = load_model(recipe, precision, config, accelerator.device, sequence_parallel=plan.sequence_parallel)
    parts = parallelize(
        model, recipe, objective, plan, loss_impl=loss_impl, engine=engine, precision=precision, accelerator=accelerator
    )
    # Through the prepared module, before any update or resume (DPO's precomputed reference).
    context = AttachContext(
        recipe, accelerator, precision, loss_impl, tokenizer.pad_token_id, plan, tokenizer, engine, parts.optimizer
    )
    try:
        data = objective.attach(parts.module, data, context)
    except torch.OutOfMemoryError:  # DPO's reference log-probs, computed at the plan's micro-batch
        smaller = None if plan.micro_batch_size == 1 else shrink_plan(plan, plan.micro_batch_size).micro_batch_size
        stop_out_of_memory(recipe.output_dir, accelerator.process_index, lock, "reference log-probs",
                           "micro_batch_size", plan.micro_batch_size, smaller)  # fmt: skip
    if recipe.peft.method != "none":
        checkpoint.save_trainable_only(accelerator)
    peak, peak_source = peak_flops(accelerator.device, precision)
    run = Run(
        recipe=recipe,
        accelerator=accelerator,
        precision=precision,
        precision_why=precision_why,
        tokenizer=tokenizer,
        data=data,
        objective=objective,
        model=parts.module,
        engine=engine,
        optimizer=parts.optimizer,
        plan=plan,
        flops=parts.flops,
        peak_flops=peak,
        peak_flops_source=peak_source,
        num_layers=int(config.get_text_config().num_hidden_layers),
        lock=lock,
        host_group=parallel.host_group(accelerator, recipe.distributed.timeout),
        sequence=group,
    )
    if resume_from is not None:
        resume(run, resume_from)
    log_setup(run, *parts.parameters)
    return run


def resumed_plan(recipe: Recipe, accelerator: Accelerator, resume_from: Path | None) -> BatchPlan | None:
    """The plan a resumed run started with (same micro-batch, same checkpointing: the same run), or None where the run
    is planned again: a fresh run, another process count (the global batch is kept, the accumulation derived again), or
    a recipe that changed the micro-batch, the checkpointing or the memory budget (`checkpoint.REPLANNED_KEYS`)."""
    if resume_from is None:
        return None
    saved = BatchPlan.from_state(checkpoint.saved_state(resume_from)["plan"])
    before, now = flatten(checkpoint.saved_recipe(resume_from)), flatten(recipe.to_dict())

    def under(flat: dict[str, Any], key: str) -> dict[str, Any]:  # a key and its sub-keys ({every_n_layers: k})
        return {k: v for k, v in flat.items() if k == key or k.startswith(key + ".")}

    changed = [k for k in checkpoint.REPLANNED_KEYS if under(before, k) != under(now, k)]
    if saved.num_processes == accelerator.num_processes and not changed:
        return saved
    why = changed + [f"{saved.num_processes} -> {accelerator.num_processes} processes"] * (
        saved.num_processes != accelerator.num_processes
    )
    log.info(
        "resume: planned again (%s); the global batch %d is kept (the checkpoint's split: micro %d x accumulation %d"
        " x processes %d)",
        ", ".join(why),
        recipe.training.global_batch_size,
        saved.micro_batch_size,
        saved.grad_accum_steps,
        saved.num_processes,
    )
    return None


def enough_rows(rows: int, per_step: int) -> None:
    """Refuse, before the model loads, a training set that cannot fill one optimizer step's draw."""
    if rows < per_step:
        raise DataError(
            f"data.train: {rows} training rows (after packing and the length policy), fewer than one step draws"
            f" ({per_step}): lower training.global_batch_size or add data"
        )


def resume(run: Run, path: Path) -> None:
    trainable_only = run.recipe.peft.method != "none"
    state = checkpoint.load_checkpoint(
        run.accelerator, path, run.engine, run.model, run.optimizer, trainable_only=trainable_only
    )
    run.start_step = state["step"]
    run.counters.update(state["counters"])
    run.lineage = checkpoint.lineage_of(path, run.recipe.output_dir)
    log.info("resumed from %s at step %d", path, run.start_step)


# ---------------------------------------------------------------- the loop


def fit(run: Run) -> dict[str, Any]:
    """`loop`, then the output_dir's lock released: another run may use the folder once this one has ended."""
    try:
        return loop(run)
    finally:
        run.lock.release()
        parallel.close_host_group(run.host_group)


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
    # Log lines go through the progress bar's own writer: printed straight to the terminal, they land on the bar's line.
    # The next step's rows are drawn and collated in the background while this one trains (`prepare_ahead`).
    with (
        Preemption(release=run.lock.release) as preemption,
        logging_redirect_tqdm(),
        Prefetcher(lambda s: prepare_ahead(run, s), end=r.training.max_steps, device=acc.device) as upcoming,
    ):
        while step < r.training.max_steps:
            batches = batches_for(run, upcoming.get(step), step)
            lr = set_learning_rate(run.optimizer, r, step)
            t0 = time.perf_counter()  # the step; with its evaluation and checkpoint below, the grace a signal gives
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
                # died holding the lock would leave it to refuse the requeued run (on another host, for good).
                run.lock.release()
                return {"preempted_at_step": step}
            preemption.grace_s = max(preemption.grace_s, 3 * (time.perf_counter() - t0))
        # Under the handler: a signal now lets the final model be written whole (the run is done: exit 0), where the
        # default action cut the write and, without checkpoints, lost the whole run.
        preemption.then = "finishing the final save (the run is done), then exiting"
        with preemption.saving():
            final = save_final(run, step)
    summary = run_summary(run, metrics, measured.peaks, time.perf_counter() - started, step, eval_loss, final)
    metrics.close(summary)
    return summary


def prepare_ahead(run: Run, step: int) -> StepBatches | list[dict]:
    """What of optimizer step `step` needs no model, made in the background (`Prefetcher`): this process's share of
    the data step the objective draws, and where the objective trains on these rows as drawn (SFT, preference:
    `FromData`) their batches; GRPO's rows are completions of these prompts by the policy as it is at the step."""
    r = run.recipe
    data_step, drawn = run.objective.draw(step, r.training.global_batch_size)
    examples = batch_for_step(
        run.data.train,
        step=data_step,
        global_batch_size=drawn,
        seed=r.seed,
        rank=run.sequence.data_rank,  # a sequence group's processes train the same rows, each its part of them
        world_size=run.sequence.data_world,
        group_by_length=r.data.group_by_length,
    )
    return step_batches(run, examples) if isinstance(run.objective, FromData) else examples


def batches_for(run: Run, ahead: StepBatches | list[dict], step: int) -> StepBatches:
    """Step `step`'s batches from what was prepared ahead: as they are, or split again where the plan shrank since
    (out of memory), or made from the rows the step trains on (GRPO: sampled now)."""
    if isinstance(ahead, StepBatches):
        if ahead.micro_batch_size == run.plan.micro_batch_size:
            return ahead
        ahead = ahead.rows
    return step_batches(run, rollout(run, ahead, step))


def rollout(run: Run, examples: list[dict], step: int) -> list[dict]:
    """The rows step `step` trains on, made from the rows drawn for it (GRPO: the policy's completions)."""
    r = run.recipe
    try:
        return run.objective.rollout(examples, step)
    except torch.OutOfMemoryError:  # grpo's generation: fewer rows a call
        rows = run.plan.generation_rows or len(examples) * r.grpo.num_generations
        smaller = rows // 2 or None
        where = run.accelerator.process_index
        stop_out_of_memory(r.output_dir, where, run.lock, "generation", "generation_rows", rows, smaller)


def step_batches(run: Run, rows: list[dict]) -> StepBatches:
    """`rows` split into the plan's micro-batches, collated (pinned where the device copies from there without
    waiting), with their counts: all host work, no device involved. Split along the sequence, this process's part of
    each micro-batch (`sequence.shard_batch`), and the rows' counts on the group's first process alone: summed over
    processes, each row counts once."""
    m, device, group = run.plan.micro_batch_size, run.accelerator.device, run.sequence
    micro_batches = [collate_for(run, rows[i : i + m]) for i in range(0, len(rows), m)]
    counts = [
        sum(trained_tokens(b) for b in micro_batches),
        sum(len(e["input_ids"]) for e in rows),  # real tokens, padding excluded (for MFU)
        squared_lengths(rows),
        sum(run.objective.units(b) for b in micro_batches),
    ]
    counts = counts if group.rank == 0 else [0] * len(counts)
    parts = [pinned(sequence.shard_batch(b, group), device) for b in micro_batches]
    return StepBatches(rows, m, parts, counts)


def evaluation_due(run: Run, step: int) -> bool:
    """Whether the eval split is evaluated after optimizer step `step`: every eval_every_n_steps, and at the last."""
    t = run.recipe.training
    every = t.eval_every_n_steps and step % t.eval_every_n_steps == 0
    return run.data.eval is not None and bool(every or step == t.max_steps)


def evaluate_and_log(run: Run, metrics: MetricsLogger, step: int, rows: int) -> float:
    """`evaluate`, logged; out of memory, the run stops (`stop_after_out_of_memory`: `rows` rows a process)."""
    try:
        eval_loss = evaluate(run)
    except torch.OutOfMemoryError:
        stop_after_out_of_memory(run, "evaluation", rows)
    metrics.log_eval(step, eval_loss)
    return eval_loss


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


def save_or_stop(run: Run, step: int, preemption: Preemption, checkpoint_ok: bool) -> bool:
    """Checkpoint when it is due, or when a signal reached any process (then True: all stop together). A step whose
    loss was non-finite (`checkpoint_ok` False) is not checkpointed: the last good checkpoint stays newest."""
    every = run.recipe.checkpoint.every_n_steps
    stop = preemption.requested_anywhere(run.host_group)
    if stop:
        preemption.boundary()
    if stop or (every and step % every == 0 and checkpoint_ok):
        with preemption.saving():  # never cut by the signal watchdog, however long the save takes
            save(run, step)
        # A signal that came during the save: the checkpoint just written is the one to stop at, not one step later.
        if not stop and preemption.requested_anywhere(run.host_group):
            preemption.boundary()
            stop = True
    return stop


def collate_for(run: Run, examples: list[dict]) -> dict[str, torch.Tensor]:
    # A compiled model recompiles for every new shape: packed rows are then padded to max_length (a fill
    # of ~95% costs little), so every micro-batch has the shape the memory plan assumed. Split along the sequence,
    # rows are padded to a multiple of the group's processes.
    static = run.data.packed and run.recipe.training.compiles(run.accelerator.device.type)
    return run.objective.collate(
        examples,
        pad_token_id=run.tokenizer.pad_token_id,
        packed=run.data.packed,
        pad_to_multiple_of=sequence.rows_padded_to(run.sequence.degree, run.recipe.data.max_length if static else None),
    )


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
    total, processed, squares, units = parallel.sum_on_host(batches.counts, run.host_group)
    scale = acc.num_processes / max(units, 1)
    sums = torch.zeros((), device=acc.device)  # [loss, *the objective's stats], summed
    oom = False
    try:
        for i, batch in enumerate(batches.micro_batches):
            with parallel.micro_step(acc, run.engine, model, last=i == len(batches.micro_batches) - 1):
                out = model(**to_device(batch, acc.device)).reshape(-1)
                parallel.backward(acc, run.engine, out[0] * scale)
            sums = sums + out.detach().float()
    except torch.OutOfMemoryError:
        if not parallel.can_redo_step(acc, run.engine):
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
    norm = parallel.clip_grad_norm(acc, engine, run.model, run.recipe.training.max_grad_norm)
    if not parallel.skips_nonfinite_updates(acc, engine):
        loss, *stats, grad_norm = read_once(sums, norm)
        # A finite loss can still give inf/nan gradients: stepping would write them into the weights and the next
        # checkpoint.
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if finite:
            parallel.optimizer_step(optimizer, None)
        return loss, stats, grad_norm, False, finite, None
    fp16 = parallel.optimizer_step(optimizer, acc.scaler)
    if fp16 is None:  # DeepSpeed: the engine stepped, or skipped, inside the window's last backward
        loss, *stats, grad_norm = read_once(sums, norm)
        scale, overflow = None, parallel.step_was_skipped(optimizer)
    else:
        loss, *stats, grad_norm, scale, skipped = read_once(sums, norm, fp16)
        overflow = bool(skipped)
    finite = math.isfinite(loss) and not (overflow and scale is not None and scale <= 1)
    return loss, stats, grad_norm, overflow, finite, scale


def read_once(*tensors: torch.Tensor) -> list[float]:
    """The tensors' values on the host, in one copy from the device."""
    return torch.cat([t.detach().reshape(-1).float() for t in tensors]).tolist()


@torch.no_grad()
def evaluate(run: Run) -> float:
    """Eval loss per unit (trained token, or pair), all processes."""
    acc, model = run.accelerator, run.model
    model.eval()
    loss_sum = torch.zeros((), device=acc.device)
    units = torch.zeros((), device=acc.device)
    group = run.sequence
    batches = eval_batches(
        run.data.eval, batch_size=run.plan.micro_batch_size, rank=group.data_rank, world_size=group.data_world
    )
    for examples in batches:
        batch = collate_for(run, examples)
        units += run.objective.units(batch) if group.rank == 0 else 0  # each row once (`step_batches`)
        part = pinned(sequence.shard_batch(batch, group), acc.device)
        loss_sum += model(**to_device(part, acc.device)).reshape(-1)[0].float()
    model.train()
    return float(acc.reduce(loss_sum, reduction="sum") / acc.reduce(units, reduction="sum").clamp(min=1))


def save(run: Run, step: int) -> None:
    # lineage: the checkpoints this one descends from, the only ones its pruning may delete (llmtune.checkpoint).
    # engine: what a resume must be launched as to read the files (checkpoint.launch_refusal).
    state = {
        "step": step,
        "counters": run.counters,
        "plan": run.plan.state(),
        "lineage": run.lineage,
        "engine": run.engine,
    }
    checkpoint.save_checkpoint(
        run.accelerator,
        run.recipe.output_dir,
        step,
        state,
        dump_recipe(run.recipe),
        run.recipe.checkpoint.keep_last,
        engine=run.engine,
        model=run.model,
        optimizer=run.optimizer,
        trainable_only=run.recipe.peft.method != "none",
    )
    run.lineage = [*run.lineage, f"step-{step:06d}"]


def save_final(run: Run, step: int) -> Path:
    """`final/`; out of memory gathering the whole model there, the run stops in one line (exit 1: a requeue would
    meet the same gather), its last step checkpointed first where no peer waits in the gather (one process)."""
    r = run.recipe
    adapters = r.peft.method != "none"
    try:
        return checkpoint.save_final(
            run.accelerator,
            run.engine,
            run.model,
            run.tokenizer,
            r.output_dir,
            adapters_only=adapters,
            save_base=r.model.random_init and adapters,
            prompt_layout=run.data.prompt_layout,
        )
    except torch.OutOfMemoryError:
        kept = checkpoint.complete_checkpoints(r.output_dir)
        if run.accelerator.num_processes == 1 and not (kept and kept[-1].name == f"step-{step:06d}"):
            save(run, step)
            kept = checkpoint.complete_checkpoints(r.output_dir)
        what = f"the trained state is kept in {kept[-1]}" if kept else "no checkpoint holds the trained state"
        raise checkpoint.SaveError(
            f"out of memory gathering the whole model for {Path(r.output_dir) / 'final'}; {what}"
            " (the same command with checkpoint.resume=auto writes final/ from it, where memory allows)"
        ) from None


def train(recipe: Recipe) -> dict[str, Any]:
    return fit(build(recipe))
