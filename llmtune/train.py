"""The training loop: recipe in, checkpoints, metrics and a saved model out.

`build` does everything before the first step, in the order data flows (accelerator and precision ->
tokenizer and data -> model -> memory plan -> optimizer -> resume); `fit` is the loop itself, explicit
from top to bottom. Each optimizer step takes this process's share of the global batch, splits it into
micro-batches as the memory plan says, and normalises the loss by the trained tokens of the whole
window on all processes, so the update is the same whatever the micro-batch or process count.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import set_seed
from tqdm.contrib.logging import logging_redirect_tqdm

from llmtune import checkpoint, parallel, preference
from llmtune.data import PreparedData, batch_for_step, collate, eval_batches, prepare_data, squared_lengths
from llmtune.loss import CausalLMWithLoss, resolve_loss_impl
from llmtune.memory.measure import PeakMemoryTracker
from llmtune.memory.plan import (
    BatchPlan,
    estimate_settings,
    expandable_segments,
    plan_for_budget,
    plan_rates,
    resolve_budget,
)
from llmtune.metrics import MetricsLogger, ModelFlops, check_trackers, model_flops, peak_flops
from llmtune.model import (
    SetupError,
    check_requirements,
    choose_precision,
    count_parameters,
    load_config,
    load_model,
    load_tokenizer,
    weights_signature,
)
from llmtune.optim import make_optimizer
from llmtune.preemption import EXIT_PREEMPTED, Preemption
from llmtune.recipe import Recipe, checkpointing_of, dump_recipe

log = logging.getLogger(__name__)

OOM_FILE = "out_of_memory.json"  # the micro-batch to resume with after an out-of-memory stop


class PlanError(ValueError):
    """The batch settings cannot be met with this process count."""


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. repeated non-finite losses); the last good checkpoint is kept."""


@dataclass
class Run:
    """Everything `fit` needs, built once by `build`."""

    recipe: Recipe
    accelerator: Accelerator
    precision: str
    precision_why: str  # shown in the setup log: `auto` differs between machines
    tokenizer: Any
    data: PreparedData
    model: torch.nn.Module  # CausalLMWithLoss: DDP/DeepSpeed-prepared by Accelerate, or FSDP2-sharded
    engine: parallel.Engine
    optimizer: torch.optim.Optimizer
    plan: BatchPlan
    flops: ModelFlops
    peak_flops: float  # the MFU denominator
    peak_flops_source: str  # datasheet or measured (metrics.peak_flops)
    num_layers: int = 0
    start_step: int = 0
    speed: dict[str, Any] | None = None  # the time model's prediction against the run's first timed steps
    counters: dict[str, int] = field(default_factory=lambda: {"trained_tokens": 0, "skipped_steps": 0})


# ---------------------------------------------------------------- batch plan


