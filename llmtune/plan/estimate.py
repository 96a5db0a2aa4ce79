"""Estimate the peak memory of one steady-state training step, without allocating anything.

How: the model is built from its config under `FakeTensorMode` (tensors with shapes, dtypes and
storages but no data) and one real training step runs on it -- forward, loss, backward,
optimizer step -- while a `LiveStorageCounter` follows every storage (`trace.py`). Since the fake tensors go
through the same autograd, autocast and ATen kernels as real ones, the trace keeps exactly what
a real CPU step keeps (saved activations, autocast weight copies, fp32 logits, AdamW temporaries)
for any architecture transformers can build, with no per-architecture formula. Measured against
real CPU steps it is exact to the byte in most cases (see benchmarks/results/). Deep models are
traced at 1 and 2 layers (times the layer-kind period) and extrapolated: every segment's peak is
affine in the layer count, so this matches a full trace exactly and a 70B config takes seconds.

The step is the training loop's own: `llmtune.ops.loss.CausalLMWithLoss` (HF or chunked loss) on a
micro-batch shaped as `llmtune.data.collate` shapes it -- packed rows with restarting position ids
(transformers builds a block-diagonal mask, and GQA models then repeat K/V for SDPA) or padded rows
with an attention mask -- every row `seq_len` tokens long (the largest micro-batch of the run), then
`zero_grad(set_to_none=True)`. Fake tensors cannot see which labels are masked: the chunked loss is
taken to train `trained_fraction` of the tokens (training passes the data's
`DataStats.max_trained_fraction`; 1.0, the upper bound, by default).

What is modelled rather than traced (`llmtune.plan.kernels`, each stand-in from its kernel's source):
- QLoRA's 4-bit NF4 base weights and their quantisation state, dequantised per matmul (bitsandbytes).
- `optimizer="adamw_8bit"`: bitsandbytes' uint8 states with blockwise absmax, fp32 for small tensors.
- `attn_implementation="flash_attention_2"`: SDPA's flash kernel without a mask and with native GQA,
  which keeps what flash-attention-2 keeps (output, fp32 log-sum-exp).
- `device="cuda"`: the trace runs CPU kernels (fake CUDA tensors fail in autograd on a CPU-only
  build), with CUDA autocast's op lists where they differ from CPU's and SDPA replaced by the kernel
  CUDA would pick (flash / memory-efficient stand-ins with their backward workspaces; the math
  composite as itself) -- `kernels.CudaKernels`. Every storage is rounded to the caching allocator's
  512-byte blocks, AdamW is CUDA's default (foreach: one state-sized temporary at step), and
  `reserved_bytes` adds what the allocator keeps on top (`allocator.reserved_overhead`).
  The two cuBLAS workspaces (`CUBLAS_WORKSPACE_BYTES`) are counted: the caching allocator holds them. Not
  counted: the CUDA context (0.3-2 GiB), NCCL buffers; `budget.default_budget` keeps a margin for them.
- sharding and data parallelism: the counter scales sharded tags by 1/num_processes and adds
  the buffers the wrapper would hold (`llmtune.plan.sharding`).
- compile (`training.compile`): not modelled; the eager step's memory is given (a compiled block
  usually keeps less).
- activation offloading (`checkpointing.offload`): traced with hooks of our own in place of transformers'
  `save_on_cpu` (`llmtune.plan.offload`): on CUDA what each checkpoint saves leaves the device in forward and
  comes back in backward, its bytes counted as host-link traffic (`Work.host_bytes`); pinned host memory is
  not counted against the device's budget.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from llmtune.plan.cache import cached_trace, prefetch
from llmtune.plan.extrapolate import assemble, layer_period, traces_needed
from llmtune.plan.settings import LoraSpec, Settings, settings_of
from llmtune.plan.timing import Work
from llmtune.plan.trace import Trace
from llmtune.units import format_bytes

TOKEN_TAGS = ("activations", "logits_and_loss", "backward_temporaries", "inputs")  # bytes that grow with the batch


@dataclass
class MemoryEstimate:
    """Predicted steady-state peak of one training micro-step (the one that runs the optimizer).

    `breakdown` splits `peak_bytes` into what was live at the peak moment (sums to
    `peak_bytes`): weights, gradients, optimizer_states, autocast_weight_copies, activations
    (kept for backward, incl. checkpoint inputs), logits_and_loss (lm head output, fp32 upcast,
    their gradients), backward_temporaries (activation gradients, recomputation),
    optimizer_step_temporaries, sharding_buffers, inputs, other.
    `totals` gives full sizes of the model states whatever the peak moment.
    """

    breakdown: dict[str, int]
    peak_bytes: int
    peak_phase: str
    reserved_bytes: int = 0  # CUDA: what the caching allocator reserves at the peak; CPU: peak_bytes
    totals: dict[str, int] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    work: Work = field(default_factory=Work)  # forward and backward, recomputation included (llmtune.plan.timing)
    optimizer_work: Work = field(default_factory=Work)  # the update (once per optimizer step)
    segment_peaks: dict[str, dict[str, int]] = field(default_factory=dict, repr=False)  # for `scaled_peak`

    @property
    def pinned_host_bytes(self) -> int:
        """Host memory activation offloading pins for the step (0 without it), outside the device's budget."""
        return int(self.work.pinned)

    def scaled_peak(self, factor: float) -> int:
        """The reserved peak with `factor` times the tokens per micro-step, without a trace: in every segment of the
        step, what the tokens make (`TOKEN_TAGS`) scales and the model states do not. Exact where the
        activations are linear in the micro-batch; the planner checks its choice with a real estimate."""
        peak = max(
            sum(v * (factor if tag in TOKEN_TAGS else 1) for tag, v in by_tag.items())
            for by_tag in self.segment_peaks.values()
        )
        return int(peak) + self.reserved_bytes - self.peak_bytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("segment_peaks")
        d["peak"] = format_bytes(self.peak_bytes)
        d["reserved"] = format_bytes(self.reserved_bytes)
        return d


