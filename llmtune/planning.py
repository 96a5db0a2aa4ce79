"""One planning chain for training, `llmtune estimate` and `llmtune bench`: config -> estimator settings -> the
time model's rates -> the fastest micro-batch and checkpointing within the budget (`plan_recipe`).

`plan_run` is the training loop's use of it: the batch split the recipe fixes, or the plan the main process
finds for this launch; `shrink_plan` is what an out-of-memory error or a measured peak over the budget does to it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from llmtune.errors import RunFailed, UserError
from llmtune.loss import resolve_loss_impl
from llmtune.memory import BatchPlan, estimate_settings, plan_for_budget, plan_rates, resolve_budget
from llmtune.recipe import Recipe, checkpointing_of

if TYPE_CHECKING:
    from accelerate import Accelerator


class PlanError(UserError, ValueError):
    """The batch settings cannot be met with this process count."""


class TrainingError(RunFailed, RuntimeError):
    """The run cannot go on (e.g. repeated non-finite losses); the last good checkpoint is kept."""


def plan_recipe(
    recipe: Recipe,
    config: Any,
    *,
    device: str,
    budget_bytes: int,
    num_processes: int,
    precision: str | None = None,
    sharding: str = "none",
    trained_fraction: float = 1.0,
    gpu: str | None = None,
) -> tuple[BatchPlan, dict[str, Any]]:
    """The plan for `recipe` on `num_processes` devices of kind `device` with `budget_bytes` each, and the
    estimator settings it was planned with (the training loop's, as `estimate_settings` derives them)."""
    loss = resolve_loss_impl(recipe.training.loss, config)
    settings = estimate_settings(
        recipe, loss=loss, device=device, sharding=sharding, precision=precision, trained_fraction=trained_fraction
    )
    rates = plan_rates(device, settings["precision"], config, gpu=gpu)
    plan = plan_for_budget(
        recipe, config, settings, budget_bytes=budget_bytes, num_processes=num_processes, rates=rates
    )
    return plan, settings


def plan_run(
    recipe: Recipe, config: Any, precision: str, acc: Accelerator, engine: str, trained_fraction: float = 1.0
) -> BatchPlan:
    """The micro-batch and the checkpointing: the recipe's where it fixes them, else the fastest the memory estimate
    and the time model find within the budget (`plan_recipe`). grpo is planned against the budget either way: its
    generation rows (`BatchPlan.generation_rows`) are the planner's to choose, the step's fixed or not."""
    from llmtune.model import whole_model_init
    from llmtune.parallel import SHARDING, decided_by_main

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
        if fixed is not None and t.objective != "grpo":
            return BatchPlan(t.micro_batch_size, per_process // t.micro_batch_size, n, "recipe", checkpointing=fixed)
    budget = resolve_budget(recipe.memory.budget, acc.device)
    # Free memory can differ between devices; every process must train the same micro-batch.
    budget = int(acc.gather(torch.tensor([budget], device=acc.device)).min())
    device = "cuda" if acc.device.type == "cuda" else "cpu"

    def plan() -> BatchPlan:
        # Planning runs real ops on random tensors (the rates) and must leave the run's random state as it found
        # it: the model's initialisation and the data order come after it.
        # whole_model_init: the models it builds are this process's alone; ZeRO-3's zero.Init would partition them
        # with collectives that the other processes, waiting for the plan, never join.
        with torch.random.fork_rng(devices=[acc.device] if acc.device.type == "cuda" else []), whole_model_init():
            return plan_recipe(
                recipe,
                config,
                device=device,
                budget_bytes=budget,
                num_processes=n,
                precision=precision,
                sharding=SHARDING[engine],
                trained_fraction=trained_fraction,
            )[0]

    # The rates are timed on one process's clock and rank the candidates: each process timing its own could choose
    # another plan (a loaded host's clock differs) and wait in collectives the others never join.
    return decided_by_main(acc, plan)


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