def make_plan(
    recipe: Recipe,
    config: Any,
    precision: str,
    loss_impl: str,
    acc: Accelerator,
    engine: parallel.Engine,
    trained_fraction: float = 1.0,
) -> BatchPlan:
    """The micro-batch and the checkpointing: the recipe's where it fixes them, else the fastest the memory estimate
    and the time model find within the budget (`llmtune.memory.plan`)."""
    t, n = recipe.training, acc.num_processes
    per_process, rest = divmod(t.global_batch_size, n)
    if rest:
        raise PlanError(f"training.global_batch_size={t.global_batch_size} is not divisible by the {n} processes")
    fixed = checkpointing_of(t.gradient_checkpointing)
    if t.micro_batch_size != "auto":
        if per_process % t.micro_batch_size:
            raise PlanError(
                f"training.global_batch_size={t.global_batch_size} = {n} processes x {per_process} per"
                f" process, which training.micro_batch_size={t.micro_batch_size} does not divide"
            )
        if fixed is not None:
            return BatchPlan(t.micro_batch_size, per_process // t.micro_batch_size, n, "recipe", checkpointing=fixed)
    budget = resolve_budget(recipe.memory.budget, acc.device)
    # Free memory can differ between devices; every process must train the same micro-batch.
    budget = int(acc.gather(torch.tensor([budget], device=acc.device)).min())
    device = "cuda" if acc.device.type == "cuda" else "cpu"
    settings = estimate_settings(
        recipe,
        loss=loss_impl,
        device=device,
        sharding=parallel.SHARDING[engine],
        precision=precision,
        trained_fraction=trained_fraction,
    )

    def plan() -> BatchPlan:
        # Planning runs real ops on random tensors (the rates) and must leave the run's random state as it found
        # it: the model's initialisation and the data order come after it.
        with torch.random.fork_rng(devices=[acc.device] if acc.device.type == "cuda" else []):
            rates = plan_rates(device, precision, config)
            return plan_for_budget(recipe, config, settings, budget_bytes=budget, num_processes=n, rates=rates)

    # The rates are timed on one process's clock and rank the candidates: each process timing its own could choose
    # another plan (a loaded host's clock differs) and wait in collectives the others never join.
    return parallel.decided_by_main(acc, plan)


def shrink_plan(plan: BatchPlan, per_process: int, at_most: int | None = None) -> BatchPlan:
    """After an out-of-memory error: the largest micro-batch <= half (or `at_most`) that divides the batch."""
    if plan.micro_batch_size == 1:
        raise TrainingError("out of memory at micro-batch 1; nothing left to shrink (see `llmtune estimate`)")
    limit = plan.micro_batch_size // 2 if at_most is None else at_most
    micro = max(d for d in range(1, limit + 1) if per_process % d == 0)
    return replace(
        plan,
        micro_batch_size=micro,
        grad_accum_steps=per_process // micro,
        source="planner, shrunk after out-of-memory",
    )


# ---------------------------------------------------------------- setup


def make_accelerator(recipe: Recipe, engine: parallel.Engine) -> tuple[Accelerator, str, str]:
    """Accelerator with the recipe's precision (and why that one); the recipe wins over an Accelerate config."""
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    check_requirements(recipe, device_type)
    check_engine(recipe, engine)
    check_trackers(recipe.logging.report_to)
    if device_type == "cuda" and expandable_segments(recipe):
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")  # before the first allocation
    if device_type == "cpu":
        # Accelerate and transformers import DeepSpeed wherever it is installed (unwrapping a model to save it),
        # which then warns that it found no GPU ("Setting accelerator to CPU") unless told it is on a CPU.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        if parallel.is_deepspeed(engine):
            parallel.deepspeed_over_gloo()
    precision, why = choose_precision(recipe.training.precision, device_type)
    mixed = {"bf16": "bf16", "fp16": "fp16"}.get(precision, "no")
    launcher = os.environ.get("ACCELERATE_MIXED_PRECISION")
    # Accelerate keeps its precision in a process-wide singleton; forget it so one process can run several
    # recipes (`llmtune bench`, tests). The distributed state (PartialState) is kept.
    AcceleratorState._reset_state()
    accelerator = Accelerator(
        mixed_precision=mixed,
        log_with=recipe.logging.report_to or None,
        project_dir=recipe.output_dir,
        **parallel.accelerator_kwargs(engine, device_type),
    )
    if launcher and launcher != mixed:
        log.info("the launcher asked for mixed_precision=%s; the recipe's precision %s wins", launcher, precision)
    return accelerator, precision, why


def check_engine(recipe: Recipe, engine: parallel.Engine) -> None:
    """Refuse, before the accelerator and the model, what the launcher's engine cannot run."""
    if engine != "zero3":
        return
    if recipe.peft.method != "none" and recipe.training.gradient_checkpointing:
        # ZeRO-3 frees partitioned weights that non-reentrant recomputation then needs (a known
        # DeepSpeed/peft failure); refuse it here rather than at the first backward.
        raise SetupError(
            "LoRA + gradient checkpointing under DeepSpeed ZeRO-3 fails with non-reentrant checkpointing."
            " Use recipes/accelerate/fsdp2.yaml or deepspeed_zero2.yaml, or turn checkpointing off."
        )
    if preference.resolve_reference(recipe.training.objective, recipe.preference, recipe.peft.method) == "copy":
        # The copy would be a second whole model on every process, outside the engine: the deepcopy of a model loaded
        # partition by partition (zero3_init_flag) holds empty tensors, and nothing gathers them for its forward.
        raise SetupError(
            "preference.reference=copy cannot run under DeepSpeed ZeRO-3 (the copy would hold empty partitions); use"
            " preference.reference=precomputed (the same reference, computed through the sharded model) or"
            " recipes/accelerate/deepspeed_zero2.yaml"
        )


def build(recipe: Recipe) -> Run:
    # The first line of a run: where to look (the folder is created when training starts, not before).
    log.info(
        "llmtune run -> %s (recipe.yaml, metrics.jsonl, run_summary.json, checkpoints/, final/)",
        Path(recipe.output_dir).resolve(),
    )
    engine = parallel.launched_engine()
    accelerator, precision, precision_why = make_accelerator(recipe, engine)
    if engine == "fsdp2" and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        engine = "ddp"  # one process without a process group (on CPUs): nothing to shard across
    resume_from = checkpoint_to_resume(recipe)
    set_seed(recipe.seed)
    tokenizer = load_tokenizer(recipe.model)
    data = prepare_data(recipe.data, tokenizer, seed=recipe.seed, main_process_first=accelerator.main_process_first)
    config = load_config(recipe.model)
    loss_impl = resolve_loss_impl(recipe.training.loss, config)
    if resume_from is not None:  # the plan the run started with: same micro-batch, same checkpointing
        plan = BatchPlan.from_state(checkpoint.saved_state(resume_from)["plan"])
    else:
        plan = make_plan(recipe, config, precision, loss_impl, accelerator, engine, data.stats.max_trained_fraction)
    model = load_model(recipe, precision, config, accelerator.device, checkpointing=plan.checkpointing)
    trainable, total = count_parameters(model)
    flops = model_flops(model)
    wrapped = training_module(recipe, model, loss_impl, accelerator.device, parallel.weights_dtype(engine, precision))
    precomputed = getattr(wrapped, "reference", None) == "precomputed"
    if engine == "fsdp2":
        parallel.shard_fsdp2(wrapped, precision)  # before the optimizer, which must hold the shards
    optimizer = make_optimizer(wrapped, recipe, accelerator.device)
    if parallel.is_deepspeed(engine):
        parallel.configure_deepspeed(
            accelerator,
            plan.micro_batch_size,
            plan.grad_accum_steps,
            recipe.training.max_grad_norm,
            config.get_text_config().hidden_size,
        )
    if engine != "fsdp2":
        # FSDP2 is applied above; Accelerate would wrap the sharded model in DDP on top. Its model and
        # optimizer are checkpointed with torch.distributed.checkpoint (checkpoint.save_checkpoint).
        wrapped, optimizer = accelerator.prepare(wrapped, optimizer)
    if precomputed:  # through the prepared model, before any update or resume (preference.compute_reference)
        data = with_reference(recipe, loss_impl, wrapped, data, plan, accelerator, tokenizer, precision)
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
        model=wrapped,
        engine=engine,
        optimizer=optimizer,
        plan=plan,
        flops=flops,
        peak_flops=peak,
        peak_flops_source=peak_source,
        num_layers=int(config.get_text_config().num_hidden_layers),
    )
    if resume_from is not None:
        resume(run, resume_from)
    # One process's disk decides (another node's may not show the file yet): all must train the same micro-batch.
    limit = parallel.decided_by_main(accelerator, lambda: out_of_memory_limit(recipe.output_dir))
    if limit is not None and limit < run.plan.micro_batch_size:
        run.plan = shrink_plan(run.plan, run.plan.micro_batch_size * run.plan.grad_accum_steps, at_most=limit)
        log.info("an earlier run stopped out of memory: micro-batch %d", run.plan.micro_batch_size)
    log_setup(run, trainable, total)
    return run