def estimate(config: Any, *, max_traced_layers: int = 4, **settings: Any) -> MemoryEstimate:
    """Peak bytes of a steady-state training micro-step of `config` on one process, with `settings` as
    `settings_of` takes them (micro_batch_size, seq_len, precision, gradient_checkpointing, ...).

    Models with more than `max_traced_layers` layers (in units of the layer-kind period) are
    traced at 1 and 2 periods and extrapolated linearly in the layer count."""
    return estimate_all(config, [settings], max_traced_layers)[0]


def estimate_all(config: Any, settings: list[dict[str, Any]], max_traced_layers: int = 4) -> list[MemoryEstimate]:
    """`estimate` of each of `settings` (keyword arguments of `settings_of`), their traces run in parallel."""
    plans = []
    for kwargs in settings:
        s = settings_of(config, **kwargs)
        plans.append((s, *traces_needed(config, s, max_traced_layers)))
    prefetch(config, [job for _, _, jobs in plans for job in jobs])
    period = layer_period(config)
    return [
        _result(assemble(kind, [cached_trace(config, n, x, period) for n, x in jobs], config, s), s, config, jobs)
        for s, kind, jobs in plans
    ]


# CublasHandlePool.cpp `parseChosenWorkspaceSize`: every (cuBLAS handle, stream) pair gets a workspace from the
# caching allocator: 32 MiB on sm90 (Hopper) and newer, 4096 KiB x 2 + 16 KiB x 8 on older cards. Handles are per
# thread, and autograd runs CUDA backward on a thread of its own: two workspaces, resident from the first step.
# Planned at Hopper's size (the settings do not name the card: 48 MiB over on an older one). The GPU check measured
# 59-69 MiB more allocated than the estimate on an H200 before these were counted.
CUBLAS_WORKSPACE_BYTES = 32 * 1024**2
CUBLAS_WORKSPACES = 2


def _result(trace: Trace, s: Settings, config: Any, jobs: list[tuple[int, Settings]]) -> MemoryEstimate:
    layers = int(config.num_hidden_layers)
    traced = sorted({n for n, _ in jobs})

    name, top = max(trace.segments.items(), key=lambda kv: kv[1].bytes)
    breakdown = dict(sorted(top.by_tag.items(), key=lambda kv: -kv[1]))
    drift = top.bytes - sum(breakdown.values())  # rounding of scaled tags; keep parts summing up
    if drift and breakdown:
        breakdown[next(iter(breakdown))] += drift
    workspaces = {"cublas_workspaces": CUBLAS_WORKSPACES * CUBLAS_WORKSPACE_BYTES} if s.device == "cuda" else {}
    extra = sum(workspaces.values())
    settings = asdict(s)
    settings["layers"] = layers
    settings["traced_layers"] = traced
    settings["peak_segment"] = name
    return MemoryEstimate(
        breakdown=breakdown | workspaces,
        peak_bytes=top.bytes + extra,
        peak_phase=top.phase,
        reserved_bytes=top.bytes + extra + trace.reserved_overhead,
        totals=trace.totals,
        settings=settings,
        work=trace.work,
        optimizer_work=trace.optimizer_work,
        segment_peaks={name: seg.by_tag | workspaces for name, seg in trace.segments.items()},
    )


__all__ = ["LoraSpec", "MemoryEstimate", "estimate", "estimate_all", "settings_of"]
