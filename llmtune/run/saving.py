"""Checkpoints and `final/` from the loop: when a checkpoint is due or a signal asks for one (every process stops
together), and out of memory writing `final/`, what is kept. The files themselves are llmtune.run.checkpoint's."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from llmtune.recipe import Recipe, dump_recipe
from llmtune.run import checkpoint
from llmtune.run.model_card import model_card
from llmtune.run.preemption import Preemption
from llmtune.run.state import Run

log = logging.getLogger(__name__)


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
    if stop:
        log.warning(stopped_line(run.recipe, step))
    return stop


def stopped_line(r: Recipe, step: int) -> str:
    """What a run stopped by a signal says last: where it stopped, and the command that continues it."""
    line = (
        f"stopped at step {step} of {r.training.max_steps}, checkpointed in {checkpoint.checkpoints_root(r.output_dir)}"
    )
    if r.checkpoint.resume == "auto":
        return f"{line}: run the same command to continue"
    return f"{line}: run the same command with checkpoint.resume=auto to continue"


def save(run: Run, step: int) -> None:
    # lineage: the checkpoints this one descends from, the only ones its pruning may delete (llmtune.run.checkpoint).
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


def save_final(run: Run, step: int, eval_loss: float | None) -> Path:
    """`final/`, with its model card (`eval_loss`: the last evaluation's, if any); out of memory gathering the whole
    model there, the run stops in one line (exit 1: a requeue would meet the same gather), its last step checkpointed
    first where no peer waits in the gather (one process)."""
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
            card=model_card(run, step, eval_loss),
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