def training_module(
    recipe: Recipe,
    model: torch.nn.Module,
    loss_impl: str,
    device: torch.device,
    weights_dtype: torch.dtype | None,
) -> torch.nn.Module:
    """The module whose forward returns the summed loss: SFT's, or the preference objective's (llmtune.preference).
    A frozen copy (preference.reference=copy) goes to `device` with its parameters in `weights_dtype`
    (parallel.weights_dtype): outside the prepared module, nothing else would put it where the policy computes."""
    objective = recipe.training.objective
    if objective == "sft":
        return CausalLMWithLoss(model, loss_impl)
    reference = preference.resolve_reference(objective, recipe.preference, recipe.peft.method)
    frozen = None
    if reference == "copy":  # the starting weights, frozen, before any update
        frozen = copy.deepcopy(model).requires_grad_(False).eval().to(device)
        if weights_dtype is not None:
            for p in frozen.parameters():  # parameters only, as FSDP2 and DeepSpeed cast the policy's
                p.data = p.data.to(weights_dtype)
    return preference.PreferenceModel(model, loss_impl, objective, recipe.preference, reference, frozen)


def with_reference(
    recipe: Recipe,
    loss_impl: str,
    wrapped: Any,
    data: PreparedData,
    plan: BatchPlan,
    acc: Accelerator,
    tokenizer: Any,
    precision: str,
) -> PreparedData:
    """Train (and eval) rows with their reference log-probs, computed once by all processes through the prepared
    module `wrapped` and cached in output_dir (reused on resume and by any later run with the same model, data and
    settings)."""
    m = recipe.model
    settings = {
        "model": [m.name_or_path, m.revision, m.attn_implementation, m.random_init and recipe.seed],
        "weights": [] if m.random_init else weights_signature(m.name_or_path),
        "precision": precision,
        "loss": loss_impl,
        "peft": recipe.peft.method,
    }
    cache = Path(recipe.output_dir) / "reference"

    def collate_rows(examples: list[dict]) -> dict[str, torch.Tensor]:
        return preference.collate_pairs(examples, pad_token_id=tokenizer.pad_token_id, packed=data.packed)

    def attach(rows):
        return preference.with_reference(wrapped, rows, collate_rows, plan.micro_batch_size, acc, cache, settings)

    return replace(data, train=attach(data.train), eval=None if data.eval is None else attach(data.eval))


