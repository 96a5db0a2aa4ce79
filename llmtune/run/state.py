"""The records the training loop passes around: `Run`, built once by `llmtune.run.setup.build`, each step's
`StepBatches` (prepared ahead) and its `StepResult`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from accelerate import Accelerator

from llmtune.data import PreparedData
from llmtune.objectives import Objective
from llmtune.parallel.engines import Engine
from llmtune.parallel.sequence import SequenceGroup
from llmtune.plan import BatchPlan
from llmtune.recipe import Recipe
from llmtune.run.metrics import ModelFlops
from llmtune.run.rundir import RunLock


@dataclass
class Run:
    """Everything `fit` needs."""

    recipe: Recipe
    accelerator: Accelerator
    precision: str
    precision_why: str  # shown in the setup log: `auto` differs between machines
    tokenizer: Any
    data: PreparedData
    objective: Objective
    model: torch.nn.Module  # the objective's module: DDP/DeepSpeed-prepared by Accelerate, or FSDP2-sharded
    engine: Engine
    optimizer: torch.optim.Optimizer
    plan: BatchPlan
    flops: ModelFlops
    peak_flops: float  # the MFU denominator
    peak_flops_source: str  # datasheet or measured (metrics.peak_flops)
    num_layers: int = 0
    start_step: int = 0
    speed: dict[str, Any] | None = None  # the time model's prediction against the run's first timed steps
    counters: dict[str, int] = field(default_factory=lambda: {"trained_tokens": 0, "skipped_steps": 0})
    lineage: list[str] = field(default_factory=list)  # the checkpoints this run descends from (llmtune.run.checkpoint)
    lock: RunLock = field(default_factory=RunLock)  # the output_dir's, on the main process (llmtune.run.rundir)
    host_group: Any = None  # the processes' group over host memory (parallel.host_group); None in one process
    sequence: SequenceGroup = field(default_factory=SequenceGroup)  # this process's (llmtune.parallel.sequence)


class StepBatches(NamedTuple):
    """One optimizer step's input on this process, ready on the host (`llmtune.run.batches.step_batches`)."""

    rows: list[dict]  # the rows it trains on (GRPO: the completions)
    micro_batch_size: int  # the plan's when it was split (a plan shrunk since splits it again)
    micro_batches: list[dict[str, Any]]  # collated; pinned where the device is a GPU
    counts: list[int]  # trained tokens, processed tokens, the sum of squared lengths, units: this process's


class StepResult(NamedTuple):
    loss: float  # per unit (trained token or pair), all processes
    trained_tokens: int  # all processes
    flops: float  # model FLOPs, all processes (metrics.ModelFlops)
    grad_norm: float
    overflow: bool  # fp16: the loss scaler found inf/nan gradients and skipped the update
    finite: bool  # loss and gradients finite; else the update was skipped (fp16: an overflow at loss scale <= 1)
    extra: dict[str, float]  # the objective's own metrics (preference: rewards, margin, accuracy)
    loss_scale: float | None = None  # fp16: the loss scale the step ran at
