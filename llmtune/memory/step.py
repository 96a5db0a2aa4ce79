"""What the estimator's traced step runs, on fake tensors: the model as training builds it, the optimizer it
chooses, a micro-batch as the collate makes it, and the module the loop trains (`llmtune.memory.trace` runs them)."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import torch

from llmtune.loss import CausalLMWithLoss
from llmtune.memory.kernels import AdamW8bitModel, quantize_base_4bit
from llmtune.memory.settings import Settings
from llmtune.model import peft_quietly


def _build_model(config: Any, s: Settings) -> torch.nn.Module:
    """The model as `llmtune.model.load_model` builds it for training, on fake tensors."""
    from transformers import AutoModelForCausalLM

    from llmtune.model import check_attn_implementation, check_bitsandbytes_device

    check_attn_implementation(config, s.attn_implementation, installed=False)
    check_bitsandbytes_device(s.lora.method if s.lora else "none", s.optimizer, s.device)
    cfg = copy.deepcopy(config)
    cfg.use_cache = False
    dtype = torch.bfloat16 if s.precision == "bf16-true" else torch.float32
    # flash-attention-2 may not be installed here (planning for a GPU). transformers runs it without a
    # mask on packed rows (varlen) and with native GQA; SDPA's flash kernel, run without a mask below,
    # keeps the same output and fp32 log-sum-exp, so it stands in for it.
    attn = "sdpa" if s.attn_implementation == "flash_attention_2" else s.attn_implementation
    # Full init on fake tensors costs nothing real and keeps what init does beyond values
    # (tying the lm head to the embedding).
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=dtype)
    lora = s.lora
    if lora is None:
        return model
    from peft import LoraConfig, get_peft_model

    target = lora.target_modules
    # peft moves each new adapter to its base layer's device with Module.to(), which on fake
    # parameters takes the swap_tensors path and fails. Everything is already on the (fake)
    # CPU, and adapters stay fp32 as peft's autocast_adapter_dtype=True leaves them.
    move = torch.nn.Module.to
    torch.nn.Module.to = lambda self, *a, **k: self
    try:
        with peft_quietly():
            model = get_peft_model(
                model,
                LoraConfig(
                    r=lora.rank,
                    lora_alpha=lora.alpha,
                    target_modules=target if isinstance(target, str) else list(target),
                    lora_dropout=0.1 if lora.dropout else 0.0,
                    use_dora=lora.method == "dora",
                    task_type="CAUSAL_LM",
                ),
            )
    finally:
        torch.nn.Module.to = move
    if lora.method == "qlora":
        quantize_base_4bit(model, torch.float16 if s.precision == "fp16" else torch.bfloat16)
    return model


def _build_optimizer(params: list[torch.nn.Parameter], optimizer: str, device: str):
    if optimizer == "adamw_fused":
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    if optimizer == "adamw_bf16":  # llmtune's optimizer for bf16 weights: bf16 states, chunked fp32 temporaries
        from llmtune.optim import BF16AdamW

        return BF16AdamW(params, lr=1e-3)
    if optimizer == "adamw_8bit":
        return AdamW8bitModel(params, lr=1e-3)
    # torch's own default for the target device: foreach on CUDA, the per-tensor loop on CPU.
    return torch.optim.AdamW(params, lr=1e-3, foreach=(device == "cuda"))


def _batch(s: Settings) -> dict[str, torch.Tensor]:
    """A micro-batch as `llmtune.data.collate` makes it: packed rows carry position ids and no attention
    mask (transformers builds the block-diagonal mask itself), padded rows an attention mask.

    Preference pairs as `llmtune.preference.collate_pairs` makes them: packed, `micro_batch_size` rows of
    `seq_len` tokens holding whole pairs (counted as one pair a row: only [pairs, 2] tensors depend on it);
    padded, a row per sequence, chosen and rejected, each `seq_len // 2` long (a pair fills `max_length`).
    GRPO completions as `llmtune.grpo.collate_completions` makes them (`_completions`)."""
    if s.objective == "grpo":
        return _completions(s)
    rows, width = s.micro_batch_size, s.seq_len
    pairs = s.objective != "sft"
    if pairs and s.layout == "padded":
        rows, width = 2 * s.micro_batch_size, max(2, s.seq_len // 2)
    ids = {
        "input_ids": torch.zeros((rows, width), dtype=torch.long),
        "labels": torch.zeros((rows, width), dtype=torch.long),
    }
    if pairs:
        ids |= {
            "segment_ids": torch.zeros((rows, width), dtype=torch.long),
            "pair_ids": torch.arange(s.micro_batch_size),
        }
        if s.reference == "precomputed":
            ids["ref_logps"] = torch.zeros((s.micro_batch_size, 2), dtype=torch.float32)
    if s.layout == "packed":
        return ids | {"position_ids": torch.zeros((rows, width), dtype=torch.long)}
    return ids | {"attention_mask": torch.ones((rows, width), dtype=torch.long)}


def _completions(s: Settings) -> dict[str, torch.Tensor]:
    """`micro_batch_size` prompt + completion rows padded to `seq_len` (the planner's data.max_length +
    grpo.max_new_tokens), with an advantage each. Old log-probs (num_iterations > 1: 4 bytes a trained token) are
    left out: beside the logits they are noise."""
    shape = (s.micro_batch_size, s.seq_len)
    return {
        "input_ids": torch.zeros(shape, dtype=torch.long),
        "labels": torch.zeros(shape, dtype=torch.long),
        "attention_mask": torch.ones(shape, dtype=torch.long),
        "advantages": torch.zeros(s.micro_batch_size, dtype=torch.float32),
    }


def _step_module(config: Any, model: torch.nn.Module, s: Settings) -> torch.nn.Module:
    """What the loop trains (the objective's `module`, llmtune.objectives): SFT's loss module or preference's,
    with a frozen copy for `reference="copy"` (its weights count as `reference_weights`)."""
    if s.objective == "sft":
        return CausalLMWithLoss(model, s.loss, s.chunk_size)
    frozen = None
    if s.reference == "copy":
        frozen = _build_model(config, replace(s, lora=None)).requires_grad_(False).eval()
    if s.objective == "grpo":
        from llmtune.grpo import GRPOModel
        from llmtune.recipe import GRPOConfig

        # beta only decides whether the reference runs (`reference` says so); the clip and the averaging of the loss
        # keep nothing the size of the batch beyond per-token vectors.
        cfg = GRPOConfig(beta=0.0 if s.reference == "none" else 0.04)
        return GRPOModel(model, s.loss, cfg, s.reference, frozen)
    from llmtune.preference import PreferenceModel
    from llmtune.recipe import PreferenceConfig

    return PreferenceModel(model, s.loss, s.objective, PreferenceConfig(), s.reference, frozen, s.chunk_size)
