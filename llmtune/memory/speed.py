"""The time model: how long a training step takes, from what the memory estimate's trace computes.

The estimator runs the whole step on fake tensors (`estimate.py`), recomputation under checkpointing
included, and counts its work (`Work`): the FLOPs of its matmuls and attention (torch's own formulas,
`torch.utils.flop_counter`), the bytes every other op reads and writes (element-wise ops, norms, the
optimizer: bound by memory bandwidth), and the number of ops (each costs a fixed dispatch overhead, which
dominates small models on CPUs). A step takes

    flops / matmul rate + bytes / bandwidth + ops x overhead

with the three rates of the device (`Rates`): measured here in a fraction of a second on random tensors
(`measure_rates`: no training step, no weights), or, for a GPU this machine does not have
(`llmtune estimate --gpu NAME`), from its datasheet (`datasheet_rates`). The training loop then times its own
first steps and reports prediction against measurement (`train.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

# Fractions of the datasheet a training step reaches on a GPU: large bf16 matmuls run at 60-75% of the dense
# peak, streaming element-wise kernels at ~80% of HBM bandwidth; a kernel launch from eager PyTorch costs
# ~10 us of host time, hidden behind the GPU while kernels are long.
GPU_MATMUL_EFFICIENCY = 0.6
GPU_BANDWIDTH_EFFICIENCY = 0.8
GPU_OP_OVERHEAD_S = 10e-6


@dataclass
class Work:
    """What a step computes: matmul FLOPs, bytes read and written by the other ops, and ops dispatched."""

    flops: float = 0.0
    bytes: float = 0.0
    ops: float = 0.0

    def add(self, func: Any, args: tuple, kwargs: dict, out: Any, dispatches: float = 1.0) -> None:
        """Count one op; `dispatches` > 1 where it also passes through a Python dispatch mode."""
        from torch.utils.flop_counter import flop_registry

        self.ops += dispatches
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            self.flops += count(*args, **kwargs, out_val=out)
        elif not func.is_view:
            tensors = tree_flatten((args, kwargs, out))[0]
            self.bytes += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

    def __add__(self, other: Work) -> Work:
        return Work(self.flops + other.flops, self.bytes + other.bytes, self.ops + other.ops)

    def __sub__(self, other: Work) -> Work:
        return Work(self.flops - other.flops, self.bytes - other.bytes, self.ops - other.ops)

    def __mul__(self, factor: float) -> Work:
        return Work(self.flops * factor, self.bytes * factor, self.ops * factor)


@dataclass(frozen=True)
class Rates:
    """A device's speed as the time model sees it."""

    flops_per_s: float
    bytes_per_s: float
    seconds_per_op: float
    source: str  # how they were found, shown with the plan

    def seconds(self, work: Work) -> float:
        return work.flops / self.flops_per_s + work.bytes / self.bytes_per_s + work.ops * self.seconds_per_op


def _best_of(fn: Any, repeats: int, sync: Any) -> float:
    fn()  # warm-up: first-call allocations, kernel selection
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


CPU_PROBE_FLOPS = 4 * 10**9  # the largest matmul `measure_rates` times on a CPU


