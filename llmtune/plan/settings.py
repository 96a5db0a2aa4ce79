"""The settings of one estimated training step: what `estimate` takes, checked (`settings_of`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmtune.model.experts import EXPERTS_IMPLEMENTATIONS
from llmtune.model.precision import OFFLOAD_NEEDS_CUDA
from llmtune.ops.loss import default_chunk_size
from llmtune.recipe import Checkpointing, checkpointing_of

PRECISIONS = ("fp32", "bf16", "fp16", "bf16-true")
OPTIMIZERS = ("adamw", "adamw_fused", "adamw_bf16", "adamw_8bit")
LOSSES = ("hf", "chunked")
LAYOUTS = ("packed", "padded")
OBJECTIVES = ("sft", "dpo", "orpo", "simpo", "grpo")
REFERENCES = ("none", "adapter_disabled", "copy", "precomputed")
SHARDINGS = ("none", "fsdp", "fsdp_no_reshard", "zero2", "zero3")
DEVICES = ("cuda", "cpu")


@dataclass(frozen=True)
class LoraSpec:
    """LoRA adapters as peft builds them; base weights are frozen."""

    rank: int = 8
    target_modules: tuple[str, ...] | str = "all-linear"
    dropout: bool = False  # True: peft keeps a dropout mask-sized copy of each adapter input
    alpha: int = 16
    method: str = "lora"  # lora | dora (peft's magnitude vectors) | qlora (4-bit NF4 base, see kernels.py)
    dtype: str = "fp32"  # the adapters' (peft.adapter_dtype): fp32 as peft keeps them, or bf16 under bf16-true


@dataclass(frozen=True, kw_only=True)
class Settings:
    """One step's settings, as `settings_of` checks them; hashable, since traces are cached by them."""

    micro_batch_size: int
    seq_len: int
    layout: str = "packed"
    precision: str
    checkpointing: Checkpointing
    attn_implementation: str = "sdpa"
    optimizer: str = "adamw"
    loss: str = "hf"
    chunk_size: int
    lora: LoraSpec | None = None
    num_processes: int = 1
    sharding: str = "none"
    device: str = "cuda"
    grad_accum_steps: int = 1
    ddp_bucket_view: bool = False
    trained_fraction: float = 1.0
    expandable_segments: bool = True
    objective: str = "sft"
    reference: str = "none"
    compute_capability: tuple[int, int] | None = None  # the CUDA card's (None: sm80/sm90): its attention kernels
    # Processes each row is split across along the sequence (llmtune.parallel.sequence): the step is one process's, on
    # its shard of `seq_len` / sequence_parallel tokens a row, attention all-to-all'd to the whole rows at its heads'
    # share.
    sequence_parallel: int = 1
    tiled_mlp: bool = False  # each decoder MLP computed in sequence tiles (llmtune.model.tiling)
    # A mixture of experts' kernel (llmtune.model.experts): transformers' default, as a run decides it for the device
    experts_implementation: str = "grouped_mm"

    @property
    def sharded_16bit(self) -> bool:
        """Mixed precision under a sharding engine: the blocks compute from 16-bit weights (FSDP2's
        `MixedPrecisionPolicy`, DeepSpeed's bf16/fp16 modules), not under autocast, while the fp32 master weights,
        gradients and optimizer states are kept sharded (`llmtune.plan.sharding`)."""
        return self.sharding != "none" and self.precision in ("bf16", "fp16")