def lr_factor(step: int, recipe: Recipe) -> float:
    """Warmup then decay, as a fraction of the peak learning rate (pure; step is 0-based)."""
    t = recipe.training
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    if t.lr_schedule == "constant":
        return 1.0
    progress = (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if t.lr_schedule == "cosine" else 1 - progress
    return t.min_lr_ratio + (1 - t.min_lr_ratio) * shape


def set_learning_rate(optimizer: torch.optim.Optimizer, recipe: Recipe, step: int) -> float:
    """Set the learning rate of 0-based `step` on every group (of the prepared optimizer: ZeRO-3 regroups what it
    partitions). A pure function of the step, as nanoGPT's: a resumed run needs no scheduler state, and an update
    skipped for a non-finite loss moves the schedule on like any step (a LambdaLR stepped then made PyTorch warn
    "lr_scheduler.step() before optimizer.step()")."""
    lr = recipe.training.learning_rate * lr_factor(step, recipe)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def checkpoint_to_resume(r: Recipe) -> Path | None:
    """The checkpoint this run continues, or None; refuses a resume that would be a different run.

    Called before anything heavy loads, so a refusal costs nothing.
    """
    path = checkpoint.resolve_resume(r.output_dir, r.checkpoint.resume)
    if path is None:
        if r.checkpoint.resume == "none" and checkpoint.complete_checkpoints(r.output_dir):
            # Starting over here would prune the earlier run's checkpoints as if they were ours.
            raise checkpoint.ResumeError(
                f"{r.output_dir} already holds checkpoints of an earlier run and checkpoint.resume=none: set"
                " checkpoint.resume=auto to continue it, or use another output_dir (or delete this one)"
            )
        return None
    breaking, harmless = checkpoint.continuity_problems(checkpoint.saved_recipe(path), r.to_dict())
    if breaking:
        raise checkpoint.ResumeError(
            f"cannot resume from {path}: the recipe changed in ways that make it a different run:\n  "
            + "\n  ".join(breaking)
            + "\nStart a new output_dir, or set checkpoint.resume=none to start over here."
        )
    for change in harmless:
        log.info("resume: recipe changed %s", change)
    return path


def resume(run: Run, path: Path) -> None:
    state = checkpoint.load_checkpoint(
        run.accelerator, path, run.engine, run.model, run.optimizer, trainable_only=run.recipe.peft.method != "none"
    )
    run.start_step = state["step"]
    run.counters.update(state["counters"])
    log.info("resumed from %s at step %d", path, run.start_step)


def log_setup(run: Run, trainable: int, total: int) -> None:
    r, p = run.recipe, run.plan
    lines = [
        f"model          {r.model.name_or_path} ({total / 1e6:.1f}M params, {trainable / 1e6:.2f}M trainable)",
        f"launch         {run.engine} ({run.accelerator.distributed_type.value}) x {run.accelerator.num_processes}"
        f" on {run.accelerator.device}",
        f"precision      {run.precision} ({run.precision_why})",
        f"checkpointing  {p.checkpointing.describe(run.num_layers)} ({'planned' if p.frontier else 'the recipe'})",
        f"batch          global {r.training.global_batch_size} = micro {p.micro_batch_size} x accumulation "
        f"{p.grad_accum_steps} x processes {p.num_processes} (micro-batch from {p.source})",
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


# ---------------------------------------------------------------- the loop


def fit(run: Run) -> dict[str, Any]:
    r, acc, model = run.recipe, run.accelerator, run.model
    out = Path(r.output_dir)
    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "recipe.yaml").write_text(dump_recipe(r))
    metrics = MetricsLogger(acc, out, r, total_steps=r.training.max_steps, start_step=run.start_step)
    nonfinite = 0
    eval_loss = None
    steady_peak = steady_reserved = 0  # the first optimizer step is lower: AdamW states appear during it
    step = run.start_step
    timed: list[float] = []  # seconds of steps 3 and 4 (the first two are warm-up and memory measurement)
    started = time.perf_counter()
    # from_pretrained returns the model in eval mode, and transformers checkpoints activations (and applies
    # dropout) only in training mode: without this the steps before the first evaluation ran with neither.
    model.train()
    # Log lines go through the progress bar's own writer: printed straight to the terminal, they land on the bar's line.
    with Preemption() as preemption, logging_redirect_tqdm():
        while step < r.training.max_steps:
            examples = batch_for_step(
                run.data.train,
                step=step,
                global_batch_size=r.training.global_batch_size,
                seed=r.seed,
                rank=acc.process_index,
                world_size=acc.num_processes,
                group_by_length=r.data.group_by_length,
            )
            lr = set_learning_rate(run.optimizer, r, step)
            t0 = time.perf_counter()  # the step; with its evaluation and checkpoint below, the grace a signal gives
            # On CUDA the allocator counts for free; on a CPU counting live tensors slows a step down
            # (~1.5x on tiny models), so only the first steps and the logged ones are measured there.
            # Steps 3 and 4 are never counted: they time the step for the time model (`check_speed`).
            measured = acc.device.type == "cuda" or step < 2 or (step > 3 and (step + 1) % r.logging.every_n_steps == 0)
            tracker = PeakMemoryTracker(acc.device, baseline=[model, run.optimizer])
            with tracker if measured else contextlib.nullcontext():
                result = train_step(run, examples)
            if result is None:  # out of memory: the plan shrank; redo the same step
                continue
            loss = result.loss
            if not result.finite:
                nonfinite += 1
                run.counters["skipped_steps"] += 1
                what = f"loss ({loss})" if not math.isfinite(loss) else f"gradient norm ({result.grad_norm})"
                log.warning("step %d: non-finite %s, update skipped (%d in a row)", step + 1, what, nonfinite)
                if nonfinite >= r.training.max_nonfinite_steps:
                    raise TrainingError(
                        f"step {step + 1}: {nonfinite} consecutive non-finite losses or gradients; stopping. The"
                        f" last good checkpoint is kept in {checkpoint.checkpoints_root(out)}. Try a lower learning"
                        " rate, bf16 instead of fp16, or a smaller training.max_grad_norm."
                    )
            else:
                nonfinite = 0
            if result.overflow:  # fp16: the loss scaler skipped the update
                run.counters["skipped_steps"] += 1
            step += 1
            run.counters["trained_tokens"] += result.trained_tokens
            peak = tracker.peak_bytes if measured else None
            reserved = tracker.peak_reserved_bytes if measured else None  # what the budget is held against
            if step > 1 and peak:
                steady_peak = max(steady_peak, peak)
                steady_reserved = max(steady_reserved, reserved)
                over_budget = run.plan.budget_bytes is not None and reserved > run.plan.budget_bytes
                if step == 2 and bool(acc.reduce(torch.tensor(int(over_budget), device=acc.device), "sum")):
                    # The estimate missed; don't wait for an out-of-memory error to find out.
                    run.plan = shrink_plan(run.plan, len(examples))
                    log.warning("measured peak above the budget: micro-batch now %d", run.plan.micro_batch_size)
            seconds = time.perf_counter() - t0
            if step in (3, 4):
                timed.append(seconds)
                if step == 4 or step == r.training.max_steps:
                    run.speed = check_speed(run, sum(timed) / len(timed))
            metrics.log_step(
                step,
                loss=loss,
                lr=lr,
                grad_norm=result.grad_norm,
                trained_tokens=result.trained_tokens,
                seconds=seconds,
                tokens_per_s=result.trained_tokens / seconds,
                mfu=result.flops / seconds / run.peak_flops / acc.num_processes,
                peak_memory_bytes=peak,
                peak_reserved_bytes=reserved,
                skipped_steps=run.counters["skipped_steps"],
                micro_batch_size=run.plan.micro_batch_size,
                memory_tracked=measured,
                **result.extra,
            )
            eval_now = r.training.eval_every_n_steps and step % r.training.eval_every_n_steps == 0
            if run.data.eval is not None and (eval_now or step == r.training.max_steps):
                try:
                    eval_loss = evaluate(run)
                except torch.OutOfMemoryError:
                    stop_after_out_of_memory(run, "evaluation", len(examples))
                metrics.log_eval(step, eval_loss)
            stop = preemption_requested(acc, preemption)
            if stop:
                preemption.boundary()
            # A step whose loss was non-finite is not checkpointed: the last good checkpoint stays newest.
            periodic = r.checkpoint.every_n_steps and step % r.checkpoint.every_n_steps == 0 and not nonfinite
            if stop or periodic:
                save(run, step)
            if stop:
                metrics.close()
                return {"preempted_at_step": step}
            preemption.grace_s = max(preemption.grace_s, 3 * (time.perf_counter() - t0))
    save_base = r.model.random_init and r.peft.method != "none"
    adapters = r.peft.method != "none"
    final = checkpoint.save_final(
        acc,
        run.engine,
        model,
        run.tokenizer,
        out,
        adapters_only=adapters,
        save_base=save_base,
        prompt_layout=run.data.prompt_layout,
    )
    peaks = {"peak_memory_bytes": steady_peak, "peak_reserved_bytes": steady_reserved}
    summary = run_summary(run, metrics, peaks, time.perf_counter() - started, step, eval_loss, final)
    metrics.close(summary)
    return summary


def check_speed(run: Run, seconds: float) -> dict[str, Any] | None:
    """The time model's predicted tokens/s against the run's own (steps 3 and 4), logged when 15% or more below."""
    predicted = run.plan.predicted_tokens_per_s
    if predicted is None:
        return None
    tokens = run.recipe.training.global_batch_size // run.plan.num_processes * run.recipe.data.max_length
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
            "the time model predicted %.0f tokens/s per process for this plan and the run makes %.0f (%.0f%% below):"
            " the plan may not be the fastest here; `llmtune estimate --recipe` shows what it weighed",
            predicted,
            measured,
            100 * (1 - measured / predicted),
        )
    else:
        log.info("speed: %.0f tokens/s per process, the time model predicted %.0f", measured, predicted)
    return speed


