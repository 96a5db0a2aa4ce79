"""The optimizer: AdamW, fused where it can be, and a bf16 AdamW that keeps small updates.

With bf16 weights (`training.precision: bf16-true` without adapters) a plain AdamW rounds each updated
weight to the nearest bf16, which has 8 significant bits: an update smaller than half a bf16 step of
the weight (|update| < ~0.2% of |w|, the usual case at fine-tuning learning rates) is rounded away:
most weights stop moving (benchmarks/results/measurements.md). `BF16AdamW` computes the update in fp32
and writes weights and moments back with stochastic rounding: rounded up with probability equal to the
remainder, so every update survives in expectation and nothing is lost on average. It keeps the states in
bf16 (the memory of bf16-true stays 8 bytes per parameter before activations) and needs no extra package
(torchao's equivalent is private API and compiles each step).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from llmtune.recipe import Recipe

# Elements updated at a time: the fp32 temporaries of one chunk (~6 x 16 MiB) instead of a whole
# embedding matrix's (~6 GiB for Llama-3's 128k x 2048).
CHUNK = 2**22


def stochastic_round_(target: torch.Tensor, value: torch.Tensor) -> None:
    """Write fp32 `value` into bf16 `target`, rounding up or down with probability proportional to the
    distance (unbiased): the low 16 bits of the fp32 pattern are the remainder below bf16 precision."""
    bits = value.view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, device=bits.device, dtype=torch.int32)
    # Adding the noise carries into the kept bits with probability remainder / 2^16; truncating then
    # rounds toward zero (for negative numbers the bit pattern is sign-magnitude, so this is symmetric).
    rounded = (bits + noise) & -65536  # 0xFFFF0000 as a signed int32
    target.copy_(rounded.view(torch.float32))  # exact: the low 16 bits are zero


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard (FSDP2): the update is elementwise, so each process updates its own shard."""
    return t.to_local() if hasattr(t, "to_local") else t


class BF16AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) computed in fp32, with bf16 weights and moments stochastically
    rounded; fp32 parameters (adapters, norms kept in fp32) are updated exactly as `torch.optim.AdamW`."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = state["step"]
                step_size = group["lr"] / (1 - beta1**t)
                root_correction = (1 - beta2**t) ** 0.5
                decay = 1 - group["lr"] * group["weight_decay"]
                flat = [_local(x).view(-1) for x in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
                for w, g, m, v in zip(*(x.split(CHUNK) for x in flat), strict=True):
                    g32 = g.float()
                    m32 = m.float().lerp_(g32, 1 - beta1)
                    v32 = v.float().mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
                    w32 = w.float().mul_(decay)
                    w32.addcdiv_(m32, v32.sqrt().div_(root_correction).add_(group["eps"]), value=-step_size)
                    for target, value in ((w, w32), (m, m32), (v, v32)):
                        if target.dtype == torch.bfloat16:
                            stochastic_round_(target, value)
                        else:
                            target.copy_(value)
        return loss


def make_optimizer(model: torch.nn.Module, recipe: Recipe, device: torch.device) -> torch.optim.Optimizer:
    t = recipe.training
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            # Biases and norm gains (1-D) are not decayed: decay would pull them toward 0, not toward small.
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    betas = tuple(t.adam_betas)
    if t.optimizer == "adamw_8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(groups, lr=t.learning_rate, betas=betas)
    if any(p.dtype == torch.bfloat16 for p in decay + no_decay):
        return BF16AdamW(groups, lr=t.learning_rate, betas=betas)  # see the module docstring
    # Fused AdamW does the whole update in one kernel with no state-sized temporaries; on a CPU torch's
    # default loops tensor by tensor, ~10x slower (benchmarks/results/measurements.md).
    fused = device.type in ("cuda", "cpu") and all(p.dtype.is_floating_point for p in decay + no_decay)
    return torch.optim.AdamW(groups, lr=t.learning_rate, betas=betas, fused=fused or None)
