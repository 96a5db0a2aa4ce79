"""The learning rate of each step: warmup, then constant, linear or cosine decay to `min_lr_ratio` of the peak."""

from __future__ import annotations

import math

import torch

from llmtune.recipe import Recipe


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