def collate_for(run: Run, examples: list[dict]) -> dict[str, torch.Tensor]:
    # A compiled model recompiles for every new shape: packed rows are then padded to max_length (a fill
    # of ~95% costs little), so every micro-batch has the shape the memory plan assumed.
    static = run.data.packed and run.recipe.training.compile
    collate_rows = collate if run.recipe.training.objective == "sft" else preference.collate_pairs
    return collate_rows(
        examples,
        pad_token_id=run.tokenizer.pad_token_id,
        packed=run.data.packed,
        pad_to_multiple_of=run.recipe.data.max_length if static else None,
    )


class StepResult(NamedTuple):
    loss: float  # per trained token, all processes
    trained_tokens: int  # all processes
    flops: float  # model FLOPs, all processes (metrics.ModelFlops)
    grad_norm: float
    overflow: bool  # fp16: the loss scaler found inf/nan gradients and skipped the update
    finite: bool  # loss and gradients finite; else the update was skipped (fp16's overflow aside)
    extra: dict[str, float]  # the objective's own metrics (preference: rewards, margin, accuracy)


def optimizer_step(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> bool:
    """Step; True when the update was skipped for inf/nan gradients (fp16 loss scaling).

    Accelerate's `optimizer_step_was_skipped` misses this for fused optimizers: GradScaler hands them the
    inf flag and the fused kernel skips internally, so the step still counts as taken. The scaler lowers
    its scale exactly when it found inf/nan (it only ever grows otherwise), so the scale tells. Under
    DeepSpeed the engine scales the loss itself (no scaler here) and Accelerate's flag reports its skips.
    """
    before = scaler.get_scale() if scaler is not None and scaler.is_enabled() else None
    optimizer.step()
    dropped = before is not None and scaler.get_scale() < before
    return dropped or bool(getattr(optimizer, "step_was_skipped", False))


def train_step(run: Run, examples: list[dict]) -> StepResult | None:
    """One optimizer step over this process's examples, or None when it ran out of memory in a forward or
    backward and the plan was shrunk (one process without DeepSpeed; otherwise `stop_after_out_of_memory`)."""
    acc, model, m = run.accelerator, run.model, run.plan.micro_batch_size
    micro_batches = [collate_for(run, examples[i : i + m]) for i in range(0, len(examples), m)]
    # Loss is summed per token and divided by the trained tokens of the whole window on all processes,
    # so long and short examples weigh the same whatever the micro-batching. DDP averages gradients
    # over processes, hence the factor num_processes.
    trained = sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro_batches)
    pairs = sum(preference.pairs_in(b) for b in micro_batches) if "segment_ids" in micro_batches[0] else 0
    processed = sum(len(e["input_ids"]) for e in examples)  # real tokens, padding excluded (for MFU)
    # As Python ints: no bookkeeping tensor stays alive through the window's forwards and backwards.
    counts = [trained, processed, squared_lengths(examples), pairs]
    total, processed, squares, pairs = acc.reduce(torch.tensor(counts, device=acc.device), reduction="sum").tolist()
    # SFT normalises by trained tokens, preference objectives by pairs (each pair's loss is one number).
    units = pairs or total
    scale = acc.num_processes / max(units, 1)
    sums = torch.zeros((), device=acc.device)  # [loss] (SFT) or [loss, *preference.STATS], summed
    oom = False
    try:
        for i, batch in enumerate(micro_batches):
            batch = {k: v.to(acc.device) for k, v in batch.items()}
            last = i == len(micro_batches) - 1
            with parallel.micro_step(acc, run.engine, model, last):
                out = model(**batch).reshape(-1)
                parallel.backward(acc, run.engine, out[0] * scale)
            sums = sums + out.detach().float()
    except torch.OutOfMemoryError:
        # DeepSpeed keeps the window's gradients in its own partitioned buffers, which its Accelerate wrapper's
        # `zero_grad` (a no-op) does not clear, and steps inside the last backward: a redone step would add the
        # failed window's partial gradients to its own (measured: another update than the step asked for).
        if acc.num_processes > 1 or parallel.is_deepspeed(run.engine):
            stop_after_out_of_memory(run, "forward/backward", len(examples))
        oom = True
    if oom:  # nothing was updated yet: the same step is redone with smaller micro-batches
        run.optimizer.zero_grad(set_to_none=True)
        run.plan = shrink_plan(run.plan, len(examples))
        log.warning(
            "out of memory: micro-batch now %d, accumulation %d", run.plan.micro_batch_size, run.plan.grad_accum_steps
        )
        return None
    loss, *stats = acc.reduce(sums, reduction="sum").reshape(-1).tolist()
    loss /= max(units, 1)
    extra = preference.step_metrics(stats, pairs) if pairs else {}
    grad_norm, overflow, finite = float("nan"), False, math.isfinite(loss)
    if finite:
        try:
            grad_norm = parallel.clip_grad_norm(acc, run.engine, model, run.recipe.training.max_grad_norm)
            # A finite loss can still give inf/nan gradients: stepping would write them into the weights and the
            # next checkpoint. fp16's loss scaler skips such an update itself; DeepSpeed stepped in its backward.
            finite = math.isfinite(grad_norm) or acc.scaler is not None or parallel.is_deepspeed(run.engine)
            if finite:
                overflow = optimizer_step(run.optimizer, acc.scaler)
        except torch.OutOfMemoryError:  # the weights may be half-updated: only the last checkpoint is sound
            stop_after_out_of_memory(run, "clipping/optimizer step", len(examples))
    run.optimizer.zero_grad(set_to_none=True)
    flops = run.flops.step(processed, total, squares)
    return StepResult(loss, total, flops, grad_norm, overflow, finite, extra)