def settings_of(
    config: Any, *, gradient_checkpointing: bool | Checkpointing, chunk_size: int | None = None, **settings: Any
) -> Settings:
    """The settings of an estimate, checked: `settings` are `Settings`' fields (micro_batch_size, seq_len and
    precision required). The step: forward on `micro_batch_size` x `seq_len` tokens laid out
    as `layout` (packed or padded rows, only the loss kept), backward, optimizer step,
    `zero_grad(set_to_none=True)`. With `grad_accum_steps > 1` the previous micro-steps' gradients are alive
    during forward and backward.
    `num_processes`/`sharding` divide the sharded states; `"none"` with several processes is
    DDP with its gradient buckets unless `ddp_bucket_view` (gradient_as_bucket_view=True); `fsdp` is FSDP2
    resharding after forward, `fsdp_no_reshard` keeps the blocks gathered from forward to backward.
    `gradient_checkpointing`: a `Checkpointing` (every k-th layer, selective), or a bool for every layer / none.
    `chunk_size`: the chunked loss's rows per chunk, by default `llmtune.ops.loss.default_chunk_size` of the vocabulary.
    `objective` dpo / orpo / simpo traces `llmtune.objectives.pair_losses.PreferenceModel` on pairs (`micro_batch_size`
    examples, each a pair), grpo `llmtune.objectives.rollouts.GRPOModel` on `micro_batch_size` completions (prompt +
    completion rows, padded), each with its `reference` forward (adapter_disabled, a frozen copy) or none.
    `sequence_parallel` N: one process of a group of N that splits every row along the sequence (rows padded to a
    multiple of N, as training pads them); refused where the model cannot be split so
    (`llmtune.parallel.sequence.refusal`).
    """
    from llmtune.parallel.sequence import refusal

    s = Settings(
        checkpointing=checkpointing_of(gradient_checkpointing),
        chunk_size=chunk_size or default_chunk_size(getattr(config, "text_config", config).vocab_size),
        **settings,
    )
    _validate(s)
    why = refusal(config, s.sequence_parallel)
    if why is not None:
        raise ValueError(f"sequence_parallel={s.sequence_parallel}: {why}")
    return s


def _validate(s: Settings) -> None:
    """Refuse settings no step can run, with the reason."""
    if s.micro_batch_size < 1 or s.seq_len < 2:
        raise ValueError("micro_batch_size must be >= 1 and seq_len >= 2")
    if s.sequence_parallel < 1 or s.num_processes % s.sequence_parallel:
        raise ValueError(f"sequence_parallel={s.sequence_parallel}: expected >= 1 dividing {s.num_processes} processes")
    if not 0 < s.trained_fraction <= 1:
        raise ValueError(f"trained_fraction={s.trained_fraction}; expected 0 < f <= 1")
    if s.objective == "dpo" and s.reference == "none":
        raise ValueError("objective dpo needs its reference: 'adapter_disabled' (LoRA), 'copy' or 'precomputed'")
    if s.objective == "grpo" and s.layout != "padded":
        raise ValueError("objective grpo trains its completions in padded rows (one prompt + completion a row)")
    if s.checkpointing.offload and not s.checkpointing.enabled:
        raise ValueError("checkpointing.offload moves the inputs that checkpointing saves: it needs checkpointing")
    if s.checkpointing.offload and s.device != "cuda":
        raise ValueError(OFFLOAD_NEEDS_CUDA)
    if s.lora is not None and s.lora.dtype not in ("fp32", "bf16"):
        raise ValueError(f"lora dtype={s.lora.dtype!r}; expected fp32 or bf16")
    if s.lora is not None and s.lora.dtype == "bf16" and s.precision != "bf16-true":
        raise ValueError(f"bf16 adapters need precision bf16-true, not {s.precision}: mixed precision trains fp32")
    for name, value, allowed in (
        ("objective", s.objective, OBJECTIVES),
        ("reference", s.reference, REFERENCES),
        ("layout", s.layout, LAYOUTS),
        ("precision", s.precision, PRECISIONS),
        ("optimizer", s.optimizer, OPTIMIZERS),
        ("loss", s.loss, LOSSES),
        ("sharding", s.sharding, SHARDINGS),
        ("device", s.device, DEVICES),
        ("experts_implementation", s.experts_implementation, EXPERTS_IMPLEMENTATIONS),
    ):
        if value not in allowed:
            raise ValueError(f"{name}={value!r}; expected one of {allowed}")
