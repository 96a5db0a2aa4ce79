"""Mixture-of-experts models: the kernel their routed experts run, their parts, and LoRA on their experts.

transformers 5 holds a MoE layer's routed experts as fused 3D parameters (`gate_up_proj` (E, 2I, H), `down_proj`
(E, H, I)) in a module decorated with `@use_experts_implementation` (integrations/moe.py), whose forward dispatches on
the config's `_experts_implementation`: `eager` loops over the experts the batch hits, `batched_mm` gathers each
routed token's expert weights and runs one batched matmul (a copy of the weights per token and expert), `grouped_mm`
sorts the routed tokens by expert and runs one grouped matmul. `from_pretrained` / `from_config` take
`experts_implementation=`; a run decides it once (`experts_choice`), loads with it and the estimator traces it.
Those weights are no `nn.Linear`: LoRA reaches them through peft's `target_parameters` (`lora_expert_targets`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from llmtune.errors import SetupError

log = logging.getLogger(__name__)

EXPERTS_IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")


def has_fused_experts(config: Any) -> bool:
    """Whether the causal LM of `config` runs its experts through transformers' experts interface, as transformers
    itself decides it (`PreTrainedModel._can_set_experts_implementation`: its modelling code uses the decorator)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return cls is not None and cls._can_set_experts_implementation()


def grouped_mm_runs(device: str, capability: tuple[int, int] | None) -> bool:
    """Whether torch runs its grouped matmul on `device` (transformers' `_can_use_grouped_mm`): a CPU from torch 2.9
    (llmtune's floor is 2.11), a CUDA card from sm80 (`capability` None: a data-center card); transformers loops
    over the experts elsewhere."""
    return device != "cuda" or capability is None or capability >= (8, 0)


def experts_choice(
    requested: str, *, device: str, precision: str, compiled: bool, capability: tuple[int, int] | None = None
) -> tuple[str, str]:
    """The experts' kernel for `model.experts_implementation=requested` and why, for a run on `device` in `precision`
    with its decoder blocks compiled or not. `auto` is transformers' default, `grouped_mm` (the fastest and the
    leanest of its kernels, integrations/moe.py), where torch runs it (`grouped_mm_runs`) and, under
    `training.compile`, on bf16 weights only (bf16-true): inductor lowers the grouped matmul in bf16 only, and on
    mixed precision's fp32 master weights transformers swaps in a per-expert loop of its own, opaque to the compiler.
    Elsewhere `eager`, the fallback transformers itself takes where grouped_mm cannot dispatch."""
    if requested != "auto":
        return requested, "model.experts_implementation"
    if not grouped_mm_runs(device, capability):
        return "eager", f"auto: torch has no grouped matmul for sm{capability[0]}{capability[1]}"
    if compiled and precision != "bf16-true":
        return "eager", "auto: training.compile lowers the grouped matmul on bf16 weights only"
    return "grouped_mm", f"auto: torch's grouped matmul on {device}"


def experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every routed-experts module of `model`: those `@use_experts_implementation` marks (it sets
    `has_gate` beside the class's `num_experts`)."""
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "has_gate") and hasattr(m, "num_experts")]


def moe_parts(model: torch.nn.Module) -> dict[str, str]:
    """The parts of `model`'s mixture-of-experts blocks by module name (peft's wrappers' `.base_layer` left out):
    `routed experts`; beside them in their block, `router` (a linear layer, or a module its class names a router or a
    gate: the top-k router, Qwen2-MoE's shared expert gate) and `shared experts` (any other module with weights)."""
    parts = {}
    for name, _ in experts_modules(model):
        block_name, _, experts_name = unwrapped(name).rpartition(".")
        parts[f"{block_name}.{experts_name}"] = "routed experts"
        for child_name, child in model.get_submodule(block_name).named_children():
            if child_name == experts_name or next(child.parameters(), None) is None:
                continue
            kind = type(child.get_base_layer() if hasattr(child, "get_base_layer") else child)
            router = issubclass(kind, torch.nn.Linear) or any(w in kind.__name__ for w in ("Router", "Gate"))
            parts[f"{block_name}.{child_name}"] = "router" if router else "shared experts"
    return parts


def unwrapped(name: str) -> str:
    """A module's name as the model without peft's wrappers has it."""
    return name.replace(".base_layer", "")