def stop_after_out_of_memory(run: Run, where: str, per_process: int) -> NoReturn:
    """Out of memory where the run cannot simply redo the step: stop every process, never hang.

    With several processes the others may already wait in a collective (a gradient all-reduce, an FSDP2 or
    ZeRO-3 all-gather) that this process will never join, so no agreement is possible any more; under DeepSpeed,
    even alone, the failed window's gradients stay in the engine (train_step). This process records the smaller
    micro-batch in `out_of_memory.json` (read by `build` when the same command resumes) and exits at once with 75;
    the launcher then stops the others (torchrun: SIGTERM, SIGKILL after 30 s; a process waiting on a gloo peer
    that exited fails at once). `checkpoint.resume: auto` continues from the last checkpoint with the smaller
    micro-batch.
    """
    if run.plan.micro_batch_size == 1:
        log.error(
            "process %d: out of memory in the %s at micro-batch 1; nothing left to shrink (see `llmtune estimate`)",
            run.accelerator.process_index,
            where,
        )
        logging.shutdown()
        os._exit(1)
    plan = shrink_plan(run.plan, per_process)
    path = Path(run.recipe.output_dir) / OOM_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    # Every process that ran out of memory writes it (the same plan shrinks the same way): each under its own name,
    # then renamed, so a reader never sees half a file.
    tmp = path.with_name(f".{OOM_FILE}.{run.accelerator.process_index}")
    tmp.write_text(json.dumps({"micro_batch_size": plan.micro_batch_size, "where": where}) + "\n")
    os.replace(tmp, path)
    log.error(
        "process %d: out of memory in the %s at micro-batch %d; stopping all processes (exit %d). Run the same"
        " command with checkpoint.resume=auto: it continues from the last checkpoint with micro-batch %d.",
        run.accelerator.process_index,
        where,
        run.plan.micro_batch_size,
        EXIT_PREEMPTED,
        plan.micro_batch_size,
    )
    logging.shutdown()
    os._exit(EXIT_PREEMPTED)  # not an exception: unwinding could wait on the peers' collectives


