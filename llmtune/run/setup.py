"""Everything before the first step, as a pipeline in the order data flows:

launch (engine, precision, the Accelerator) -> the resume point and the output_dir's lock -> tokenizer and data ->
the plan -> the sequence group -> the model -> `parallelize` -> the objective's pre-training pass -> resume.

Each stage is a call to one package's face. A decision every process must share (the resume point, the plan) is made
once, on the main process, inside the stage that makes it, and broadcast there
(llmtune.parallel.engines.decided_by_main).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import PretrainedConfig

from llmtune.data import DataError, PreparedData, prepare_data
from llmtune.model.load import load_config, load_model, load_tokenizer
from llmtune.objectives import AttachContext, Objective, objective_for
from llmtune.ops.loss import resolve_loss_impl
from llmtune.parallel import sequence
from llmtune.plan import BatchPlan
from llmtune.plan.planning import plan_run, shrink_plan
from llmtune.recipe import Recipe, flatten
from llmtune.run import checkpoint, rundir
from llmtune.run.launch import Launched, launch
from llmtune.run.metrics import peak_flops
from llmtune.run.parallelize import Parallelized, parallelize
from llmtune.run.resilience import plan_after_out_of_memory, stop_out_of_memory
from llmtune.run.state import Run
from llmtune.run.summary import log_setup

log = logging.getLogger(__name__)


def build(recipe: Recipe) -> Run:
    # The first line of a run: where to look (the folder is created when the run claims it, below).
    log.info(
        "llmtune run -> %s (recipe.yaml, metrics.jsonl, run_summary.json, checkpoints/, final/)",
        Path(recipe.output_dir).resolve(),
    )
    objective = objective_for(recipe)
    launched = launch(recipe, objective)
    # Before anything heavy loads: a refusal costs nothing.
    resume_from = checkpoint.agreed_resume_point(launched.accelerator, recipe, launched.engine)
    resuming = resume_from is not None
    lock = rundir.claim(launched.accelerator, recipe.output_dir, resuming=resuming, overwrite=recipe.overwrite)
    try:
        return assemble(recipe, objective, launched, resume_from, lock)
    except BaseException:
        lock.release()
        raise


def assemble(
    recipe: Recipe, objective: Objective, launched: Launched, resume_from: Path | None, lock: rundir.RunLock
) -> Run:
    """Tokenizer and data -> plan -> sequence group -> model -> `parallelize` -> the objective's pre-training pass ->
    resume. `lock`: the output_dir's, the Run's to release when `fit` ends, however it ends."""
    acc, precision = launched.accelerator, launched.precision
    set_seed(recipe.seed)
    tokenizer = load_tokenizer(recipe.model)
    data = prepare_data(recipe.data, tokenizer, seed=recipe.seed, main_process_first=acc.main_process_first)
    enough_rows(len(data.train), objective.draw(0, recipe.training.global_batch_size)[1])
    config = load_config(recipe.model)
    plan = plan_of(recipe, config, launched, data.stats.max_trained_fraction, resume_from)
    # Before the model loads (its attention is the group's) and the data is drawn (a group trains the same rows).
    group = sequence.mesh_group(acc.device.type, acc.process_index, acc.num_processes, plan.sequence_parallel)
    sequence.use(group)
    model = load_model(recipe, precision, config, acc.device, sequence_parallel=plan.sequence_parallel)
    loss_impl = resolve_loss_impl(recipe.training.loss, config)
    parts = parallelize(
        model,
        recipe,
        objective,
        plan,
        loss_impl=loss_impl,
        engine=launched.engine,
        precision=precision,
        accelerator=acc,
    )
    # Through the prepared module, before any update or resume (DPO's precomputed reference).
    context = AttachContext(
        recipe, acc, precision, loss_impl, tokenizer.pad_token_id, plan, tokenizer, launched.engine, parts.optimizer
    )
    data = attach(objective, parts.module, data, context, lock)
    if recipe.peft.method != "none":
        checkpoint.save_trainable_only(acc)
    run = run_of(recipe, launched, tokenizer, data, objective, parts, plan, config, lock, group)
    if resume_from is not None:
        resume(run, resume_from)
    log_setup(run, *parts.parameters)
    return run


def plan_of(
    recipe: Recipe, config: PretrainedConfig, launched: Launched, max_trained_fraction: float, resume_from: Path | None
) -> BatchPlan:
    """The resumed run's plan where it still holds, else a new one; smaller where an earlier attempt of this run ran
    out of memory (`plan_after_out_of_memory`)."""
    acc = launched.accelerator
    plan = resumed_plan(recipe, acc, resume_from)
    if plan is None:
        plan = plan_run(recipe, config, launched.precision, acc, launched.engine, max_trained_fraction)
    # Before the objective's pre-training pass: DPO's reference runs at the plan's micro-batch.
    return plan_after_out_of_memory(recipe.output_dir, acc, plan)


def attach(
    objective: Objective, module: torch.nn.Module, data: PreparedData, context: AttachContext, lock: rundir.RunLock
) -> PreparedData:
    """The objective's pass over the data before training (DPO's precomputed reference); out of memory, the run stops
    naming the smaller micro-batch that would fit (`stop_out_of_memory`)."""
    plan, acc = context.plan, context.accelerator
    try:
        return objective.attach(module, data, context)
    except torch.OutOfMemoryError:  # DPO's reference log-probs, computed at the plan's micro-batch
        m = plan.micro_batch_size
        smaller = None if m == 1 else shrink_plan(plan, m).micro_batch_size
        out = context.recipe.output_dir
        stop_out_of_memory(out, acc.process_index, lock, "reference log-probs", "micro_batch_size", m, smaller)


def run_of(
    recipe: Recipe,
    launched: Launched,
    tokenizer: Any,
    data: PreparedData,
    objective: Objective,
    parts: Parallelized,
    plan: BatchPlan,
    config: PretrainedConfig,
    lock: rundir.RunLock,
    group: sequence.SequenceGroup,
) -> Run:
    acc = launched.accelerator
    peak, peak_source = peak_flops(acc.device, launched.precision)
    return Run(
        recipe=recipe,
        accelerator=acc,
        precision=launched.precision,
        precision_why=launched.precision_why,
        tokenizer=tokenizer,
        data=data,
        objective=objective,
        model=parts.module,
        engine=launched.engine,
        optimizer=parts.optimizer,
        plan=plan,
        flops=parts.flops,
        peak_flops=peak,
        peak_flops_source=peak_source,
        num_layers=int(config.get_text_config().num_hidden_layers),
        lock=lock,
        host_group=launched.host_group,
        sequence=group,
    )


def resumed_plan(recipe: Recipe, accelerator: Accelerator, resume_from: Path | None) -> BatchPlan | None:
    """The plan a resumed run started with (same micro-batch, same checkpointing: the same run), or None where the run
    is planned again: a fresh run, another process count (the global batch is kept, the accumulation derived again), or
    a recipe that changed the micro-batch, the checkpointing, the memory budget or the parallel split
    (`checkpoint.REPLANNED_KEYS`)."""
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
