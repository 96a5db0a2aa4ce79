"""Memory models of kernels the estimator cannot run here, written from their sources.

The estimator traces a real training step on fake tensors, so whatever PyTorch and transformers run on
this machine is counted as it really happens. Three things users plan for do not run here: bitsandbytes'
4-bit base weights (QLoRA) and 8-bit AdamW need CUDA, and flash-attention-2 needs its CUDA package. Each
is replaced, inside the trace only, by a stand-in that allocates and keeps exactly what the real kernel
allocates and keeps (values are never computed: the tensors are fake). Each stand-in names the source it
follows; if that source changes, so must the stand-in.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# bitsandbytes 0.4x/0.5x `quantize_4bit` (NF4, as llmtune.model.load_model asks for it): blocks of 64
# weights share one absmax; with double quantisation those absmaxes are themselves quantised to uint8 in
# blocks of 256, each block with an fp32 absmax, plus a 256-entry fp32 code table.
NF4_BLOCK = 64
NESTED_BLOCK = 256
# bitsandbytes' 8-bit optimizers keep 32-bit states for tensors under `min_8bit_size` elements.
MIN_8BIT_SIZE = 4096
BNB_8BIT_BLOCK = 256  # blockwise dynamic quantisation: one fp32 absmax per 256 state values


class _Dequantize4bitLinear(torch.autograd.Function):
    """bitsandbytes `MatMul4Bit` (autograd/_functions.py): forward dequantises the whole weight to the
    compute dtype, multiplies, and frees it; backward dequantises it again for the input gradient. It
    saves the quantised weight only (no activation: the base weight is frozen)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
        ctx.shape = (out_features, x.shape[-1])
        ctx.save_for_backward(packed)
        weight = torch.empty(ctx.shape, dtype=x.dtype, device=x.device)  # dequantize_4bit's output
        return torch.nn.functional.linear(x, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        weight = torch.empty(ctx.shape, dtype=grad.dtype, device=grad.device)
        return grad @ weight, None, None


class Linear4bitModel(torch.nn.Module):
    """What a bitsandbytes `Linear4bit` (NF4, double quantisation) holds and does, as far as memory goes."""

    def __init__(self, linear: torch.nn.Linear, compute_dtype: torch.dtype) -> None:
        super().__init__()
        n = linear.weight.numel()
        self.logical_numel = n
        self.out_features, self.in_features = linear.weight.shape
        self.compute_dtype = compute_dtype
        blocks = math.ceil(n / NF4_BLOCK)
        # Params4bit: two 4-bit values per byte; its quant_state: uint8 absmax per block, fp32 absmax per
        # nested block, the fp32 code table.
        self.weight = torch.nn.Parameter(torch.empty((n + 1) // 2, 1, dtype=torch.uint8), requires_grad=False)
        self.register_buffer("absmax", torch.empty(blocks, dtype=torch.uint8))
        self.register_buffer("nested_absmax", torch.empty(math.ceil(blocks / NESTED_BLOCK), dtype=torch.float32))
        self.register_buffer("code", torch.empty(256, dtype=torch.float32))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Linear4bit.forward casts the input to the compute dtype (a copy when it differs) and the
        # output back to the input's dtype.
        inp_dtype = x.dtype
        out = _Dequantize4bitLinear.apply(x.to(self.compute_dtype), self.weight, self.out_features)
        if self.bias is not None:
            out = out + self.bias.to(self.compute_dtype)
        return out.to(inp_dtype)


def quantize_base_4bit(model: torch.nn.Module, compute_dtype: torch.dtype) -> int:
    """Replace every frozen nn.Linear except the output head with its 4-bit stand-in (transformers'
    bitsandbytes quantizer skips the head, `get_keys_to_not_convert`); under peft, the LoRA layers'
    `base_layer`. Returns how many were replaced."""
    head = model.get_output_embeddings()
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and child is not head and not child.weight.requires_grad:
                setattr(parent, name, Linear4bitModel(child, compute_dtype))
                count += 1
    return count


def parameter_count(model: torch.nn.Module) -> int:
    """Parameters as the unquantised model has them (a 4-bit weight packs two per stored byte)."""
    quantized = [m for m in model.modules() if isinstance(m, Linear4bitModel)]
    return sum(p.numel() for p in model.parameters()) + sum(m.logical_numel - m.weight.numel() for m in quantized)


class AdamW8bitModel(torch.optim.Optimizer):
    """bitsandbytes `AdamW8bit` (optim/optimizer.py, Optimizer2State): tensors of at least 4096 elements
    keep both states as uint8 plus an fp32 absmax per 256 values, smaller ones keep fp32 states; the
    update is one fused kernel per tensor that allocates nothing (`optimizer_update_8bit_blockwise`)."""

    def __init__(self, params: Any, lr: float = 1e-3) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    eight_bit = p.numel() >= MIN_8BIT_SIZE
                    dtype = torch.uint8 if eight_bit else torch.float32
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["state1"] = torch.zeros_like(p, dtype=dtype)
                    state["state2"] = torch.zeros_like(p, dtype=dtype)
                    if eight_bit:
                        blocks = math.ceil(p.numel() / BNB_8BIT_BLOCK)
                        state["absmax1"] = torch.zeros(blocks, dtype=torch.float32)
                        state["absmax2"] = torch.zeros(blocks, dtype=torch.float32)
                state["step"] += 1
                p.add_(p.grad, alpha=-group["lr"])  # stands for the fused in-place update


__all__ = ["AdamW8bitModel", "Linear4bitModel", "parameter_count", "quantize_base_4bit"]