def out_of_memory_limit(output_dir: str) -> int | None:
    """The micro-batch an earlier out-of-memory stop asked for (stop_after_out_of_memory), if any."""
    path = Path(output_dir) / OOM_FILE
    return json.loads(path.read_text())["micro_batch_size"] if path.is_file() else None


@torch.no_grad()
def evaluate(run: Run) -> float:
    """Eval loss per trained token (SFT) or per pair (preference objectives), all processes."""
    acc, model = run.accelerator, run.model
    model.eval()
    loss_sum = torch.zeros((), device=acc.device)
    units = torch.zeros((), device=acc.device)
    batches = eval_batches(
        run.data.eval, batch_size=run.plan.micro_batch_size, rank=acc.process_index, world_size=acc.num_processes
    )
    for examples in batches:
        batch = collate_for(run, examples)
        pairs = "segment_ids" in batch
        units += preference.pairs_in(batch) if pairs else (batch["labels"][:, 1:] != -100).sum()
        loss_sum += model(**{k: v.to(acc.device) for k, v in batch.items()}).reshape(-1)[0].float()
    model.train()
    return float(acc.reduce(loss_sum, reduction="sum") / acc.reduce(units, reduction="sum").clamp(min=1))


def preemption_requested(acc: Accelerator, preemption: Preemption) -> bool:
    """True on every process when a signal reached any process (all must save together)."""
    flag = torch.tensor(int(preemption.requested), device=acc.device)
    return bool(acc.reduce(flag, reduction="sum"))


