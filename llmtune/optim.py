"""The optimizer: AdamW, fused where it can be, and a bf16 AdamW that keeps small updates.

With bf16 weights (`training.precision: bf16-true` without adapters) a plain AdamW rounds each updated
weight to the nearest bf16, which has 8 significant bits: an update smaller than half a bf16 step of
the weight (|update| < ~0.2% of |w|, the usual case at fine-tuning learning rates) is rounded away:
most weights stop moving (benchmarks/results/measurements.md). `BF16AdamW` computes the update in fp32
and writes weights and moments back with stochastic rounding: rounded up with probability equal to the
remainder, so every update survives in expectation and nothing is lost on average. It keeps the states in
bf16 (the memory of bf16-true stays 8 bytes per parameter before activations) and needs no extra package
(torchao's equivalent is private API and compiles each step).

The rounding noise comes from the optimizer's own generator, reseeded for every chunk from (seed, parameter,
step, chunk), never from the global RNG: DDP replicas draw the global RNG differently (dropout on differently
padded batches, a rank-0-only eval), and noise taken from it would make replicas with identical gradients round
differently and drift apart with nothing to bring them back. Derived from the step, the noise also needs no
state of its own in a checkpoint: a resumed run draws what the uninterrupted run would have drawn.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Any

import torch

from llmtune.recipe import Recipe

# Elements updated at a time: the fp32 temporaries of one chunk (~6 x 16 MiB) instead of a whole
# embedding matrix's (~6 GiB for Llama-3's 128k x 2048).
CHUNK = 2**22


def stochastic_round_(target: torch.Tensor, value: torch.Tensor, generator: torch.Generator | None = None) -> None:
    """Write fp32 `value` into bf16 `target`, rounding up or down with probability proportional to the
    distance (unbiased): the low 16 bits of the fp32 pattern are the remainder below bf16 precision.
    `generator` (on `value`'s device) supplies the noise; None draws from the global RNG."""
    bits = value.view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, device=bits.device, dtype=torch.int32, generator=generator)
    # Adding the noise carries into the kept bits with probability remainder / 2^16; truncating then
    # rounds toward zero (for negative numbers the bit pattern is sign-magnitude, so this is symmetric).
    rounded = (bits + noise) & -65536  # 0xFFFF0000 as a signed int32
    target.copy_(rounded.view(torch.float32))  # exact: the low 16 bits are zero


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard (FSDP2): the update is elementwise, so each process updates its own shard."""
    return t.to_local() if hasattr(t, "to_local") else t


def noise_seed(seed: int, param_index: int, step: int, chunk: int, shard: tuple[int, ...] = ()) -> int:
    """The rounding-noise seed of one chunk of one parameter at one step: the same on every process that holds
    the same elements (DDP replicas), different wherever the elements differ (parameters, chunks, FSDP2 shards)
    and from step to step (noise repeated across steps would bias the rounding of slowly moving weights)."""
    key = repr((seed, param_index, step, chunk, shard)).encode()
    # blake2b rather than hash(): Python salts str hashes per process, and the seeds must agree across processes.
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1  # < 2^63: manual_seed's range


def _shard_index(t: torch.Tensor) -> tuple[int, ...]:
    """Which shard of a DTensor this process holds: its coordinates along the mesh dimensions the tensor is
    sharded on. Replicated dimensions (HSDP's replicas) are left out: replicas hold the same elements and must
    draw the same noise. () for a plain tensor (DDP: every process holds all of it)."""
    placements = getattr(t, "placements", None)
    if placements is None:
        return ()
    coordinate = t.device_mesh.get_coordinate() or []
    return tuple(c for c, placement in zip(coordinate, placements, strict=False) if placement.is_shard())


class BF16AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) computed in fp32, with bf16 weights and moments stochastically
    rounded; fp32 parameters (adapters, norms kept in fp32) are updated exactly as `torch.optim.AdamW`.

    `seed` (the same on every process) seeds the rounding noise (see the module docstring); it is a
    hyperparameter of each group, so it travels in `state_dict()` with the per-parameter `step` it is mixed with.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        seed: int = 0,
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "seed": seed}
        super().__init__(params, defaults)
        self._generators: dict[torch.device, torch.Generator] = {}  # reseeded per chunk: they carry no state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # load_state_dict replaces the groups with the saved ones: a checkpoint written before groups carried a
        # seed falls back to this optimizer's.
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("seed", self.defaults["seed"])
        self.__dict__.setdefault("_generators", {})

    def _generator(self, device: torch.device, seed: int) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device].manual_seed(seed)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Parameters are numbered across groups as state_dict() numbers them: the same on every process.
        index = -1
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                index += 1
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
                shard = _shard_index(p)
                for chunk, (w, g, m, v) in enumerate(zip(*(x.split(CHUNK) for x in flat), strict=True)):
                    g32 = g.float()
                    m32 = m.float().lerp_(g32, 1 - beta1)
                    v32 = v.float().mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
                    w32 = w.float().mul_(decay)
                    w32.addcdiv_(m32, v32.sqrt().div_(root_correction).add_(group["eps"]), value=-step_size)
                    generator = None
                    for target, value in ((w, w32), (m, m32), (v, v32)):
                        if target.dtype != torch.bfloat16:
                            target.copy_(value)
                            continue
                        if generator is None:  # fp32 parameters draw nothing: no seeding for them
                            seed = noise_seed(group["seed"], index, t, chunk, shard)
                            generator = self._generator(w.device, seed)
                        stochastic_round_(target, value, generator)
        return loss


def optimizer_choice(optimizer: str, precision: str, peft_method: str, adapter_dtype: str = "fp32") -> str:
    """What `make_optimizer` builds for `training.optimizer` at this precision, by `build_optimizer`'s names (the
    memory estimator's): AdamW on bf16 weights (bf16-true without adapters, or with `peft.adapter_dtype` bf16) is
    BF16AdamW, "adamw_bf16"; on any other weights the fused AdamW, "adamw_fused"; adamw_8bit as asked."""
    if optimizer != "adamw":
        return optimizer
    bf16_trained = peft_method == "none" or adapter_dtype == "bf16"
    return "adamw_bf16" if precision == "bf16-true" and bf16_trained else "adamw_fused"


def make_optimizer(model: torch.nn.Module, recipe: Recipe, device: torch.device) -> torch.optim.Optimizer:
    t = recipe.training
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            # Biases and norm gains (1-D) are not decayed: decay would pull them toward 0, not toward small.
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    name = optimizer_name(t.optimizer, decay + no_decay, device.type)
    # The recipe's seed is the same on every process, as BF16AdamW's rounding noise must be (module docstring).
    return build_optimizer(name, groups, device.type, lr=t.learning_rate, betas=tuple(t.adam_betas), seed=recipe.seed)


def optimizer_name(optimizer: str, trained: list[torch.nn.Parameter], device_type: str) -> str:
    """What `make_optimizer` builds for `training.optimizer` on these trained parameters, by `build_optimizer`'s names:
    adamw_8bit as asked; AdamW on bf16 weights, BF16AdamW; else the fused AdamW where torch has the kernel."""
    if optimizer == "adamw_8bit":
        return optimizer
    if any(p.dtype == torch.bfloat16 for p in trained):
        return "adamw_bf16"
    # Fused AdamW does the whole update in one kernel with no state-sized temporaries; on a CPU torch's
    # default loops tensor by tensor, ~10x slower (benchmarks/results/measurements.md).
    fused = device_type in ("cuda", "cpu") and all(p.dtype.is_floating_point for p in trained)
    return "adamw_fused" if fused else "adamw"


def build_optimizer(
    name: str,
    params: Iterable[Any],
    device_type: str,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    seed: int = 0,
    adamw_8bit: Callable[..., torch.optim.Optimizer] | None = None,
) -> torch.optim.Optimizer:
    """The optimizer `name` over `params` (parameters or groups) for a `device_type` device: training's
    (`make_optimizer`) and the memory estimator's, which names it by `optimizer_choice`.

    adamw_8bit: bitsandbytes' AdamW8bit, or what `adamw_8bit` gives in its place (the estimator's model of its
    states, llmtune.memory.kernels); adamw_bf16: `BF16AdamW`; adamw_fused: torch's fused AdamW; adamw: torch's
    default for the device, foreach on CUDA (said here: the estimator's fake tensors sit on the CPU), else left to
    torch (the per-tensor loop on a CPU)."""
    if name == "adamw_8bit":
        if adamw_8bit is None:
            import bitsandbytes as bnb

            adamw_8bit = bnb.optim.AdamW8bit
        return adamw_8bit(params, lr=lr, betas=betas)
    if name == "adamw_bf16":
        return BF16AdamW(params, lr=lr, betas=betas, seed=seed)
    if name == "adamw_fused":
        return torch.optim.AdamW(params, lr=lr, betas=betas, fused=True)
    return torch.optim.AdamW(params, lr=lr, betas=betas, foreach=device_type == "cuda" or None)
