"""The time model: how long a training step takes, from what the memory estimate's trace computes.

The estimator runs the whole step on fake tensors (`llmtune.plan`), recomputation under checkpointing
included, and counts its work (`Work`): the FLOPs of its matmuls and attention (torch's own formulas,
`torch.utils.flop_counter`), the bytes every other op reads and writes (element-wise ops, norms, the
optimizer: bound by memory bandwidth), and the number of ops (each costs a fixed dispatch overhead, which
dominates small models on CPUs). A step takes

    flops / FLOP rate + bytes / bandwidth + ops x overhead

with the three rates of the device (`Rates`): measured here in a fraction of a second on random tensors and
throwaway one-layer models (`measure_rates`: none of the run's weights), or, for a GPU this machine does not have
(`llmtune estimate --gpu NAME`), from its datasheet (`datasheet_rates`). The training loop then times its own
first steps and reports prediction against measurement (`train.py`).
"""

from __future__ import annotations

import functools
import itertools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass, replace
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from llmtune.catalogue import (
    datasheet_bandwidth,
    datasheet_fp32_flops,
    datasheet_host_link,
    datasheet_peak_flops,
    datasheet_peer_link,
)
from llmtune.plan.communication import LINK_EFFICIENCY

# Fractions of the datasheet a training step reaches on a GPU: large bf16 matmuls run at 60-75% of the dense
# peak, streaming element-wise kernels at ~80% of HBM bandwidth; a kernel launch from eager PyTorch costs
# ~10 us of host time, hidden behind the GPU while kernels are long.
GPU_MATMUL_EFFICIENCY = 0.6
GPU_BANDWIDTH_EFFICIENCY = 0.8
GPU_OP_OVERHEAD_S = 10e-6
# A compiled decoder block (Inductor) fuses the chains of element-wise ops of its norms, RoPE, SwiGLU, residual adds
# and autocast's casts into a few kernels, each reading its inputs and writing its outputs once: on one Llama-3.2-1B-
# shaped block, forward and backward under bf16 autocast, its memory-bound kernels moved 0.34x the bytes of the eager
# ops in 0.27x the launches (Inductor's own byte count of its kernels against the time model's count of the eager
# ops, matmuls and attention aside: `python -m benchmarks.compile_fusion`, benchmarks/results/
# compile_fusion_cpu.json). For scale: torchtitan reports +16% tokens/s from compile on Llama-3.1-8B.
COMPILED_BLOCK_BYTES = 0.34
COMPILED_BLOCK_OPS = 0.27
# Pinned copies between a GPU and host memory reach ~80% of the PCIe link; a card whose link is not known is taken
# as PCIe 4.0 x16 (32 GB/s a direction).
HOST_LINK_EFFICIENCY = 0.8
HOST_LINK_BYTES_PER_S = HOST_LINK_EFFICIENCY * 32e9


# Where an SDPA kernel's query is in its arguments (q, k, v follow one another): first in the forwards, after the
# output's gradient in the backwards.
_A = torch.ops.aten
_SDPA_QUERY_ARG = {
    _A._scaled_dot_product_flash_attention: 0,
    _A._scaled_dot_product_efficient_attention: 0,
    _A._scaled_dot_product_flash_attention_backward: 1,
    _A._scaled_dot_product_efficient_attention_backward: 1,
}


