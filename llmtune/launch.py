"""The launch, before any data or model: refuse what this machine or engine cannot run, then build the Accelerator
with the recipe's precision (the recipe wins over an Accelerate config)."""

from __future__ import annotations

import logging
import os

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from llmtune import parallel
from llmtune.memory import expandable_segments
from llmtune.metrics import check_trackers
from llmtune.model import SetupError, check_requirements, choose_precision
from llmtune.objectives import Objective
from llmtune.recipe import Recipe

log = logging.getLogger(__name__)


def make_accelerator(recipe: Recipe, engine: parallel.Engine, objective: Objective) -> tuple[Accelerator, str, str]:
    """Accelerator with the recipe's precision (and why that one)."""
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    check_requirements(recipe, device_type)
    check_engine(recipe, engine, objective)
    check_trackers(recipe.logging.report_to)
    if device_type == "cuda" and expandable_segments(recipe):
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")  # before the first allocation
    # TF32 is process-wide: set before anything times a matmul (the planner's rates, the MFU's peak). auto: on for
    # CUDA, where an fp32 recipe's matmuls would otherwise run at 1/7 of TF32's rate for mantissa bits training does
    # not need (the HF Trainer's tf32=True, nanoGPT); `allow_tf32` rather than set_float32_matmul_precision("high"),
    # which also reaches CPU backends' fp32 matmuls.
    torch.backends.cuda.matmul.allow_tf32 = recipe.training.tf32_on(device_type)
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
        **parallel.prepare_launch(engine, device_type, recipe.distributed.timeout),
    )
    if launcher and launcher != mixed:
        log.info("the launcher asked for mixed_precision=%s; the recipe's precision %s wins", launcher, precision)
    return accelerator, precision, why


def check_engine(recipe: Recipe, engine: parallel.Engine, objective: Objective) -> None:
    """Refuse, before the accelerator and the model, what the launcher's engine cannot run."""
    if engine == "zero3" and recipe.peft.method != "none" and recipe.training.gradient_checkpointing:
        # ZeRO-3 frees partitioned weights that non-reentrant recomputation then needs (a known
        # DeepSpeed/peft failure); refuse it here rather than at the first backward.
        raise SetupError(
            "LoRA + gradient checkpointing under DeepSpeed ZeRO-3 fails with non-reentrant checkpointing."
            " Use recipes/accelerate/fsdp2.yaml or deepspeed_zero2.yaml, or turn checkpointing off."
        )
    objective.check_engine(engine)
