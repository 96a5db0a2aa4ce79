"""What keeps a run sound when a step goes wrong: the non-finite guard, the budget check and the out-of-memory stop.

Signals (a scheduler's preemption) are `llmtune.run.preemption`'s; a micro-batch too large for the device is shrunk in
place where the step can simply be redone (`llmtune.run.loop.train_step`), and stopped here where it cannot.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

import torch
from accelerate import Accelerator

from llmtune.errors import EXIT_FAILED, EXIT_PREEMPTED
from llmtune.parallel.engines import decided_by_main
from llmtune.plan import BatchPlan
from llmtune.plan.planning import TrainingError, shrink_plan
from llmtune.run.rundir import RunLock
from llmtune.run.state import Run

log = logging.getLogger(__name__)

OOM_FILE = "out_of_memory.json"  # the micro-batch to resume with after an out-of-memory stop


class NonFiniteGuard:
    """Counts steps whose loss or gradients were non-finite (their update skipped) and stops the run after
    `limit` in a row: a run that keeps diverging only burns its budget, and the last good checkpoint is kept."""

    def __init__(self, limit: int, checkpoints: Path) -> None:
        self.limit, self.checkpoints = limit, checkpoints
        self.in_a_row = 0

    def check(self, step: int, finite: bool, loss: float, grad_norm: float, loss_scale: float | None = None) -> None:
        """After 0-based `step`; raises TrainingError at the limit. `loss_scale`: fp16's, where the step had one."""
        if finite:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        what = f"loss ({loss})" if not math.isfinite(loss) else f"gradient norm ({grad_norm})"
        if math.isfinite(loss) and loss_scale is not None:
            what = f"gradients (fp16 overflow at loss scale {loss_scale:g}: they overflow unscaled)"
        log.warning("step %d: non-finite %s, update skipped (%d in a row)", step + 1, what, self.in_a_row)
        if self.in_a_row >= self.limit:
            raise TrainingError(
                f"step {step + 1}: {self.in_a_row} consecutive non-finite losses or gradients; stopping. The"
                f" last good checkpoint is kept in {self.checkpoints}. Try a lower learning"
                " rate, bf16 instead of fp16, or a smaller training.max_grad_norm."
            )


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
    plan = run.plan
    smaller = None if plan.micro_batch_size == 1 else shrink_plan(plan, per_process).micro_batch_size
    stop_out_of_memory(run.recipe.output_dir, run.accelerator.process_index, run.lock, where,
                       "micro_batch_size", plan.micro_batch_size, smaller)  # fmt: skip


# What out_of_memory.json can ask the next run for, in words.
LIMITS = {"micro_batch_size": "micro-batch {}", "generation_rows": "{} generation rows a call"}


def stop_out_of_memory(
    output_dir: str | Path, process_index: int, lock: RunLock, where: str, limit: str, now: int, smaller: int | None
) -> NoReturn:
    """`stop_after_out_of_memory` for any batch the plan sets (`limit`, a key of LIMITS, at `now`): record `smaller`
    in OOM_FILE beside what an earlier stop recorded and exit 75, or exit 1 where nothing is left to shrink (None)."""
    what = LIMITS[limit].format
    if smaller is None:
        log.error(
            "process %d: out of memory in the %s at %s; nothing left to shrink (see `llmtune estimate`)",
            process_index, where, what(now),
        )  # fmt: skip
        lock.release()
        logging.shutdown()
        os._exit(EXIT_FAILED)
    path = Path(output_dir) / OOM_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    limits = json.loads(path.read_text()) if path.is_file() else {}
    # Every process that ran out of memory writes it (the same plan shrinks the same way): each under its own name,
    # then renamed, so a reader never sees half a file.
    tmp = path.with_name(f".{OOM_FILE}.{process_index}")
    tmp.write_text(json.dumps({**limits, limit: smaller, "where": where}) + "\n")
    os.replace(tmp, path)
    log.error(
        "process %d: out of memory in the %s at %s; stopping all processes (exit %d). Run the same"
        " command with checkpoint.resume=auto: it continues from the last checkpoint with %s.",
        process_index, where, what(now), EXIT_PREEMPTED, what(smaller),
    )  # fmt: skip
    lock.release()  # no `finally` runs after os._exit: the same command must find the folder free
    logging.shutdown()
    os._exit(EXIT_PREEMPTED)  # not an exception: unwinding could wait on the peers' collectives


def plan_after_out_of_memory(output_dir: str | Path, accelerator: Accelerator, plan: BatchPlan) -> BatchPlan:
    """`plan`, shrunk to the micro-batch and generation rows an earlier out-of-memory stop asked for (OOM_FILE)."""
    path = Path(output_dir) / OOM_FILE

    def limits() -> dict[str, int]:
        return json.loads(path.read_text()) if path.is_file() else {}

    # One process's disk decides (another node's may not show the file yet): all must train the same micro-batch.
    asked = decided_by_main(accelerator, limits)
    at_most = asked.get("micro_batch_size")
    if at_most is not None and at_most < plan.micro_batch_size:
        plan = shrink_plan(plan, plan.micro_batch_size * plan.grad_accum_steps, at_most=at_most)
        log.info("an earlier run stopped out of memory: micro-batch %d", plan.micro_batch_size)
    rows = asked.get("generation_rows")
    if rows is not None and (plan.generation_rows == 0 or rows < plan.generation_rows):
        plan = replace(plan, generation_rows=rows)
        log.info("an earlier run stopped out of memory generating: %d rows a call", rows)
    return plan


def check_budget(run: Run, step: int, reserved: int, per_process: int) -> None:
    """After step 2, shrink the plan on every process if any measured its peak above the budget: the estimate
    missed, and an out-of-memory error need not be waited for."""
    acc = run.accelerator
    over_budget = run.plan.budget_bytes is not None and reserved > run.plan.budget_bytes
    if step == 2 and bool(acc.reduce(torch.tensor(int(over_budget), device=acc.device), "sum")):
        run.plan = shrink_plan(run.plan, per_process)
        log.warning("measured peak above the budget: micro-batch now %d", run.plan.micro_batch_size)
