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
    if accelerator.device.type == "cpu":
        use_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    host_group = engines.host_group(accelerator, recipe.distributed.timeout)
    return Launched(engines.engine_in_use(engine), accelerator, precision, why, host_group)


def use_cpu_threads(processes_here: int) -> None:
    """Set torch's CPU threads as `cpu_threads` chooses, and say why in the setup log."""
    load, cores = host_load()
    threads, why = cpu_threads(os.environ.get("OMP_NUM_THREADS"), cores, load, processes_here)
    if threads is not None:
        torch.set_num_threads(threads)
    log.info("CPU threads: %d (%s)", torch.get_num_threads(), why)


def host_load() -> tuple[float, int]:
    """The 1-minute load average and the cores this process may run on."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return (os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0), cores


def cpu_threads(omp: str | None, cores: int, load: float, processes_here: int) -> tuple[int | None, str]:
    """This process's share of the cores that other work leaves free, or None where OMP_NUM_THREADS chose already.

    Torch's default (a thread per core) on a host where another process keeps a core busy made a quickstart run 9x
    slower than one thread (3 min 38 s against 24 s on 2 cores): OpenMP threads spin-wait at every barrier for the
    one the scheduler took off its core. The 1-minute load average is the work that was there before this run
    started (a process that has just begun adds little to it)."""
    if omp:
        return None, f"OMP_NUM_THREADS={omp}"
    share = max(1, cores // max(1, processes_here))
    free = max(1, cores - int(load))
    threads = min(share, free)
    why = f"{cores} cores, {processes_here} process(es) on this host, load average {load:.1f}"
    if threads < share:
        why += f": the other {cores - free} core(s) are busy"
    return threads, why + "; OMP_NUM_THREADS=N chooses them"
