"""The optimizer: AdamW, fused where it can be, and a bf16 AdamW that keeps small updates.

With bf16 weights (`training.precision: bf16-true` without adapters) a plain AdamW rounds each updated
weight to the nearest bf16, which has 8 significant bits: an update smaller than half a bf16 step of
the weight (|update| < ~0.2% of |w|, the usual case at fine-tuning learning rates) is rounded away:
most weights stop moving (benchmarks/results/measurements.md). `BF16AdamW` computes the update in fp32
and writes weights and moments back with stochastic rounding: rounded up with probability equal to the
remainder, so every update survives in expectation and nothing is lost on average. It keeps the states in
bf16 (the memory of bf16-true stays 8 bytes per parameter before activations) and needs no extra package
(torchao's equivalent is private API and compiles each step).

The whole update of a parameter (moments, weight, the three roundings and their noise) is one function of
tensors, `adamw_bf16_`, which torch.compile fuses into one kernel that reads each bf16 tensor once and keeps
the fp32 values in registers (Triton on CUDA, C++ on a CPU with a compiler, its bitcasts kept in registers by
llmtune.ops.inductor_bitcast): one launch per parameter instead of ~15 kernels and 3 random passes per 4M-element
chunk. On a CPU that step takes 1.2x torch's fused AdamW on Llama-3.2-1B's shapes at half width (1.9x at an eighth,
where a fixed ~40-60 us per parameter weighs more), the eager one 25-35x (benchmarks/optimizer.py). Where compiling is
off or fails (no C++ compiler, an active dispatch mode such as the memory tracker's or the estimator's fake tensors)
the same function runs eagerly, chunk by chunk, so its fp32 temporaries stay ~6 x 16 MiB.

The rounding noise is counter-based (llmtune.ops.noise.fast_bits): a function of each element's index under a key
from (seed, parameter, step, shard), never the global RNG. DDP replicas draw the global RNG differently (dropout on
differently padded batches, a rank-0-only eval), and noise taken from it would make replicas with identical
gradients round differently and drift apart with nothing to bring them back. Derived from the step, the noise
also needs no state of its own in a checkpoint: a resumed run draws what the uninterrupted run would have drawn.
And as a function of the element's index it is the same whether the kernel runs whole or in chunks, compiled or
eager. Under each step's fresh key an element's three draws are exactly uniform and independent of each other and
of every other step's, which is what unbiased rounding needs, and neighbouring elements' draws are uncorrelated.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from llmtune.ops.inductor_bitcast import vector_bitcasts
from llmtune.ops.noise import fast_bits
from llmtune.recipe import Recipe

log = logging.getLogger(__name__)

# Elements updated at a time by the eager step: the fp32 temporaries of one chunk (~6 x 16 MiB) instead of a whole
# embedding matrix's (~6 GiB for Llama-3's 128k x 2048). The compiled step keeps none and takes a parameter whole.
CHUNK = 2**22


def round_bits(value: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The bf16 stochastic rounding of fp32 `value` as an fp32 tensor (exactly a bf16 value): `noise` in [0, 2^16)
    added to the low 16 bits of the fp32 pattern carries into the kept bits with probability remainder / 2^16;
    truncating then rounds toward zero (for negative numbers the bit pattern is sign-magnitude, so this is
    symmetric)."""
    return ((value.view(torch.int32) + noise) & -65536).view(torch.float32)  # 0xFFFF0000 as a signed int32


def stochastic_round_(target: torch.Tensor, value: torch.Tensor, noise: torch.Tensor | None = None) -> None:
    """Write fp32 `value` into bf16 `target`, rounding up or down with probability proportional to the distance
    (unbiased). `noise`: int32 in [0, 2^16) shaped as `value`; None draws it from the global RNG."""
    if noise is None:
        noise = torch.randint(0, 1 << 16, value.shape, device=value.device, dtype=torch.int32)
    target.copy_(round_bits(value, noise))  # exact: the low 16 bits are zero


