"""What the planner takes from a recipe: the estimator's settings for the step training runs, the time model's rates
for the device, and the plan within a budget."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import torch

from llmtune.catalogue import compute_capability, datasheet_bandwidth, datasheet_peak_flops
from llmtune.model.experts import experts_choice
from llmtune.objectives import reference_for
from llmtune.ops.loss import chunk_rows
from llmtune.ops.optim import optimizer_choice
from llmtune.plan import timing
from llmtune.plan.batch_plan import BatchPlan
from llmtune.plan.generation import (
    GenerationEstimate,
    generation_peak,
    generation_resident,
    plan_generation_rows,
)
from llmtune.plan.search import plan_micro_batch
from llmtune.plan.settings import LoraSpec
from llmtune.plan.timing import NOMINAL_RATES, Rates
from llmtune.recipe import DataConfig, ModelConfig, PeftConfig, Recipe, TrainingConfig, checkpointing_of


def planned_precision(recipe_precision: str, device: str) -> str:
    """The mode a plan for `device` assumes: the recipe's `auto` as bf16 on CUDA (planning for a GPU that may not be
    this machine's; every GPU worth planning for has it), as the local CPU's choice otherwise."""
    from llmtune.model.precision import resolve_precision

    if device == "cuda":
        return "bf16" if recipe_precision == "auto" else recipe_precision
    return resolve_precision(recipe_precision, device)


def estimate_settings(
    recipe: Recipe,
    *,
    loss: str,
    device: str,
    sharding: str = "none",
    precision: str | None = None,
    trained_fraction: float = 1.0,
    gpu: str | None = None,
):
    """The estimator's keyword arguments for `recipe` run on `device` as the training loop would run it (on CUDA,
    on the card named `gpu`, else this machine's: its compute capability picks the attention kernels).

    `trained_fraction` is the data's `DataStats.max_trained_fraction` where the data is at hand (training);
    without it (`llmtune estimate`) every token is taken as trained, the upper bound. The rows' length, layout and
    trained share are `training_rows`' (grpo's: prompt + completion rows).

    `precision` is the resolved mode; left out, `planned_precision`'s.
    """
    t, peft = recipe.training, recipe.peft
    precision = precision or planned_precision(t.precision, device)
    lora = None
    if peft.method != "none":
        target = peft.target_modules if isinstance(peft.target_modules, str) else tuple(peft.target_modules)
        lora = LoraSpec(
            rank=peft.rank,
            target_modules=target,
            dropout=peft.dropout > 0,
            alpha=int(peft.alpha),
            method=peft.method,
            dtype=peft.adapter_dtype,
        )
    optimizer = optimizer_choice(t.optimizer, precision, peft.method, peft.adapter_dtype)
    rows = training_rows(recipe, trained_fraction)
    capability = card_capability(device, gpu)
    return dict(
        precision=precision,
        layout=rows.layout,
        gradient_checkpointing=checkpointing_of(t.gradient_checkpointing) or "auto",
        attn_implementation=recipe.model.attn_implementation,
        optimizer=optimizer,
        loss=loss,
        lora=lora,
        sharding=sharding,
        device=device,
        trained_fraction=rows.trained_fraction,
        expandable_segments=expandable_segments(recipe),
        objective=t.objective,
        reference=reference_for(recipe),
        compute_capability=capability,
        experts_implementation=experts_choice(
            recipe.model.experts_implementation,
            device=device,
            precision=precision,
            compiled=t.compiles(device),
            capability=capability,
        )[0],
    )


def card_capability(device: str, gpu: str | None) -> tuple[int, int] | None:
    """The compute capability of the CUDA card planned for: named (`--gpu`), else this machine's; None for a CPU or
    a card not known (taken as a data-center one, sm80/sm90)."""
    if device != "cuda":
        return None
    if gpu:
        return compute_capability(gpu)
    return tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None


def card_name(device: str, gpu: str | None) -> str | None:
    """The CUDA card planned for: named (`--gpu`), else this machine's; None for a CPU or where there is no GPU."""
    if device != "cuda":
        return None
    return gpu or (torch.cuda.get_device_name() if torch.cuda.is_available() else None)


