"""The decoder blocks and what wraps each: activation checkpointing (every k layers, selective, offloaded) through
transformers' own API, and regional `torch.compile`. llmtune.run.parallelize applies them, in that order."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel

from llmtune.errors import SetupError
from llmtune.recipe import Checkpointing

log = logging.getLogger(__name__)


def compile_blocks(model: torch.nn.Module) -> int:
    """torch.compile each repeated decoder block in place ("regional" compilation); returns how many.

    The blocks are the classes transformers never splits across devices (`_no_split_modules`, e.g.
    LlamaDecoderLayer). All blocks share one compiled graph, so compile time is that of one block, not of
    the whole model; `Module.compile` keeps module names and state-dict keys unchanged (checkpoints and
    adapters load either way), and checkpointing wraps the compiled block as it wraps an eager one. The
    loss (data-dependent chunking) and the embeddings stay eager. It pays on blocks with enough elementwise
    work, after a one-off compile (benchmarks/compile.py; figures in benchmarks/results/measurements.md).
    """
    blocks = decoder_blocks(model, purpose="training.compile", remedy="set training.compile: false")
    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):  # newer torch
        # transformers >= 5.25 wraps attention in `kernels`' use_kernelized_func, which sets a module-level variable
        # in forward and resets it before returning. Inside a checkpointed block Dynamo refuses that side effect
        # (it would not be replayed on recomputation) and runs the whole block eagerly: compile did nothing. Set and
        # reset within one forward, it has nothing to replay. Global, as Dynamo reads it when it traces, in the loop.
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for block in blocks:
        block.compile()
    log.info("compiled %d %s blocks (torch.compile, one shared graph)", len(blocks), type(blocks[0]).__name__)
    return len(blocks)


def decoder_blocks(
    model: torch.nn.Module, purpose: str = "FSDP2", remedy: str = "use another launcher config"
) -> list[torch.nn.Module]:
    """The repeated decoder blocks: the classes transformers never splits across devices (`_no_split_modules`,
    e.g. LlamaDecoderLayer), also inside a peft model or a wrapper around one."""
    found = [m for m in model.modules() if getattr(m, "_no_split_modules", None)]
    names = set(found[0]._no_split_modules) if found else set()
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        name = type(found[0]).__name__ if found else type(model).__name__
        raise SetupError(f"{purpose}: found no decoder blocks in {name} (no _no_split_modules); {remedy}")
    return blocks


# Selective checkpointing keeps what is expensive to recompute -- matmuls and attention -- and recomputes the
# element-wise ops (norms, activations, rotary, residual adds), which cost memory but little time.
_KEPT_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,  # GPT-NeoX's eager attention
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def _selective_policy(_ctx: Any, op: Any, *_args: Any, **_kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _context_fn(selective: bool, recompute: Callable[[], Any] | None) -> Callable | None:
    """torch.utils.checkpoint's `context_fn` (forward context, recompute context): selective checkpointing's
    policy, and/or `recompute` entered around every recomputation (the memory estimator's CUDA kernels)."""
    if not selective and recompute is None:
        return None

    def contexts() -> tuple[Any, Any]:
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        forward, again = create_selective_checkpoint_contexts(_selective_policy) if selective else (None, None)
        return forward or contextlib.nullcontext(), _Both(again, recompute()) if recompute else again

    return contexts


class _Both:
    """Enter two context managers (either may be None) as one."""

    def __init__(self, *contexts: Any) -> None:
        self.contexts = [c for c in contexts if c is not None]
        self.stack = contextlib.ExitStack()

    def __enter__(self) -> None:
        for c in self.contexts:
            self.stack.enter_context(c)

    def __exit__(self, *exc: object) -> None:
        self.stack.__exit__(*exc)


def apply_checkpointing(
    model: PreTrainedModel, spec: Checkpointing, recompute: Callable[[], Any] | None = None
) -> None:
    """Non-reentrant checkpointing of decoder layers 0, k, 2k, ... (`spec.every_n_layers`) through transformers'
    API (renamed after 5.17; both names work), selective or offloaded as `spec` says. `recompute` makes a
    context entered around each recomputation. Layers not chosen keep their activations, as without it."""
    if not spec.enabled:
        return
    context_fn = _context_fn(spec.selective, recompute)
    kwargs: dict = {"use_reentrant": False} | ({"context_fn": context_fn} if context_fn else {})
    extra = {"offload": True} if spec.offload else {}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, **extra)
    else:  # its name up to transformers 5.2x (5.17, our floor): the same arguments
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs, **extra)
    if spec.every_n_layers > 1:
        # Set here on the layers themselves: transformers' own every_n_layers is not in every version we support.
        flagged = [
            m for m in decoder_blocks(model, "checkpointing every_n_layers") if hasattr(m, "gradient_checkpointing")
        ]
        for i, layer in enumerate(flagged):
            layer.gradient_checkpointing = i % spec.every_n_layers == 0
