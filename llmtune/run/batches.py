"""What an optimizer step trains on: the rows drawn for it (made ahead, in the background, where no model is needed),
the objective's rollout of them (GRPO), split into the plan's micro-batches and collated on the host."""

from __future__ import annotations

import torch

from llmtune.data import batch_for_step, squared_lengths
from llmtune.data.prefetch import pinned
from llmtune.objectives import trained_tokens
from llmtune.objectives.base import FromData
from llmtune.parallel import sequence
from llmtune.run.resilience import (
    stop_out_of_memory,
)
from llmtune.run.state import Run, StepBatches


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


def collate_for(run: Run, examples: list[dict]) -> dict[str, torch.Tensor]:
    # A compiled model recompiles for every new shape: packed rows are then padded to max_length, rounded up to the
    # group's processes where split along the sequence (a fill of ~95% costs little), so every micro-batch has the
    # shape the memory plan traced. Otherwise, split along the sequence, rows are padded to a multiple of the group's
    # processes.
    static = run.data.packed and run.recipe.training.compiles(run.accelerator.device.type)
    return run.objective.collate(
        examples,
        pad_token_id=run.tokenizer.pad_token_id,
        packed=run.data.packed,
        pad_to_multiple_of=sequence.rows_padded_to(run.sequence.degree, run.recipe.data.max_length if static else None),
    )
