"""The launch, before any data or model: refuse what this machine or engine cannot run, then build the Accelerator
with the recipe's precision (the recipe wins over an Accelerate config)."""

from __future__ import annotations

import logging
import os
from typing import Any, NamedTuple

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from llmtune.model.precision import check_requirements, choose_precision
from llmtune.objectives import Objective
from llmtune.parallel import engines
from llmtune.plan import expandable_segments
from llmtune.plan.planning import check_engine
from llmtune.recipe import Recipe
from llmtune.run.metrics import check_trackers

log = logging.getLogger(__name__)


def make_accelerator(recipe: Recipe, engine: engines.Engine, objective: Objective) -> tuple[Accelerator, str, str]:
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
        **engines.prepare_launch(engine, device_type, recipe.distributed.timeout),
    )
    if launcher and launcher != mixed:
        log.info("the launcher asked for mixed_precision=%s; the recipe's precision %s wins", launcher, precision)
    return accelerator, precision, why


class Launched(NamedTuple):
    """What the launch decided, before any data or model."""

    engine: engines.Engine  # as it runs (DeepSpeed over gloo: the engine Accelerate sets up)
    accelerator: Accelerator
    precision: str
    precision_why: str  # shown in the setup log: `auto` differs between machines
    host_group: Any  # the processes' group over host memory (engines.host_group); None in one process


def launch(recipe: Recipe, objective: Objective) -> Launched:
    """The engine the launcher set up, refused here where it cannot run this recipe, and the Accelerator."""
    engine = engines.launched_engine()
    accelerator, precision, why = make_accelerator(recipe, engine, objective)
    host_group = engines.host_group(accelerator, recipe.distributed.timeout)
    return Launched(engines.engine_in_use(engine), accelerator, precision, why, host_group)