def matmul_probe_shape(config: Any, device_type: str) -> tuple[int, int, int]:
    """(rows, hidden, wide) of the matmul `measure_rates` times: `config`'s MLP shape at 2048 rows, long enough to
    time reliably on a shared machine (tens of ms); on a CPU at most `CPU_PROBE_FLOPS`."""
    text = config.get_text_config()
    hidden = int(text.hidden_size)
    wide = int(getattr(text, "intermediate_size", None) or 4 * hidden)
    rows = 2048
    if device_type == "cpu" and 2 * rows * hidden * wide > CPU_PROBE_FLOPS:
        # A 70B layer's MLP matmul is ~1 TFLOP at 2048 rows: tens of seconds a repeat on a CPU. Fewer rows, then a
        # narrower weight, keep the shape's kind (wide enough for full vector tiles) at about 40 ms.
        rows = max(256, CPU_PROBE_FLOPS // (2 * hidden * wide))
        wide = min(wide, max(256, CPU_PROBE_FLOPS // (2 * rows * hidden)))
    return rows, hidden, wide


def measure_rates(device: str | torch.device, dtype: torch.dtype, config: Any) -> Rates:
    """The three rates of `device` for `config`'s architecture, measured in about a second; no weights change.

    matmul: (2048 x hidden) @ (hidden x intermediate) in `dtype`, the shape of the decoder's MLP (smaller on a CPU,
    `matmul_probe_shape`);
    bandwidth: an in-place add over 32 MiB tensors; overhead: a training step (forward and backward) of the same
    architecture shrunk to one narrow layer and 16 tokens, whose time is all per-op overhead (the modules' Python
    and the dispatcher, the same per op at any width), divided by the ops it dispatches."""
    device = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    rows, hidden, wide = matmul_probe_shape(config, device.type)
    a = torch.randn(rows, hidden, device=device, dtype=dtype)
    w = torch.randn(hidden, wide, device=device, dtype=dtype)
    matmul = _best_of(lambda: a @ w, 10, sync)
    x = torch.zeros(8 * 1024**2, device=device)  # 32 MiB: past a CPU's last-level cache, as a step's activations
    y = torch.ones_like(x)
    add = _best_of(lambda: x.add_(y), 10, sync)
    step, ops = _narrow_step(config, device)
    return Rates(
        flops_per_s=2 * rows * hidden * wide / matmul,
        bytes_per_s=3 * x.numel() * x.element_size() / add,
        seconds_per_op=_best_of(step, 5, sync) / ops,
        source=f"measured on this {device.type}",
    )


def _narrow_step(config: Any, device: torch.device) -> tuple[Any, int]:
    """A forward and backward of `narrow_model`, and the ops it dispatches."""
    model = narrow_model(config, device)
    ids = torch.randint(0, 128, (1, 16), device=device)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    return step, dispatched_ops(step)


def narrow_model(config: Any, device: str | torch.device) -> torch.nn.Module:
    """`config`'s architecture with one narrow layer (16-dim heads, vocabulary 128), in fp32, in training mode."""
    import copy

    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(config.get_text_config())
    heads = int(getattr(cfg, "num_attention_heads", 4) or 4)
    kv = int(getattr(cfg, "num_key_value_heads", heads) or heads)
    narrow = {"num_hidden_layers": 1, "hidden_size": 16 * heads, "intermediate_size": 32 * heads, "vocab_size": 128}
    narrow |= {"head_dim": 16, "num_key_value_heads": kv, "layer_types": (getattr(cfg, "layer_types", None) or [])[:1]}
    for key, value in narrow.items():
        if getattr(cfg, key, None):  # only what this architecture has
            setattr(cfg, key, value)
    cfg.use_cache = False
    with torch.device(device):
        # fp32: a hub config may say bf16, which a CPU without native bf16 emulates (~30x slower per op).
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return model.train()


def dispatched_ops(fn: Callable[[], Any]) -> int:
    """How many ops `fn()` dispatches (the count the time model's per-op overhead is charged on)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.ops


def datasheet_rates(name: str, precision: str) -> Rates | None:
    """Rates of a GPU known by name, from its datasheet (dense 16-bit peak, HBM bandwidth), or None."""
    from llmtune.catalogue import datasheet_bandwidth, datasheet_peak_flops

    key = name.lower().replace("-", " ")
    peak, bandwidth = datasheet_peak_flops(key), datasheet_bandwidth(key)
    if peak is None or bandwidth is None:
        return None
    if precision == "fp32":
        peak /= 2  # TF32 tensor cores: half the 16-bit rate
    return Rates(
        flops_per_s=peak * GPU_MATMUL_EFFICIENCY,
        bytes_per_s=bandwidth * GPU_BANDWIDTH_EFFICIENCY,
        seconds_per_op=GPU_OP_OVERHEAD_S,
        source=f"{name} datasheet: {GPU_MATMUL_EFFICIENCY:.0%} of peak FLOP/s,"
        f" {GPU_BANDWIDTH_EFFICIENCY:.0%} of bandwidth",
    )