def adamw_bf16_(
    w: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    hyper: torch.Tensor,
    key: torch.Tensor,
    offset: int = 0,
) -> None:
    """One AdamW update in fp32 of flat `w` (weights), `m`, `v` (moments) from `g`, written back stochastically
    rounded where they are bf16, exactly where they are fp32. `hyper`: [step size, 1 / bias correction of sqrt(v),
    weight decay factor, eps, beta1, beta2] (fp32, on w's device: values, not constants, so a compiled kernel
    serves every step); `key`: 2 int32 noise keys; `offset`: the index of w[0] in its parameter (eager chunks).
    Multiply-adds and one division per element: on a CPU the step is bound by its arithmetic (lerp's two formulas
    and a second division cost ~10%)."""
    step_size, inverse_root_correction, decay, eps, beta1, beta2 = hyper.unbind()
    g32 = g.float()
    m32 = m.float() * beta1 + g32 * (1 - beta1)
    v32 = v.float() * beta2 + g32 * g32 * (1 - beta2)
    w32 = w.float() * decay - step_size * m32 / (v32.sqrt() * inverse_root_correction + eps)
    if w.dtype != torch.bfloat16:  # fp32 parameters (adapters): torch.optim.AdamW's update, no rounding
        w.copy_(w32), m.copy_(m32), v.copy_(v32)
        return
    index = torch.arange(offset, offset + w.numel(), device=w.device, dtype=torch.int32)
    w_noise, m_noise, v_noise = rounding_noise(index, key)
    w.copy_(round_bits(w32, w_noise))
    m.copy_(round_bits(m32, m_noise))
    v.copy_(round_bits(v32, v_noise))


def rounding_noise(index: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three 16-bit draws (int32 in [0, 2^16)) for each int32 element `index` under the 2 keys `key`: the weight's,
    the first moment's, the second's: from two words (llmtune.ops.noise.fast_bits) x and y, x's halves xored, x's high
    half, y's high half. A product's low bits depend only on its factors' low bits, so x's low half alone would tie
    elements 2^16 apart (its lowest bit always differs between them); xored with the high half it does not."""
    x, y = fast_bits(index, key[0]), fast_bits(index, key[1])
    return (x ^ (x >> 16)) & 0xFFFF, (x >> 16) & 0xFFFF, (y >> 16) & 0xFFFF


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard (FSDP2): the update is elementwise, so each process updates its own shard."""
    return t.to_local() if hasattr(t, "to_local") else t


def noise_key(seed: int, param_index: int, step: int, shard: tuple[int, ...] = ()) -> tuple[int, int]:
    """The rounding-noise key (2 int32) of one parameter at one step: the same on every process that holds the
    same elements (DDP replicas), different wherever the elements differ (parameters, FSDP2 shards) and from step
    to step (noise repeated across steps would bias the rounding of slowly moving weights)."""
    key = repr((seed, param_index, step, shard)).encode()
    # blake2b rather than hash(): Python salts str hashes per process, and the keys must agree across processes.
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return tuple(int.from_bytes(digest[i : i + 4], "little", signed=True) for i in (0, 4))  # type: ignore[return-value]


def _shard_index(t: torch.Tensor) -> tuple[int, ...]:
    """Which shard of a DTensor this process holds: its coordinates along the mesh dimensions the tensor is
    sharded on. Replicated dimensions (HSDP's replicas) are left out: replicas hold the same elements and must
    draw the same noise. () for a plain tensor (DDP: every process holds all of it)."""
    placements = getattr(t, "placements", None)
    if placements is None:
        return ()
    coordinate = t.device_mesh.get_coordinate() or []
    return tuple(c for c, placement in zip(coordinate, placements, strict=False) if placement.is_shard())


def _eager_step(w, g, m, v, hyper, key) -> None:  # noqa: ANN001 (adamw_bf16_'s arguments)
    for i in range(0, w.numel(), CHUNK):
        part = slice(i, i + CHUNK)
        adamw_bf16_(w[part], g[part], m[part], v[part], hyper, key, offset=i)


Update = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # adamw_bf16_'s


def _eager_steps(updates: list[Update]) -> None:
    for update in updates:
        _eager_step(*update)


class FusedStep:
    """`adamw_bf16_` compiled once for every parameter size (dynamic shapes), or run eagerly in chunks where it
    cannot compile. A failed compile is logged once and not retried."""

    def __init__(self) -> None:
        self.compiled: Callable[..., None] | None = None
        self.failed = False

    def __call__(self, updates: list[Update]) -> None:
        """Each (w, g, m, v, hyper, key) of `updates` (a step's parameters) stepped."""
        # Dynamo refuses to trace under a Python dispatch mode (the memory tracker, the estimator's fake tensors):
        # those see the eager step, whose chunked temporaries bound the compiled one's (none) from above.
        if self.failed or _get_current_dispatch_mode() is not None:
            return _eager_steps(updates)
        if self.compiled is None:
            # emulate_precision_casts: the fp32 -> bf16 casts stay casts inside the kernel, as in eager.
            # cpp.dynamic_threads: a CPU kernel's threads chosen per call; without it inductor decides from the first
            # parameter's size, and a 256-element norm weight compiled first left a 4M-element embedding on one core.
            options = {"emulate_precision_casts": True, "cpp.dynamic_threads": True}
            self.compiled = torch.compile(adamw_bf16_, dynamic=True, fullgraph=True, options=options)
        # Inductor compiles inside the first call: on a CPU the rounding's bitcasts then stay in registers. Entered
        # here only, as it imports inductor's C++ code generator (~2 s), which the eager step never needs.
        with vector_bitcasts():
            for i, update in enumerate(updates):
                try:
                    self.compiled(*update)
                except Exception as err:  # no C++ compiler, no Triton, an unsupported backend: the eager step is exact
                    why = f"{type(err).__name__}: {str(err)[:200]}"
                    log.warning("BF16AdamW: compiling the fused step failed (%s); stepping eagerly", why)
                    self.failed = True
                    return _eager_steps(updates[i:])


class BF16AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) computed in fp32, with bf16 weights and moments stochastically
    rounded; fp32 parameters (adapters, norms kept in fp32) are updated exactly as `torch.optim.AdamW`.

    `seed` (the same on every process) seeds the rounding noise (see the module docstring); it is a
    hyperparameter of each group, so it travels in `state_dict()` with the per-parameter `step` it is mixed with.
    `compile`: fuse each parameter's update into one kernel (False: the eager step, chunk by chunk).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        seed: int = 0,
        compile: bool = True,
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "seed": seed}
        super().__init__(params, defaults)
        self._fused = FusedStep() if compile else None

    def __setstate__(self, state: dict[str, Any]) -> None:
        # load_state_dict replaces the groups with the saved ones: a checkpoint written before groups carried a
        # seed falls back to this optimizer's.
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("seed", self.defaults["seed"])
        self.__dict__.setdefault("_fused", FusedStep())

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Parameters are numbered across groups as state_dict() numbers them: the same on every process.
        index = -1
        for group in self.param_groups:
            todo = []
            for p in group["params"]:
                index += 1
                if p.grad is not None:
                    todo.append((index, p))
            if todo:
                self._step_group(group, todo)
        return loss

    def _step_group(self, group: dict[str, Any], todo: list[tuple[int, torch.Tensor]]) -> None:
        """Every parameter of a group, its hyperparameters and noise keys sent to the device in one copy each."""
        beta1, beta2 = group["betas"]
        rows, keys = [], []
        for index, p in todo:
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            t = state["step"]
            rows.append(
                [group["lr"] / (1 - beta1**t), (1 - beta2**t) ** -0.5, 1 - group["lr"] * group["weight_decay"],
                 group["eps"], beta1, beta2]
            )  # fmt: skip
            keys.append(noise_key(group["seed"], index, t, _shard_index(p)))
        device = _local(todo[0][1]).device
        hyper = torch.tensor(rows, dtype=torch.float32).to(device, non_blocking=True)
        key = torch.tensor(keys, dtype=torch.int32).to(device, non_blocking=True)
        updates = []
        for (_, p), hyper_row, key_row in zip(todo, hyper, key, strict=True):
            state = self.state[p]
            w, g, m, v = (_local(x).view(-1) for x in (p, p.grad, state["exp_avg"], state["exp_avg_sq"]))
            updates.append((w, g, m, v, hyper_row, key_row))
        (self._fused or _eager_steps)(updates)


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


