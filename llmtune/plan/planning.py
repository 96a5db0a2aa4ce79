"""One planning chain for training, `llmtune estimate` and `llmtune bench`: config -> estimator settings -> the
time model's rates -> the fastest micro-batch and checkpointing within the budget (`plan_recipe`).

`plan_run` is the training loop's use of it: the batch split the recipe fixes, or the plan the main process
finds for this launch; `shrink_plan` is what an out-of-memory error or a measured peak over the budget does to it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from llmtune.errors import RunFailed, SetupError, UserError
from llmtune.objectives.base import Objective
from llmtune.ops.loss import resolve_loss_impl
from llmtune.parallel.engines import Engine
from llmtune.plan.batch_plan import BatchPlan, MemoryPlanError
from llmtune.plan.budget import host_budget, resolve_budget
from llmtune.plan.from_recipe import (
    estimate_settings,
    loss_chunk_rows,
    plan_for_budget,
    plan_rates,
    planned_precision,
    unsplittable,
)
from llmtune.plan.report import forecasts, speeds_shown
from llmtune.plan.search import sequence_degrees
from llmtune.plan.timing import Rates, compiled
from llmtune.recipe import Recipe, checkpointing_of
from llmtune.units import format_bytes

if TYPE_CHECKING:
    from accelerate import Accelerator


log = logging.getLogger(__name__)


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
    rates: Rates | None = None,
    host_bytes: int | None = None,
    processes_per_node: int | None = None,
) -> tuple[BatchPlan, dict[str, Any]]:
    """The plan for `recipe` on `num_processes` devices of kind `device` with `budget_bytes` each, and the
    estimator settings it was planned with (the training loop's, as `estimate_settings` derives them). `rates`:
    the time model's, where the caller has them (else `plan_rates`); `host_bytes`: the host memory a process may
    pin for activation offloading (None: not known, not checked); `processes_per_node`: those of the processes a node
    holds (None: not known, `llmtune.plan.search.NODE_PROCESSES`)."""
    recipe = runnable_recipe(recipe, sharding)
    loss = resolve_loss_impl(recipe.training.loss, config)
    settings = estimate_settings(
        recipe,
        loss=loss,
        device=device,
        sharding=sharding,
        precision=precision,
        trained_fraction=trained_fraction,
        gpu=gpu,
    )
    settings["chunk_size"] = loss_chunk_rows(config, device=device, gpu=gpu, budget_bytes=budget_bytes)
    rates = rates or plan_rates(device, settings["precision"], config, gpu=gpu, tf32=recipe.training.tf32_on(device))
    if recipe.training.compiles(device):
        rates = compiled(rates)
    plan = plan_for_budget(
        recipe,
        config,
        settings,
        budget_bytes=budget_bytes,
        num_processes=num_processes,
        rates=rates,
        host_bytes=host_bytes,
        processes_per_node=processes_per_node,
    )
    return plan, settings


# The engines the planner weighs for several processes, as the launcher's config names them, and the estimator's name
# for each one's sharding.
ENGINES: dict[str, str] = {
    "ddp": "none",
    "fsdp2": "fsdp",
    "fsdp2 (fsdp_reshard_after_forward: false)": "fsdp_no_reshard",
    "zero2": "zero2",
    "zero3": "zero3",
}


@dataclass(frozen=True)
class EngineChoice:
    """One engine's plan for a launch (None where nothing fits, or llmtune refuses the engine for the recipe: `why`)
    and the estimator settings it was planned with (`plan_recipe`'s)."""

    engine: str
    sharding: str
    plan: BatchPlan | None
    why: str = ""
    settings: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        p = self.plan
        return {
            "engine": self.engine,
            "sharding": self.sharding,
            "fits": p is not None and p.fits,
            "sequence_parallel": p.sequence_parallel if p else None,
            "tiled_mlp": p.tiled_mlp if p else None,
            "micro_batch_size": p.micro_batch_size if p else None,
            "checkpointing": p.checkpointing.describe(p.estimate.settings["layers"]) if p and p.estimate else None,
            "predicted_peak_bytes": p.predicted_peak_bytes if p else None,
            # Nominal rates rank the engines (their order) but forecast no speed.
            "predicted_tokens_per_s": (
                round(p.predicted_tokens_per_s, 1) if p and p.predicted_tokens_per_s and forecasts(p) else None
            ),
            "why": self.why,
        }


def plan_engines(recipe: Recipe, config: Any, *, device: str, num_processes: int, **kwargs: Any) -> list[EngineChoice]:
    """Every engine's plan for `recipe` on `num_processes` devices (`plan_recipe`'s `kwargs`), fastest first by the
    time model (its communication over the card's link included), those that do not fit or are refused last."""
    from llmtune.objectives import objective_for

    precision = kwargs.get("precision") or planned_precision(recipe.training.precision, device)
    rates = plan_rates(device, precision, config, gpu=kwargs.get("gpu"), tf32=recipe.training.tf32_on(device))
    choices = []
    for engine, sharding in ENGINES.items():
        try:
            check_engine(recipe, engine.split()[0], objective_for(recipe))
            plan, settings = plan_recipe(
                recipe, config, device=device, num_processes=num_processes, sharding=sharding, rates=rates, **kwargs
            )
            choices.append(EngineChoice(engine, sharding, plan, _why_over(recipe, sharding, plan), settings))
        except MemoryPlanError as err:
            choices.append(EngineChoice(engine, sharding, None, _why_none_fits(recipe, sharding, err, kwargs)))
        except SetupError as err:
            choices.append(EngineChoice(engine, sharding, None, str(err)))
    return sorted(choices, key=_engine_order)


def runnable_recipe(recipe: Recipe, sharding: str) -> Recipe:
    """`recipe` as the engine of `sharding` can run it: under ZeRO-3, adapters whose checkpointing the planner chooses
    (auto) are planned without it, the one setting that runs there (`check_engine`), and without tiled MLPs where
    those are the planner's too: each tile is recomputed under the same non-reentrant checkpointing
    (`llmtune.model.tiling`)."""
    t, parallel = recipe.training, recipe.parallel
    if sharding != "zero3" or recipe.peft.method == "none" or checkpointing_of(t.gradient_checkpointing) is not None:
        return recipe
    tiled = False if parallel.tiled_mlp == "auto" else parallel.tiled_mlp
    return replace(
        recipe,
        training=replace(t, gradient_checkpointing=False),
        parallel=replace(parallel, tiled_mlp=tiled),
    )


def _without_checkpointing(recipe: Recipe, sharding: str) -> str:
    """What a row says first where `runnable_recipe` took checkpointing from the planner's choices."""
    return "" if runnable_recipe(recipe, sharding) is recipe else "without checkpointing (LoRA under ZeRO-3): "


def _why_over(recipe: Recipe, sharding: str, plan: BatchPlan) -> str:
    """Why a plan that was made does not fit, from its own peaks (`BatchPlan.fits`): the step's at the micro-batch the
    recipe fixes, or grpo's generate call's; "" where it fits."""
    if plan.fits:
        return ""
    if plan.predicted_peak_bytes is not None and plan.predicted_peak_bytes > plan.budget_bytes:
        what, peak = f"the recipe's micro-batch {plan.micro_batch_size}", plan.predicted_peak_bytes
    else:
        what, peak = f"a generate call of {plan.generation_rows} rows", plan.generation.peak_bytes
    return (
        f"{_without_checkpointing(recipe, sharding)}{what} peaks at {format_bytes(peak)}, over the budget of"
        f" {format_bytes(plan.budget_bytes)}"
    )


# The model's states that no micro-batch, checkpointing or split of the rows makes smaller (`MemoryEstimate.breakdown`).
STATE_TAGS = ("weights", "gradients", "optimizer_states")


def _why_none_fits(recipe: Recipe, sharding: str, err: MemoryPlanError, kwargs: dict[str, Any]) -> str:
    """Why no plan fits under an engine, its row's reason first: where the engine's share of the model's states alone
    is over the budget, that (the smallest step's split of the rows does not apply to them); else the smallest step's
    peak, as the planner's error says (`llmtune.plan.search`). The error follows whole."""
    smallest, budget = getattr(err, "estimate", None), kwargs.get("budget_bytes")
    states = sum(smallest.breakdown.get(tag, 0) for tag in STATE_TAGS) if smallest is not None else 0
    first = _without_checkpointing(recipe, sharding)
    if budget is None or states <= budget:
        return f"{first}{err}"
    return (
        f"{first}weights, gradients and optimizer states alone take {format_bytes(states)} a process, over the budget"
        f" ({format_bytes(budget)}) whatever the micro-batch, checkpointing or split of the rows. {err}"
    )


def _engine_order(c: EngineChoice) -> tuple[bool, float]:
    fits = c.plan is not None and c.plan.fits
    return (not fits, -(c.plan.predicted_tokens_per_s or 0.0) if fits else 0.0)


def format_engines(choices: list[EngineChoice]) -> list[str]:
    """The engines as `llmtune estimate` shows them: fastest first, the chosen marked, why the others were not."""
    planned = next((c.plan for c in choices if c.plan is not None), None)
    nominal = planned is not None and not forecasts(planned)
    fitting = [c.plan.predicted_tokens_per_s if c.plan is not None and c.plan.fits else None for c in choices]
    speeds = speeds_shown(planned, fitting) if planned is not None else ["-"] * len(choices)
    rows = [("engine", "sequence", "MLP", "micro", "checkpointing", "peak", "x fastest" if nominal else "tokens/s", "")]
    for i, (c, speed) in enumerate(zip(choices, speeds, strict=True)):
        d = c.to_dict()
        peak = format_bytes(d["predicted_peak_bytes"]) if d["predicted_peak_bytes"] else "-"
        why = "<- chosen" if i == 0 and d["fits"] else c.why.split(". ")[0]
        tiled = {True: "tiled", False: "whole", None: "-"}[d["tiled_mlp"]]
        split = str(d["sequence_parallel"] or "-")
        rows.append(
            (c.engine, split, tiled, str(d["micro_batch_size"] or "-"), d["checkpointing"] or "-", peak, speed, why)
        )
    widths = [max(len(r[i]) for r in rows) for i in range(7)]
    per = "speed against the fastest, nominal rates" if nominal else "tokens/s a process"
    lines = ["", f"engines ({per}; communication over the cards' link; sequence: processes a row is split across):"]
    return lines + ["  " + "  ".join(f"{v:<{w}}" for v, w in zip(r, widths, strict=False)) + "  " + r[7] for r in rows]


def how(plan: BatchPlan, engine: str | None) -> dict[str, Any]:
    """How the run is planned to go, in one place (`llmtune estimate`'s answer): the engine (None: the one given),
    the sequence-parallel degree, the MLP's tiling, checkpointing, the batch split, the predicted peak and step time."""
    s = plan.estimate.settings
    tokens = plan.micro_batch_size * plan.grad_accum_steps * s["seq_len"] / plan.sequence_parallel
    speed = plan.predicted_tokens_per_s if forecasts(plan) else None  # nominal rates rank; they forecast no time
    return {
        "engine": engine or s["sharding"],
        "num_processes": plan.num_processes,
        "sequence_parallel": plan.sequence_parallel,
        "tokens_per_process": -(-s["seq_len"] // plan.sequence_parallel),
        "tiled_mlp": plan.tiled_mlp,
        "checkpointing": plan.checkpointing.describe(s["layers"]),
        "micro_batch_size": plan.micro_batch_size,
        "grad_accum_steps": plan.grad_accum_steps,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "fits": plan.fits,
        "predicted_step_seconds": round(tokens / speed, 3) if speed else None,
        "predicted_tokens_per_s": round(speed, 1) if speed else None,
    }


def format_how(h: dict[str, Any], budget_bytes: int) -> str:
    """`how` in one line."""
    split = (
        f"each row split across {h['sequence_parallel']} processes ({h['tokens_per_process']:,} tokens a process)"
        if h["sequence_parallel"] > 1
        else "whole rows on each process"
    )
    step = f", a step {h['predicted_step_seconds']:,.1f} s" if h["predicted_step_seconds"] else ""
    speed = f" ({h['predicted_tokens_per_s']:,.0f} tokens/s a process)" if h["predicted_tokens_per_s"] else ""
    return (
        f"how: {h['engine']} on {h['num_processes']} process(es), {split},"
        f" MLP {'in sequence tiles' if h['tiled_mlp'] else 'whole'}, checkpointing {h['checkpointing']},"
        f" micro-batch {h['micro_batch_size']} x {h['grad_accum_steps']} accumulated; predicted peak"
        f" {format_bytes(h['predicted_peak_bytes'])} of {format_bytes(budget_bytes)}"
        f"{'' if h['fits'] else ' (DOES NOT FIT)'}{step}{speed}"
    )


def engine_note(choices: list[EngineChoice], launched: str) -> str | None:
    """What to tell a launch whose engine (`launched`: the estimator's sharding name) is not the fastest that fits;
    None where it is, or where none fits."""
    best = choices[0] if choices and choices[0].plan is not None and choices[0].plan.fits else None
    if best is None or best.sharding == launched:
        return None
    ours = next((c for c in choices if c.sharding == launched), None)
    speed = ours.plan.predicted_tokens_per_s if ours and ours.plan and ours.plan.fits else None
    compared = f"{best.plan.predicted_tokens_per_s / speed:.2f}x" if speed else "where this launch's is over budget,"
    return (
        f"the planner would launch {best.engine}: predicted {best.plan.predicted_tokens_per_s:,.0f} tokens/s a"
        f" process, {compared} this launch's engine's (`llmtune estimate --recipe R --num-processes N` ranks them)"
    )


def engine_advice(
    recipe: Recipe, config: Any, *, device: str, num_processes: int, launched: str, **kwargs: Any
) -> str | None:
    """What `train` logs for a launch on several GPUs whose engine (`launched`, the estimator's sharding name) is not
    the one `plan_engines` ranks first (`engine_note`). None for one process, and on CPUs: their processes' link is
    not known, so the engines cannot be ranked."""
    if num_processes < 2 or device != "cuda":
        return None
    return engine_note(plan_engines(recipe, config, device=device, num_processes=num_processes, **kwargs), launched)


def plan_run(
    recipe: Recipe, config: Any, precision: str, acc: Accelerator, engine: str, trained_fraction: float = 1.0
) -> BatchPlan:
    """The micro-batch and the checkpointing: the recipe's where it fixes them, else the fastest the memory estimate
    and the time model find within the budget (`plan_recipe`). grpo is planned against the budget either way: its
    generation rows (`BatchPlan.generation_rows`) are the planner's to choose, the step's fixed or not."""
    from llmtune.model.load import whole_model_init
    from llmtune.parallel.engines import decided_by_main, sharding_of

    t, n = recipe.training, acc.num_processes
    degree = fixed_degree(recipe, config, n)
    per_process = rows_per_process(t.global_batch_size, n, degree)
    budget = resolve_budget(recipe.memory.budget, acc.device)
    # Free memory can differ between devices; every process must train the same micro-batch (and loss chunk).
    budget = int(acc.gather(torch.tensor([budget], device=acc.device)).min())
    device = "cuda" if acc.device.type == "cuda" else "cpu"
    fixed = checkpointing_of(t.gradient_checkpointing)
    if t.micro_batch_size != "auto":
        if per_process % t.micro_batch_size:
            raise PlanError(
                f"training.global_batch_size={t.global_batch_size} = {n} processes x {per_process} per"
                f" process, which training.micro_batch_size={t.micro_batch_size} does not divide"
            )
        if fixed is not None and t.objective != "grpo":
            chunk = loss_chunk_rows(config, device=device, gpu=None, budget_bytes=budget)
            return BatchPlan(
                t.micro_batch_size,
                per_process // t.micro_batch_size,
                n,
                "recipe",
                checkpointing=fixed,
                chunk_rows=chunk,
                sequence_parallel=degree,
                tiled_mlp=recipe.parallel.tiled_mlp is True,  # auto, unplanned: whole
            )

    def plan() -> BatchPlan:
        # Planning runs real ops on random tensors (the rates) and must leave the run's random state as it found
        # it: the model's initialisation and the data order come after it.
        # whole_model_init: the models it builds are this process's alone; ZeRO-3's zero.Init would partition them
        # with collectives that the other processes, waiting for the plan, never join.
        kwargs = dict(budget_bytes=budget, precision=precision, trained_fraction=trained_fraction)
        kwargs["processes_per_node"] = int(os.environ.get("LOCAL_WORLD_SIZE", n))  # the launcher's, on this node
        if device == "cuda":  # offloading pins this host's memory, shared by the processes on it
            kwargs["host_bytes"] = host_budget(kwargs["processes_per_node"])
        with torch.random.fork_rng(devices=[acc.device] if acc.device.type == "cuda" else []), whole_model_init():
            chosen = plan_recipe(recipe, config, device=device, num_processes=n, sharding=sharding_of(engine), **kwargs)
            note = engine_advice(recipe, config, device=device, num_processes=n, launched=sharding_of(engine), **kwargs)
            if note:
                log.info(note)
            return chosen[0]

    # The rates are timed on one process's clock and rank the candidates: each process timing its own could choose
    # another plan (a loaded host's clock differs) and wait in collectives the others never join.
    return decided_by_main(acc, plan)


def rows_per_process(global_batch_size: int, num_processes: int, degree: int) -> int:
    """The rows each data-parallel process trains a step (`num_processes` / `degree` of them); a PlanError naming the
    nearest global batch sizes they divide where they do not divide this one."""
    data_parallel = num_processes // degree
    per_process, rest = divmod(global_batch_size, data_parallel)
    if rest:
        below, above = global_batch_size - rest, global_batch_size - rest + data_parallel
        nearest = f"{below} or {above}" if below else str(above)
        raise PlanError(
            f"training.global_batch_size={global_batch_size} is not divisible by the {data_parallel} data-parallel"
            f" processes ({num_processes} processes, sequence_parallel {degree}); nearest valid: {nearest}"
        )
    return per_process


def fixed_degree(recipe: Recipe, config: Any, num_processes: int) -> int:
    """The recipe's `parallel.sequence_parallel` where it fixes one, checked against the processes, the model's
    heads (`sequence_degrees`) and the objective (`unsplittable`); 1 for auto: the planner's to choose."""
    degree = recipe.parallel.sequence_parallel
    if degree == "auto":
        return 1
    sequence_degrees(config, num_processes, degree)
    why = unsplittable(recipe)
    if degree > 1 and why is not None:
        raise PlanError(f"parallel.sequence_parallel={degree}: {why}")
    return degree


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


def check_engine(recipe: Recipe, engine: Engine, objective: Objective) -> None:
    """Refuse, before the accelerator and the model, what the launcher's engine cannot run."""
    fixed = checkpointing_of(recipe.training.gradient_checkpointing)
    if engine == "zero3" and recipe.peft.method != "none" and fixed is not None and fixed.enabled:
        # ZeRO-3 frees partitioned weights that non-reentrant recomputation then needs (a known
        # DeepSpeed/peft failure); refuse it here rather than at the first backward. `auto` is planned without
        # recomputation there (`runnable_recipe`).
        raise SetupError(
            "LoRA + gradient checkpointing under DeepSpeed ZeRO-3 fails with non-reentrant checkpointing."
            " Use recipes/accelerate/fsdp2.yaml or deepspeed_zero2.yaml, or set training.gradient_checkpointing to"
            " false or auto (planned without it under ZeRO-3)."
        )
    objective.check_engine(engine)