@dataclass
class Work:
    """What a step computes: matmul FLOPs, bytes read and written by the other ops, ops dispatched, and bytes copied
    between the device and host memory (activation offloading)."""

    flops: float = 0.0
    bytes: float = 0.0
    ops: float = 0.0
    host_bytes: float = 0.0
    offloadable: float = 0.0  # bytes the checkpoints save, which offloading would copy each way (not timed)
    # Host memory offloading pins (not time, but extrapolated as the rest): PyTorch's CachingHostAllocator rounds each
    # copy up to a power of two (`c10::llvm::PowerOf2Ceil`) and keeps its blocks cached for the next step.
    pinned: float = 0.0
    # Of `bytes` and `ops`: those of the memory-bound ops inside the decoder blocks, which a compiled block fuses
    # (`Rates.compiled_blocks`).
    block_bytes: float = 0.0
    block_ops: float = 0.0

    def add(
        self, func: Any, args: tuple, kwargs: dict, out: Any, dispatches: float = 1.0, in_block: bool = False
    ) -> None:
        """Count one op; `dispatches` > 1 where it also passes through a Python dispatch mode; `in_block`: it runs
        inside a decoder block (forward, backward or recomputation), which `training.compile` compiles."""
        from torch.utils.flop_counter import flop_registry

        self.ops += dispatches
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            self.flops += count(*_kv_at_query_heads(func, args), **kwargs, out_val=out)
        elif not func.is_view:
            tensors = tree_flatten((args, kwargs, out))[0]
            nbytes = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
            self.bytes += nbytes
            if in_block:
                self.block_bytes += nbytes
                self.block_ops += dispatches

    def __add__(self, other: Work) -> Work:
        return Work(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def __sub__(self, other: Work) -> Work:
        return self + other * -1.0

    def __mul__(self, factor: float) -> Work:
        return Work(*(a * factor for a in astuple(self)))


def _kv_at_query_heads(func: Any, args: tuple) -> tuple:
    """An SDPA kernel's arguments as its FLOP formula should read them: with grouped-query attention (fewer K/V heads
    than the query's) the kernel broadcasts K and V to the query's heads, so its FLOPs are those of K and V at the
    query's heads. torch 2.13's formulas count so; 2.11's refuse the shapes (an AssertionError), and a formula reads
    shapes only, so K and V are given as their broadcast shapes."""
    first = _SDPA_QUERY_ARG.get(func._overloadpacket)
    if first is None:
        return args
    q, k, v = args[first : first + 3]
    if k.shape[1] == q.shape[1]:
        return args
    heads = q.shape[1]
    broadcast = [torch.Size((t.shape[0], heads, *t.shape[2:])) for t in (k, v)]
    return (*args[:first], q, *broadcast, *args[first + 3 :])


@dataclass(frozen=True)
class Rates:
    """A device's speed as the time model sees it. `flops_by_rows`: FLOP rates measured at several token counts
    per forward (rows of the step's matmuls), ascending; where given, they replace `flops_per_s` (`flop_rate`)."""

    flops_per_s: float
    bytes_per_s: float
    seconds_per_op: float
    source: str  # how they were found, shown with the plan
    flops_by_rows: tuple[tuple[int, float], ...] = ()
    host_bytes_per_s: float = HOST_LINK_BYTES_PER_S  # device <-> pinned host memory (offloading)
    link_bytes_per_s: float | None = None  # to the other processes' devices, a direction (None: not known)
    # A GPU runs its kernels while the host launches the next ones: per-op overhead overlaps the device's work
    # instead of adding to it, as on a CPU, which runs each op as it dispatches it.
    overlapped: bool = False
    # The decoder blocks run compiled (`training.compile`): their memory-bound ops move `COMPILED_BLOCK_BYTES` of
    # their eager bytes in `COMPILED_BLOCK_OPS` of their launches.
    compiled_blocks: bool = False

    def flop_rate(self, rows: int | None = None) -> float:
        """The FLOP rate of a step whose matmuls have `rows` rows: interpolated in log(rows) between the measured
        points, the nearest one outside them (a CPU's matmuls lose ~30% from 1024 rows to 256 at hidden 256)."""
        points = [(math.log(r), f) for r, f in self.flops_by_rows]
        if rows is None or not points:
            return self.flops_per_s
        x = math.log(rows)
        if x <= points[0][0]:
            return points[0][1]
        for (x0, f0), (x1, f1) in itertools.pairwise(points):
            if x <= x1:
                return f0 + (f1 - f0) * (x - x0) / (x1 - x0)
        return points[-1][1]

    def seconds(self, work: Work, rows: int | None = None) -> float:
        nbytes, ops = work.bytes, work.ops
        if self.compiled_blocks:
            nbytes -= work.block_bytes * (1.0 - COMPILED_BLOCK_BYTES)
            ops -= work.block_ops * (1.0 - COMPILED_BLOCK_OPS)
        device = work.flops / self.flop_rate(rows) + nbytes / self.bytes_per_s
        host = ops * self.seconds_per_op
        compute = max(device, host) if self.overlapped else device + host
        # Offloading's copies run on the compute stream (transformers' save_on_cpu): they add to the step.
        return compute + work.host_bytes / self.host_bytes_per_s


# Where the link between a run's processes is not known -- a CPU's processes, which talk over gloo (loopback TCP or
# shared memory), or a card the catalogue lacks -- sequence parallelism's all-to-alls are charged at a nominal 2 GB/s
# a direction: a constant, not measured, that ranks degrees against one another (more all-to-alls, slower) but
# forecasts no time. The data-parallel engines' collectives are charged only over a known link
# (`llmtune.plan.communication.step_seconds`): they overlap compute, where the all-to-alls stand in its way.
UNKNOWN_LINK_BYTES_PER_S = 2e9
# Between nodes, whose network no datasheet of a card says: 25 GB/s a direction a process, one 200 Gb/s NIC a GPU
# (InfiniBand HDR, or RoCE), as GPU clusters are commonly built (NDR's 400 Gb/s is twice it, a cloud's Ethernet can be
# a fraction of it). Nominal: it makes a group that spans nodes slower than one that does not, by about what it
# costs, and forecasts no more than that.
NETWORK_BYTES_PER_S = 25e9


def alltoall_seconds(nbytes: float, rates: Rates, off_node: float = 0.0) -> float:
    """Seconds a process spends in all-to-alls that send `nbytes` of its to the others (`llmtune.parallel.sequence`'s:
    attention waits for its inputs, so nothing hides them): at the bus bandwidth NCCL reaches on the link between the
    node's GPUs (`LINK_EFFICIENCY` of its datasheet rate a direction; an all-to-all's pieces leave each process over
    its own link), or at `UNKNOWN_LINK_BYTES_PER_S`. `off_node`: the share of the bytes that goes to other nodes
    (`llmtune.parallel.sequence.off_node_share`), over the network at `NETWORK_BYTES_PER_S`, no faster than the
    node's link; the two parts added, not overlapped, so that a group that spans nodes is never timed faster than one
    on a node (the network's part is most of the time either way)."""
    link = rates.link_bytes_per_s
    on_node = LINK_EFFICIENCY * link if link else UNKNOWN_LINK_BYTES_PER_S
    return nbytes * (1 - off_node) / on_node + nbytes * off_node / min(NETWORK_BYTES_PER_S, on_node)


def compiled(rates: Rates) -> Rates:
    """`rates` for a run whose decoder blocks are compiled (`training.compile`)."""
    if rates.compiled_blocks:
        return rates
    return replace(rates, compiled_blocks=True, source=f"{rates.source}; decoder blocks compiled")


# For a device this machine cannot measure and no datasheet names: they rank a planner's candidates, but forecast
# no time.
NOMINAL_RATES = Rates(1e12, 1e12, 1e-5, "nominal rates (no device to measure): a ranking, not a forecast")


def _best_of(fn: Any, repeats: int, sync: Any, pick: Callable[[list[float]], float] = min) -> float:
    """`fn`'s time after a warm-up call (first-call allocations, kernel selection): the best of `repeats`, or
    another `pick` of them."""
    fn()
    sync()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        seconds.append(time.perf_counter() - start)
    return pick(seconds)


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
    """The three rates of `device` for `config`'s architecture, measured in 0.3-3 s; none of the run's weights.

    FLOP rate: (2048 x hidden) @ (hidden x intermediate) in `dtype`, the decoder MLP's shape (`matmul_probe_shape`);
    bandwidth: an in-place add over 32 MiB tensors (on CUDA also copied to pinned host memory and back: the host
    link offloading uses); overhead: a training step (forward and backward) of the same
    architecture shrunk to one narrow layer and 16 tokens, whose time is all per-op overhead (the modules' Python
    and the dispatcher, the same per op at any width), divided by the ops it dispatches;
    then, on a CPU, the FLOP rate again from training steps of the architecture cut to one full-width layer at 256
    and 1024 tokens (`layer_model`), less the time their bytes and ops take at the other two rates. That is the rate the
    step's own matmul shapes run at, forward and backward (transposed, the narrow k/v projections, attention), with
    the caches as a step leaves them: 0.55-0.8x of the one large matmul's on this project's 2-core hosts. A GPU keeps
    the matmul's rate: its ops overlap their launch overhead, so a step's time less the other two is no rate.
    A layer too large to time in a fraction of a second keeps it too (`layer_step_rates`)."""
    device = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    rows, hidden, wide = matmul_probe_shape(config, device.type)
    a = torch.randn(rows, hidden, device=device, dtype=dtype)
    w = torch.randn(hidden, wide, device=device, dtype=dtype)
    flops_per_s = 2 * rows * hidden * wide / _best_of(lambda: a @ w, 10, sync)
    x = torch.zeros(8 * 1024**2, device=device)  # 32 MiB: past a CPU's last-level cache, as a step's activations
    y = torch.ones_like(x)
    bytes_per_s = 3 * x.numel() * x.element_size() / _best_of(lambda: x.add_(y), 10, sync)
    step, ops = _narrow_step(config, device)
    seconds_per_op = _best_of(step, 5, sync) / ops
    probed = Rates(flops_per_s, bytes_per_s, seconds_per_op, f"measured on this {device.type}")
    if device.type == "cuda":
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        both = _best_of(lambda: (host.copy_(x), x.copy_(host)), 5, sync)  # to the host and back, as offloading copies
        return replace(
            probed,
            host_bytes_per_s=2 * x.numel() * x.element_size() / both,
            link_bytes_per_s=datasheet_peer_link(torch.cuda.get_device_name(device)),
            overlapped=True,
        )
    if device.type == "cpu":
        by_rows = layer_step_rates(config, dtype, probed)
        if by_rows:
            return replace(probed, flops_by_rows=by_rows, source="measured on this cpu (one-layer steps)")
    return probed


LAYER_PROBE_ROWS = (256, 1024)  # tokens per forward of the one-layer steps: a micro-batch of 1 to 4 x 256 tokens
# The most one pass of the one-layer steps may take at the matmul probe's rate (each runs 4 times): a bound that
# keeps out a 70B layer (~40 s) or bf16 that a CPU emulates, far above a 512-wide layer (~0.25 s).
LAYER_PROBE_SECONDS = 0.5


StepTimer = Callable[[Callable[[], None]], float]


def median_of_3(step: Callable[[], None]) -> float:
    """A step's seconds: the median of 3 after a warm-up, the time of a typical step, which is what a run (and its
    check) will see, not the best."""
    return _best_of(step, 3, lambda: None, statistics.median)


def layer_step_rates(
    config: Any, dtype: torch.dtype, probed: Rates, time_step: StepTimer = median_of_3
) -> tuple[tuple[int, float], ...]:
    """FLOP/s of real one-layer training steps on this CPU, at each of `LAYER_PROBE_ROWS` tokens, once their
    memory-bound ops and per-op overhead are taken off (at the `probed` rates). Empty where those steps would take
    too long to time (a large layer, or bf16 on a CPU that emulates it), or where a step is so much overhead that
    what is left is within the other rates' noise (`flop_rate_left`). `time_step` times a step (tests give it)."""
    params = sum(p.numel() for p in layer_model(config, "meta", dtype).parameters())
    if 6 * params * sum(LAYER_PROBE_ROWS) / probed.flops_per_s > LAYER_PROBE_SECONDS:
        return ()
    model = layer_model(config, "cpu", dtype)
    seq = min(256, int(getattr(model.config, "max_position_embeddings", None) or 256))
    rates = []
    for rows in LAYER_PROBE_ROWS:
        ids = torch.randint(0, model.config.vocab_size, (max(1, rows // seq), seq))
        step = functools.partial(_loss_backward, model, ids)
        rate = flop_rate_left(dispatched_work(step), time_step(step), probed)
        if rate is None:
            return ()
        rates.append((ids.numel(), rate))
    return tuple(rates)


def flop_rate_left(work: Work, seconds: float, probed: Rates) -> float | None:
    """The FLOP rate of a step that took `seconds`, once its bytes and ops are taken off at the `probed` rates; None
    where under a quarter of the step is left for its FLOPs (a step that is mostly overhead, as one narrow layer is
    on a fast CPU: the remainder would be noise)."""
    left = seconds - probed.seconds(replace(work, flops=0.0))
    return work.flops / left if left >= 0.25 * seconds else None


def _loss_backward(model: torch.nn.Module, ids: torch.Tensor) -> None:
    model(input_ids=ids, labels=ids).loss.backward()


def layer_model(config: Any, device: str | torch.device, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """`config`'s architecture cut to its first layer at full width, with a vocabulary of at most 1024 (the lm_head
    is one more large matmul, whose shape need not be the real one's), in training mode."""
    text = config.get_text_config()
    return _cut_model(config, device, dtype, {"vocab_size": min(int(text.vocab_size), 1024)})


def _narrow_step(config: Any, device: torch.device) -> tuple[Any, int]:
    """A forward and backward of `narrow_model`, and the ops it dispatches."""
    ids = torch.randint(0, 128, (1, 16), device=device)
    step = functools.partial(_loss_backward, narrow_model(config, device), ids)
    return step, dispatched_ops(step)


def narrow_model(config: Any, device: str | torch.device) -> torch.nn.Module:
    """`config`'s architecture with one narrow layer (16-dim heads, vocabulary 128), in fp32, in training mode."""
    heads = int(getattr(config.get_text_config(), "num_attention_heads", 4) or 4)
    narrow = {"hidden_size": 16 * heads, "intermediate_size": 32 * heads, "vocab_size": 128, "head_dim": 16}
    # fp32: a hub config may say bf16, which a CPU without native bf16 emulates (~30x slower per op).
    return _cut_model(config, device, torch.float32, narrow)


def _cut_model(config: Any, device: str | torch.device, dtype: torch.dtype, changes: dict) -> torch.nn.Module:
    """`config`'s text model with one layer and `changes`, each only where the architecture has that key."""
    import copy

    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(config.get_text_config())
    heads = int(getattr(cfg, "num_attention_heads", 4) or 4)
    kv = int(getattr(cfg, "num_key_value_heads", heads) or heads)
    changes = {"num_hidden_layers": 1, "num_key_value_heads": kv, **changes}
    changes["layer_types"] = (getattr(cfg, "layer_types", None) or [])[:1]
    for key, value in changes.items():
        if getattr(cfg, key, None):  # only what this architecture has
            setattr(cfg, key, value)
    cfg.use_cache = False
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.train()


def dispatched_work(fn: Callable[[], Any]) -> Work:
    """The work `fn()` dispatches, counted as the trace counts it (`Work.add`), one dispatch per op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    work = Work()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            work.add(func, args, kwargs or {}, out)
            return out

    with Count():
        fn()
    return work


def dispatched_ops(fn: Callable[[], Any]) -> int:
    """How many ops `fn()` dispatches (the count the time model's per-op overhead is charged on)."""
    return int(dispatched_work(fn).ops)


def datasheet_rates(name: str, precision: str, tf32: bool = False) -> Rates | None:
    """Rates of a GPU known by name, from its datasheet (dense 16-bit peak, or fp32's as `tf32` sets it; HBM
    bandwidth; the links to host memory and to the node's other GPUs), or None."""
    key = name.lower().replace("-", " ")
    peak = datasheet_fp32_flops(key, tf32) if precision == "fp32" else datasheet_peak_flops(key)
    bandwidth = datasheet_bandwidth(key)
    if peak is None or bandwidth is None:
        return None
    link = datasheet_host_link(key)
    return Rates(
        flops_per_s=peak * GPU_MATMUL_EFFICIENCY,
        bytes_per_s=bandwidth * GPU_BANDWIDTH_EFFICIENCY,
        seconds_per_op=GPU_OP_OVERHEAD_S,
        source=f"{name} datasheet: {GPU_MATMUL_EFFICIENCY:.0%} of peak FLOP/s"
        f"{' (fp32: TF32 ' + ('on' if tf32 else 'off') + ')' if precision == 'fp32' else ''},"
        f" {GPU_BANDWIDTH_EFFICIENCY:.0%} of bandwidth",
        host_bytes_per_s=HOST_LINK_EFFICIENCY * link if link else HOST_LINK_BYTES_PER_S,
        link_bytes_per_s=datasheet_peer_link(key),
        overlapped=True,
    )