def lora_expert_targets(model: torch.nn.Module, target_modules: Any, *, dropout: bool, dora: bool) -> dict[str, Any]:
    """peft `LoraConfig` arguments in place of `target_modules="all-linear"` on a mixture of experts: every linear
    layer but the output head and the routers, by full name (`target_modules`: routing stays as trained), and the
    routed experts' 3D weights, which are no `nn.Linear` (`target_parameters`, peft's `lora.ParamWrapper`: a rank-r
    adapter per expert). Spelled out so that peft's own reading of all-linear on transformers 5's MoE layers, which
    varies by peft version and family (0.22, for transformers 4's adapters: the routers of Qwen3-MoE, Mixtral and
    DeepSeek-V3 too and their gate_up_proj at rank 2r; gpt-oss's attention alone), does not apply. Nothing for a
    dense model or a list of modules. peft adapts an expert weight without dropout and without DoRA: either is
    refused in one line."""
    experts = experts_modules(model)
    if target_modules != "all-linear" or not experts:
        return {}
    for key, refused in (("peft.dropout > 0", dropout), ("peft.method=dora", dora)):
        if refused:
            raise SetupError(
                f"{key}: peft adapts the routed experts' weights (all-linear on a mixture of experts) only as plain"
                " LoRA without dropout; set peft.dropout: 0 and peft.method: lora, or list peft.target_modules"
            )
    skipped = {name for name, part in moe_parts(model).items() if part == "router"}
    head = model.get_output_embeddings()
    linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head]
    weights = {
        f"{unwrapped(name).rpartition('.')[2]}.{p}"  # peft matches `experts.gate_up_proj` as a name's suffix
        for name, module in experts
        for p, w in module.named_parameters(recurse=False)
        if w.dim() == 3
    }
    return {"target_modules": [n for n in linear if n not in skipped], "target_parameters": sorted(weights)}


def trained_by_part(model: torch.nn.Module) -> dict[str, int]:
    """Trained parameters of a mixture of experts by part: attention, shared experts, routed experts, router,
    embeddings (input and output) and `other` (dense MLPs, norms), as the setup log says them."""
    parts = moe_parts(model)
    for name, module in model.named_modules():
        if "Attention" in type(module).__name__:
            parts.setdefault(unwrapped(name), "attention")
    for embedding in (model.get_input_embeddings(), model.get_output_embeddings()):
        parts.update({unwrapped(n): "embeddings" for n, m in model.named_modules() if m is embedding})
    counts = dict.fromkeys(("attention", "shared experts", "routed experts", "router", "embeddings", "other"), 0)
    for name, p in model.named_parameters():
        if p.requires_grad:
            owners = [k for k in parts if unwrapped(name).startswith(k + ".")]
            counts[parts[max(owners, key=len)] if owners else "other"] += p.numel()
    return counts


def experts_implementation_of(config: Any, implementation: str) -> str | None:
    """What to pass transformers as `experts_implementation` for `config`: None for a model without fused experts,
    which transformers refuses it for (`_grouped_mm_can_dispatch`)."""
    return implementation if has_fused_experts(config) else None


def run_experts_implementation(
    config: Any, requested: str, *, device: torch.device | None, precision: str, compiled: bool
) -> str | None:
    """The experts' kernel a run loads `config` with on `device` (None: the CPU), said in the setup log; None for a
    model without fused experts, where naming one is refused in one line."""
    if not has_fused_experts(config):
        if requested != "auto":
            raise SetupError(
                f"model.experts_implementation={requested}: {type(config).__name__} has no fused experts"
                " (transformers' experts interface); leave it auto"
            )
        return None
    kind = device.type if device is not None else "cpu"
    capability = tuple(torch.cuda.get_device_capability(device)) if kind == "cuda" else None
    name, why = experts_choice(requested, device=kind, precision=precision, compiled=compiled, capability=capability)
    log.info("experts: %s (%s)", name, why)
    return name


__all__ = [
    "EXPERTS_IMPLEMENTATIONS",
    "experts_choice",
    "experts_implementation_of",
    "experts_modules",
    "grouped_mm_runs",
    "has_fused_experts",
    "lora_expert_targets",
    "moe_parts",
    "run_experts_implementation",
    "trained_by_part",
]