def loss_chunk_rows(config: Any, *, device: str, gpu: str | None, budget_bytes: int | None) -> int:
    """The chunked loss's rows per chunk on `device` (the card `card_name` names) within `budget_bytes`
    (`llmtune.ops.loss.chunk_rows`, from the card's datasheet 16-bit peak over its bandwidth): what the planner traces
    and training's loss runs (`BatchPlan.chunk_rows`)."""
    name = card_name(device, gpu)
    peak, bandwidth = (datasheet_peak_flops(name), datasheet_bandwidth(name)) if name else (None, None)
    ratio = peak / bandwidth if peak and bandwidth else None
    vocab = config.get_text_config().vocab_size
    return chunk_rows(vocab, device=device, flops_per_byte=ratio, budget_bytes=budget_bytes)


@dataclass(frozen=True)
class TrainingRows:
    """The rows a recipe's training step takes, as the planner plans them: the longest, their layout, and the most
    of a row's tokens that carry the loss."""

    seq_len: int
    layout: str  # packed | padded
    trained_fraction: float


def training_rows(recipe: Recipe, trained_fraction: float = 1.0) -> TrainingRows:
    """grpo trains a prompt (at most data.max_length tokens) and its completion (at most grpo.max_new_tokens) a row,
    right-padded, never packed (`llmtune.data.prepare.packs`), with only the completion trained: at most
    max_new_tokens of the row's tokens whatever `trained_fraction` says (the prompts' data trains no token: its
    fraction is 0 and bounds nothing the policy samples). Else data.max_length tokens, packed as data.packing says,
    `trained_fraction` of them trained (at least one token)."""
    d = recipe.data
    if recipe.training.objective == "grpo":
        length = d.max_length + recipe.grpo.max_new_tokens
        return TrainingRows(length, "padded", recipe.grpo.max_new_tokens / length)
    # Prompt sources (the only ones `packs` refuses to pack) belong to grpo: recipe checks say so.
    return TrainingRows(d.max_length, "packed" if d.packing else "padded", max(trained_fraction, 1 / d.max_length))


def expandable_segments(recipe: Recipe) -> bool:
    """Whether CUDA's caching allocator runs with expandable segments: PYTORCH_CUDA_ALLOC_CONF's word, else
    the recipe's `memory.expandable_segments` (which training then applies)."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments" in conf:
        return "expandable_segments:true" in conf.replace(" ", "").lower()
    return recipe.memory.expandable_segments


def plan_rates(device: str, precision: str, config: Any, gpu: str | None = None, tf32: bool = False) -> Rates:
    """The time model's rates for the device planned for: a GPU named with --gpu from its datasheet (fp32 matmuls
    at TF32's rate where `tf32`), this machine's own device measured (`timing.measure_rates`, as the run has set
    TF32), else nominal rates that rank candidates but forecast nothing."""
    # Looked up in `timing` at each call, where a test (tests/test_scale_out.py) stands in for the measurement.
    if gpu:
        return timing.datasheet_rates(gpu, precision, tf32) or NOMINAL_RATES
    here = "cuda" if torch.cuda.is_available() else "cpu"
    if device != here:
        return NOMINAL_RATES
    dtype = {"bf16": torch.bfloat16, "bf16-true": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    return timing.measure_rates(device, dtype, config)


def plan_for_budget(
    recipe: Recipe,
    config: Any,
    settings: dict[str, Any],
    *,
    budget_bytes: int,
    num_processes: int,
    rates: Rates | None = None,
    host_bytes: int | None = None,
    processes_per_node: int | None = None,
) -> BatchPlan:
    """The fastest micro-batch, checkpointing, sequence-parallel degree and MLP tiling for the recipe's global batch
    and rows (`training_rows`) within `budget_bytes`, as far as the recipe leaves them open, on nodes of
    `processes_per_node` (`plan_micro_batch`); a fixed `training.micro_batch_size` is planned as given (whether it
    fits or not: `BatchPlan.fits`). grpo: then the rows of each generate call (`with_generation`)."""
    t = recipe.training
    plan = plan_micro_batch(
        config,
        global_batch_size=t.global_batch_size,
        num_processes=num_processes,
        budget_bytes=budget_bytes,
        seq_len=training_rows(recipe).seq_len,
        micro_batch_size=None if t.micro_batch_size == "auto" else t.micro_batch_size,
        rates=rates,
        host_bytes=host_bytes,
        sequence_parallel=recipe.parallel.sequence_parallel if unsplittable(recipe) is None else 1,
        tiled_mlp=recipe.parallel.tiled_mlp,
        processes_per_node=processes_per_node,
        **settings,
    )
    return with_generation(plan, recipe, config, budget_bytes) if t.objective == "grpo" else plan


def unsplittable(recipe: Recipe) -> str | None:
    """Why the recipe's rows cannot be split along the sequence whatever the model (None: they can)."""
    if recipe.training.objective == "grpo" and recipe.grpo.num_iterations > 1:
        # The old log-probs are kept per token of whole rows, computed before the step: a shard's would need
        # gathering across the group, which is not built.
        return "it runs grpo with grpo.num_iterations 1 only"
    return None


