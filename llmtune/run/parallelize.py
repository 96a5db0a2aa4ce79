"""One step from the loaded causal LM to the module and optimizer the loop trains, as torchtitan's `parallelize_llama`.

The transformations apply in the only order they may:

1. activation checkpointing (the plan's layers), on the plain transformers model, then the plan's tiled MLP inside
   the checkpointed layers (llmtune.model.tiling);
2. PEFT adapters, around the checkpointed model (they need its input-grad hook);
3. `torch.compile` of each decoder block, after both (checkpointing wraps the compiled block);
4. the objective's module, whose forward returns the loss (llmtune.objectives);
5. the engine: FSDP2's `fully_shard` (before the optimizer, which must hold the shards), or DeepSpeed's config
   (the plan's micro-batch and accumulation, before `prepare`);
6. `Accelerator.prepare` (DDP, DeepSpeed), which FSDP2 skips: Accelerate would wrap the sharded model again.

Anything that must run on the prepared module (a DPO reference's log-probs, `Objective.attach`) comes after it.

The sequence split (llmtune.parallel.sequence) is no step here: the model loads with its attention (`load_model`), each
process's part of the rows comes from the loop, and FSDP2 and DDP treat a sequence group's processes as data-parallel
ones (FSDP2 shards over the whole (data, sequence) mesh).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from accelerate import Accelerator
from transformers import PreTrainedModel

from llmtune.model.adapters import apply_peft, cast_trained, count_parameters
from llmtune.model.blocks import apply_checkpointing, compile_blocks
from llmtune.model.tiling import tile_mlp
from llmtune.objectives import Objective
from llmtune.ops.optim import make_optimizer
from llmtune.parallel import engines
from llmtune.plan import BatchPlan
from llmtune.recipe import Checkpointing, Recipe, checkpointing_of
from llmtune.run.metrics import ModelFlops, model_flops


class Parallelized(NamedTuple):
    module: torch.nn.Module  # the objective's module as the engine prepared it: what the loop calls
    optimizer: torch.optim.Optimizer
    parameters: tuple[int, int]  # (trainable, total) of the adapted model
    flops: ModelFlops  # its FLOPs per token (the MFU numerator)


def parallelize(
    model: PreTrainedModel,
    recipe: Recipe,
    objective: Objective,
    plan: BatchPlan,
    *,
    loss_impl: str,
    engine: engines.Engine,
    precision: str,
    accelerator: Accelerator,
) -> Parallelized:
    """Apply checkpointing -> PEFT -> compile -> the objective's module -> FSDP2 or the DeepSpeed config -> prepare."""
    model = adapt(model, recipe, plan.checkpointing, tiled_mlp=plan.tiled_mlp, device_type=accelerator.device.type)
    # Measured on whole parameters, before the engine shards them (FSDP2's DTensors, ZeRO-3's empty tensors).
    parameters, flops = count_parameters(model), model_flops(model)
    dtype = engines.weights_dtype(engine, precision)
    module = objective.module(model, loss_impl, accelerator.device, dtype, chunk_size=plan.chunk_rows)
    if engine == "fsdp2":
        engines.shard_fsdp2(module, precision)  # before the optimizer, which must hold the shards
    optimizer = make_optimizer(module, recipe, accelerator.device)
    if engines.is_deepspeed(engine):
        hidden = model.config.get_text_config().hidden_size
        t = recipe.training
        engines.configure_deepspeed(accelerator, plan.micro_batch_size, plan.grad_accum_steps, t.max_grad_norm, hidden)
    if engine != "fsdp2":
        # FSDP2 is applied above: Accelerate would wrap the sharded model in DDP on top. Its model and optimizer are
        # checkpointed with torch.distributed.checkpoint (engines.save_state).
        module, optimizer = accelerator.prepare(module, optimizer)
    return Parallelized(module, optimizer, parameters, flops)


def adapt(
    model: PreTrainedModel,
    recipe: Recipe,
    checkpointing: Checkpointing | None = None,
    *,
    device_type: str | None = None,
    tiled_mlp: bool | None = None,
) -> PreTrainedModel:
    """Steps 1-3 on the plain causal LM: checkpointing (`checkpointing`, by default the recipe's, off for `auto`) ->
    the tiled MLP (`tiled_mlp`, by default the recipe's `parallel.tiled_mlp`, off for `auto`) -> PEFT -> compile (as
    `training.compiles` resolves it on `device_type`, by default the device of the model's weights). The benchmarks
    that measure a model as training runs it take this step alone."""
    if checkpointing is None:
        checkpointing = checkpointing_of(recipe.training.gradient_checkpointing) or Checkpointing(0)
    apply_checkpointing(model, checkpointing)
    if tiled_mlp is None:
        tiled_mlp = recipe.parallel.tiled_mlp is True  # auto is the planner's to decide: off without a plan
    if tiled_mlp:
        # Inside the checkpointed layer (its recomputation runs the tiles again, one at a time), on the plain model
        # before PEFT: the tiled forward calls the MLP's projections by name, so the adapters PEFT puts there next
        # run tile by tile too; before compile, which must trace the tiled forward.
        tile_mlp(model)
    if recipe.peft.method != "none":
        model = apply_peft(model, recipe.peft, gradient_checkpointing=checkpointing.enabled)
        if recipe.peft.adapter_dtype == "bf16":
            cast_trained(model, torch.bfloat16)
    if recipe.training.compiles(device_type or next(model.parameters()).device.type):
        compile_blocks(model)
    return model
