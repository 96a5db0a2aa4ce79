"""The eval split's loss per unit (trained token, or pair) over all processes, when it is due."""

from __future__ import annotations

import torch

from llmtune.data import eval_batches
from llmtune.data.batch import to_device
from llmtune.data.prefetch import pinned
from llmtune.parallel import sequence
from llmtune.run.batches import collate_for
from llmtune.run.metrics import MetricsLogger
from llmtune.run.resilience import (
    stop_after_out_of_memory,
)
from llmtune.run.state import Run


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