def with_generation(plan: BatchPlan, recipe: Recipe, config: Any, budget_bytes: int | None) -> BatchPlan:
    """`plan` with grpo's generation rows: the most completions of this process's (whole groups) one `generate`
    call can sample within `budget_bytes` beside what training keeps between steps (`generation_resident` of the
    plan's estimate); every prompt taken at data.max_length tokens, the longest. The generation phase comes after
    the training step's choice: sampling fewer rows a call costs calls, never the step's micro-batch."""
    g, s = recipe.grpo, plan.estimate.settings
    resident = generation_resident(plan.estimate)

    def peak_of(rows: int) -> GenerationEstimate:
        return generation_peak(
            config,
            rows=rows,
            prompt_tokens=recipe.data.max_length,
            max_new_tokens=g.max_new_tokens,
            resident_bytes=resident,
            precision=s["precision"],
            sharding=s["sharding"],
            top_p=g.top_p,
            attn_implementation=s["attn_implementation"],
            lora=s["lora"]["method"] if s["lora"] else None,
        )

    per_process = recipe.training.global_batch_size // plan.num_processes
    rows, estimate = plan_generation_rows(
        peak_of, group=g.num_generations, per_process=per_process, budget_bytes=budget_bytes
    )
    return replace(plan, generation_rows=rows, generation=estimate)


def recipe_for_model(
    name: str,
    config: Any,
    *,
    method: str,
    seq_len: int,
    device: str,
    global_batch_size: int = 32,
    adapter_dtype: str = "fp32",
) -> Recipe:
    """The recipe `llmtune estimate --model NAME` plans when no recipe is given: common fine-tuning defaults.

    Checkpointing and the micro-batch planned (the fastest that fits) for a global batch of 32; LoRA / QLoRA as in
    recipes/llama3-8b-lora.yaml (rank 16 on every linear layer, base weights in bf16 on a GPU, since mixed
    precision would keep an fp32 copy of weights that never change); a full fine-tune in mixed precision;
    SDPA attention, or eager for a model without an SDPA path (Gemma-2), as transformers falls back.
    """
    from llmtune.errors import SetupError
    from llmtune.model.load import check_attn_implementation

    try:
        check_attn_implementation(config, "sdpa", installed=False)
        attn = "sdpa"
    except SetupError:
        attn = "eager"
    adapters = method in ("lora", "qlora")
    precision = "bf16-true" if adapters and device == "cuda" else "auto"
    return Recipe(
        model=ModelConfig(name_or_path=name, attn_implementation=attn),
        data=DataConfig(max_length=seq_len),
        training=TrainingConfig(precision=precision, global_batch_size=global_batch_size, micro_batch_size="auto"),
        peft=PeftConfig(
            method="none" if method == "full" else method, rank=16, alpha=32.0, adapter_dtype=adapter_dtype
        ),
    )