# On a CPU compiling BF16AdamW's step costs each process ~4 s (warm cache) to ~11 s (cold), and the compiled step
# saves 5-14 ns per parameter per step against the eager one (benchmarks/results/optimizer_cpu.json: 1.2-1.9x torch's
# fused AdamW against 14-35x). From 2^25 parameters (33M) that is 0.17 s or more a step: the compile is repaid within
# ~65 steps cold. Smaller models (the tests', the quickstart's) keep the eager step and start at once.
CPU_COMPILE_MIN_PARAMETERS = 2**25


def _parameter_count(params: list[Any]) -> int:
    """Elements in `params`: parameters, or groups of them (dicts with "params")."""
    tensors = [t for x in params for t in (x["params"] if isinstance(x, dict) else [x])]
    return sum(t.numel() for t in tensors)


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
    states, llmtune.plan.kernels); adamw_bf16: `BF16AdamW`; adamw_fused: torch's fused AdamW; adamw: torch's
    default for the device, foreach on CUDA (said here: the estimator's fake tensors sit on the CPU), else left to
    torch (the per-tensor loop on a CPU)."""
    if name == "adamw_8bit":
        if adamw_8bit is None:
            import bitsandbytes as bnb

            adamw_8bit = bnb.optim.AdamW8bit
        return adamw_8bit(params, lr=lr, betas=betas)
    if name == "adamw_bf16":
        params = list(params)
        compiled = device_type == "cuda" or _parameter_count(params) >= CPU_COMPILE_MIN_PARAMETERS
        return BF16AdamW(params, lr=lr, betas=betas, seed=seed, compile=compiled)
    if name == "adamw_fused":
        return torch.optim.AdamW(params, lr=lr, betas=betas, fused=True)
    return torch.optim.AdamW(params, lr=lr, betas=betas, foreach=device_type == "cuda" or None)