def save(run: Run, step: int) -> None:
    state = {"step": step, "counters": run.counters, "plan": run.plan.state()}
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


def run_summary(
    run: Run,
    metrics: MetricsLogger,
    peaks: dict[str, int],
    seconds: float,
    step: int,
    eval_loss: float | None,
    final: Path,
) -> dict[str, Any]:
    trained = run.counters["trained_tokens"]
    return {
        "precision": run.precision,
        "gradient_checkpointing": run.plan.checkpointing.enabled,
        "checkpointing": asdict(run.plan.checkpointing),
        "time_model": run.speed,
        "micro_batch_size": run.plan.micro_batch_size,
        "grad_accum_steps": run.plan.grad_accum_steps,
        "num_processes": run.plan.num_processes,
        "engine": run.engine,
        "optimizer_updates": parallel.optimizer_updates(run.optimizer),
        # This (the main) process's parameter bytes: its shards under FSDP2 and ZeRO-3.
        "local_parameter_bytes": parallel.local_parameter_bytes(run.model),
        "global_batch_size": run.recipe.training.global_batch_size,
        "steps": step,
        "trained_tokens": trained,
        "seconds": seconds,
        "tokens_per_s": metrics.tokens_per_s(),
        **peaks,  # steady-state (after step 1) peaks of live tensors and, on CUDA, of the allocator's reserve
        "memory_plan": run.plan.to_dict(),
        "skipped_steps": run.counters["skipped_steps"],
        "eval_loss": eval_loss,
        "final_dir": str(final),
    }


def train(recipe: Recipe) -> dict[str, Any]:
    return fit(build(recipe))
