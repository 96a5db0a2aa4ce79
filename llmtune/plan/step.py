"""What the estimator's traced step runs, on fake tensors: the model as training builds it, and what training runs
on it, by the same code: the objective's own module and collate (`llmtune.objectives`) and the optimizer
`llmtune.ops.optim` builds (`llmtune.plan.trace` runs them)."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import torch

from llmtune.model.adapters import cast_trained, lora_config, peft_quietly
from llmtune.objectives import Objective, objective_named
from llmtune.ops.optim import build_optimizer
from llmtune.plan.kernels import AdamW8bitModel, quantize_base_4bit, route_balanced, upcast_for_kbit_training
from llmtune.plan.settings import Settings


def objective_of(s: Settings) -> Objective:
    """The objective the step trains, with the reference the settings name."""
    return objective_named(s.objective, s.reference)


def micro_batch(objective: Objective, s: Settings) -> dict[str, torch.Tensor]:
    """A micro-batch as the objective's `collate` makes it from `micro_batch_size` of its longest examples (`seq_len`
    tokens: the largest micro-batch of the run); under sequence parallelism, one process's shard of it, as training
    pads its rows to a multiple of the degree and shards them (`llmtune.parallel.sequence.shard_batch`: all shards are
    the same size). Real tensors, made outside the trace: a collate reads its examples' values (where sequences start),
    which fake tensors do not have."""
    from llmtune.parallel.sequence import SequenceGroup, rows_padded_to, shard_batch

    packed = s.layout == "packed"
    examples = [objective.longest_example(s.seq_len, packed)] * s.micro_batch_size
    degree = s.sequence_parallel
    batch = objective.collate(examples, pad_token_id=0, packed=packed, pad_to_multiple_of=rows_padded_to(degree))
    return shard_batch(batch, SequenceGroup(degree))


def build_model(config: Any, s: Settings) -> torch.nn.Module:
    """The model as `llmtune.model.load.load_model` builds it for training, on fake tensors."""
    from transformers import AutoModelForCausalLM

    from llmtune.model.experts import experts_implementation_of
    from llmtune.model.load import check_attn_implementation
    from llmtune.model.precision import check_bitsandbytes_device

    check_attn_implementation(config, s.attn_implementation, installed=False)
    check_bitsandbytes_device(s.lora.method if s.lora else "none", s.optimizer, s.device)
    cfg = copy.deepcopy(config)
    cfg.use_cache = False
    # bf16-true's weights are bf16; a sharding engine's mixed precision computes from 16-bit copies of its fp32
    # shards, traced as 16-bit weights whose fp32 states `llmtune.plan.sharding` sizes.
    dtype = torch.float32
    if s.precision == "bf16-true" or s.sharded_16bit:
        dtype = torch.float16 if s.precision == "fp16" else torch.bfloat16
    # flash-attention-2 may not be installed here (planning for a GPU). transformers runs it without a
    # mask on packed rows (varlen) and with native GQA; SDPA's flash kernel, run without a mask below,
    # keeps the same output and fp32 log-sum-exp, so it stands in for it.
    attn = "sdpa" if s.attn_implementation == "flash_attention_2" else s.attn_implementation
    # Full init on fake tensors costs nothing real and keeps what init does beyond values
    # (tying the lm head to the embedding). A mixture of experts' kernel as the run loads it (None: no experts).
    experts = experts_implementation_of(cfg, s.experts_implementation)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=dtype, experts_implementation=experts)
    if experts == "eager":  # its loop over the experts hit reads the routing, which fake tensors do not have
        route_balanced(model)
    lora = s.lora
    if lora is None:
        return model
    from peft import get_peft_model

    target = lora.target_modules
    # peft moves each new adapter to its base layer's device with Module.to(), which on fake
    # parameters takes the swap_tensors path and fails. Everything is already on the (fake)
    # CPU, and adapters stay fp32 as peft's autocast_adapter_dtype=True leaves them (bf16: cast below).
    move = torch.nn.Module.to
    torch.nn.Module.to = lambda self, *a, **k: self
    try:
        with peft_quietly():
            model = get_peft_model(
                model,
                lora_config(
                    model,
                    rank=lora.rank,
                    alpha=lora.alpha,
                    target_modules=target if isinstance(target, str) else list(target),
                    dropout=0.1 if lora.dropout else 0.0,
                    dora=lora.method == "dora",
                ),
            )
    finally:
        torch.nn.Module.to = move
    if lora.method == "qlora":
        quantize_base_4bit(model, torch.float16 if s.precision == "fp16" else torch.bfloat16)
        if lora.dtype == "fp32":  # training's `apply_peft` upcasts beside fp32 adapters only
            upcast_for_kbit_training(model)
    if lora.dtype == "bf16":  # after peft, as training casts them (`parallelize.adapt`)
        cast_trained(model, torch.bfloat16)
    return model


def step_module(config: Any, model: torch.nn.Module, objective: Objective, s: Settings) -> torch.nn.Module:
    """What the loop trains: the objective's own `module`, given the frozen reference (`reference="copy"`, its weights
    counted as `reference_weights`) built here. Training's `objectives.base.frozen_copy` cannot run on fake tensors
    (deepcopy refuses them: "Mixing fake modes"; `.to` swaps them, which fails), so the copy is built as the model is,
    without adapters: training's holds the same weights, and under LoRA the adapters too (QLoRA's 4-bit base, not
    this full-width one), and under FSDP2 / DeepSpeed its parameters in their compute dtype (`parallel.weights_dtype`),
    where this copy's stay as the model builds them."""
    frozen = None
    if s.reference == "copy":
        frozen = build_model(config, replace(s, lora=None)).requires_grad_(False).eval()
    cpu = torch.device("cpu")  # the fake tensors' device, whatever is planned for (kernels.CudaKernels)
    return objective.module(model, s.loss, cpu, None, chunk_size=s.chunk_size, reference_model=frozen)


def step_optimizer(params: list[torch.nn.Parameter], s: Settings) -> torch.optim.Optimizer:
    """The optimizer `s.optimizer` names (`llmtune.ops.optim.optimizer_choice`), built as training builds it (in one
    group:
    training's two, decayed or not, keep the same states); bitsandbytes' AdamW8bit by the model of its states
    (`kernels.AdamW8bitModel`)."""
    return build_optimizer(s.optimizer, params, s.device, lr=1e-3, adamw_8bit=_adamw_8bit)


def _adamw_8bit(params: list[torch.nn.Parameter], lr: float, betas: tuple[float, float]) -> torch.optim.Optimizer:
    return AdamW8bitModel(params, lr=lr)  # its states' sizes do not depend on the betas
