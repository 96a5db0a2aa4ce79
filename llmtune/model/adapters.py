"""PEFT adapters on the causal LM: LoRA, DoRA and QLoRA as the recipe's `peft` section asks, their dtype, and the
parameters that train (counted for the setup log and the MFU)."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from transformers import PreTrainedModel

from llmtune.model.experts import lora_expert_targets, trained_by_part
from llmtune.recipe import PeftConfig

log = logging.getLogger(__name__)


@contextlib.contextmanager
def peft_quietly() -> Iterator[None]:
    """Wrap peft model construction: peft (0.17-0.21) reads transformers 5's deprecated `is_gradient_checkpointing`
    property, which warns once per wrapped model (a FutureWarning addressed to peft, not to our users)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def apply_peft(model: PreTrainedModel, cfg: PeftConfig, *, gradient_checkpointing: bool):
    from peft import get_peft_model, prepare_model_for_kbit_training

    if cfg.method == "qlora" and cfg.adapter_dtype == "fp32":
        # It casts every 16-bit weight that is not 4-bit (embeddings, head, norms) to fp32 beside fp32 adapters;
        # bf16 adapters keep them bf16 (as litgpt and torchtune do), and the residual stream with them.
        model = prepare_model_for_kbit_training(
            model,
            # apply_checkpointing has already chosen the layers; peft would re-enable checkpointing on all of them.
            use_gradient_checkpointing=False,
        )
    if gradient_checkpointing and not getattr(model, "_require_grads_hook", None):
        # Frozen embeddings produce outputs that need no grad; a checkpointed block whose inputs need
        # no grad would give its adapters none ("element 0 of tensors does not require grad").
        # transformers registers this hook itself when it enables checkpointing (5.17 and 5.25 do); a model
        # handed in with checkpointing enabled some other way still needs it.
        model.enable_input_require_grads()
    lora = lora_config(
        model,
        rank=cfg.rank,
        alpha=cfg.alpha,
        dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        dora=cfg.method == "dora",
        modules_to_save=cfg.modules_to_save,
    )
    with peft_quietly():
        model = get_peft_model(model, lora)
    if lora.target_parameters:
        parts = ", ".join(f"{part} {n:,}" for part, n in trained_by_part(model).items())
        log.info("trained parameters: %s", parts)
    return model


def lora_config(
    model: torch.nn.Module,
    *,
    rank: int,
    alpha: float,
    dropout: float,
    target_modules: str | list[str],
    dora: bool,
    modules_to_save: list[str] | None = None,
) -> Any:
    """peft's `LoraConfig` for `model`, as training adapts it and the memory estimator traces it: on a mixture of
    experts, all-linear reaches the routed experts' weights too and leaves the routers (`lora_expert_targets`)."""
    from peft import LoraConfig

    targets = {"target_modules": target_modules} | lora_expert_targets(
        model, target_modules, dropout=dropout > 0, dora=dora
    )
    return LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        use_dora=dora,
        modules_to_save=modules_to_save or None,
        task_type="CAUSAL_LM",
        **targets,
    )


def cast_trained(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every trained parameter (adapters, DoRA's magnitudes, modules_to_save) to `dtype`, in place and keeping each
    parameter's identity (ties, hooks): `peft.adapter_dtype` bf16, before the optimizer is built. The memory
    estimator calls it on its fake model too."""
    for p in model.parameters():
        if p.requires_grad and p.dtype != dtype:
            p.data = p.data.to(dtype)


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; `parameters()` yields tied weights once."""
    params = list(model.parameters())
    return sum(numel(p) for p in params if p.requires_grad), sum(numel(p) for p in params)


def numel(p: torch.Tensor) -> int:
    """Elements of a parameter, also under DeepSpeed ZeRO-3 (which leaves an empty tensor in the module)."""
    return getattr(p, "ds_numel", p.numel())
