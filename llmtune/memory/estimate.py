"""Estimate the peak memory of one steady-state training step, without allocating anything.

How: the model is built from its config under `FakeTensorMode` (tensors with shapes, dtypes and
storages but no data) and one real training step runs on it -- forward, loss, backward,
optimizer step -- while a `LiveStorageCounter` follows every storage. Since the fake tensors go
through the same autograd, autocast and ATen kernels as real ones, the trace keeps exactly what
a real CPU step keeps (saved activations, autocast weight copies, fp32 logits, AdamW temporaries)
for any architecture transformers can build, with no per-architecture formula. Measured against
real CPU steps it is exact to the byte in most cases (see benchmarks/results/). Deep models are
traced at 1 and 2 layers (times the layer-kind period) and extrapolated: every segment's peak is
affine in the layer count, so this matches a full trace exactly and a 70B config takes seconds.

The step is the training loop's own: `llmtune.loss.CausalLMWithLoss` (HF or chunked loss) on a
micro-batch shaped as `llmtune.data.collate` shapes it -- packed rows with restarting position ids
(transformers builds a block-diagonal mask, and GQA models then repeat K/V for SDPA) or padded rows
with an attention mask -- every row `seq_len` tokens long (the largest micro-batch of the run), then
`zero_grad(set_to_none=True)`. Fake tensors cannot see which labels are masked: the chunked loss is
taken to train `trained_fraction` of the tokens (training passes the data's
`DataStats.max_trained_fraction`; 1.0, the upper bound, by default).

What is modelled rather than traced (`llmtune.memory.kernels`, each stand-in from its kernel's source):
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
  Not counted: the CUDA context (0.3-2 GiB), cuBLAS workspace, NCCL buffers; `plan.default_budget`
  keeps a margin for them.
- sharding and data parallelism: the counter scales sharded tags by 1/num_processes and adds
  the buffers the wrapper would hold (see `_sharding_plan`).
- compile (`training.compile`): not modelled; the eager step's memory is given (a compiled block
  usually keeps less).
- activation offloading (`checkpointing.offload`): traced with hooks of our own in place of transformers'
  `save_on_cpu` (`_offload_saved_inputs`): on CUDA what each checkpoint saves leaves the device in forward and
  comes back in backward, its bytes counted as host-link traffic (`Work.host_bytes`); pinned host memory is
  not counted against the device's budget.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from llmtune.loss import CausalLMWithLoss, decoder_of, default_chunk_size
from llmtune.memory.allocator import LARGE_BUFFER, reserved_peak
from llmtune.memory.kernels import AdamW8bitModel, CudaKernels, parameter_count, quantize_base_4bit
from llmtune.memory.measure import LiveStorageCounter
from llmtune.memory.speed import Work
from llmtune.model import OFFLOAD_NEEDS_CUDA, apply_checkpointing, peft_quietly
from llmtune.recipe import Checkpointing, checkpointed_layers, checkpointing_of
from llmtune.units import format_bytes

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "bf16", "fp16", "bf16-true")
OPTIMIZERS = ("adamw", "adamw_fused", "adamw_bf16", "adamw_8bit")
LOSSES = ("hf", "chunked")
LAYOUTS = ("packed", "padded")
OBJECTIVES = ("sft", "dpo", "orpo", "simpo")
REFERENCES = ("none", "adapter_disabled", "copy", "precomputed")
SHARDINGS = ("none", "fsdp", "zero2", "zero3")
DEVICES = ("cuda", "cpu")
PHASES = ("forward", "backward", "optimizer_step")
TOKEN_TAGS = ("activations", "logits_and_loss", "backward_temporaries", "inputs")  # bytes that grow with the batch

_CUDA_BLOCK = 512  # bytes; the CUDA caching allocator rounds every block up to this


@dataclass(frozen=True)
class LoraSpec:
    """LoRA adapters as peft builds them; base weights are frozen."""

    rank: int = 8
    target_modules: tuple[str, ...] | str = "all-linear"
    dropout: bool = False  # True: peft keeps a dropout mask-sized copy of each adapter input
    alpha: int = 16
    method: str = "lora"  # lora | dora (peft's magnitude vectors) | qlora (4-bit NF4 base, see kernels.py)


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
    work: Work = field(default_factory=Work)  # forward and backward, recomputation included (memory.speed)
    optimizer_work: Work = field(default_factory=Work)  # the update (once per optimizer step)
    segment_peaks: dict[str, dict[str, int]] = field(default_factory=dict, repr=False)  # for `scaled_peak`

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


# ---------------------------------------------------------------------------------------------
# the traced step


def _validate(s: _Settings) -> None:
    if s.checkpointing.offload and not s.checkpointing.enabled:
        raise ValueError("checkpointing.offload moves the inputs that checkpointing saves: it needs checkpointing")
    if s.checkpointing.offload and s.device != "cuda":
        raise ValueError(OFFLOAD_NEEDS_CUDA)
    for name, value, allowed in (
        ("objective", s.objective, OBJECTIVES),
        ("reference", s.reference, REFERENCES),
        ("layout", s.layout, LAYOUTS),
        ("precision", s.precision, PRECISIONS),
        ("optimizer", s.optimizer, OPTIMIZERS),
        ("loss", s.loss, LOSSES),
        ("sharding", s.sharding, SHARDINGS),
        ("device", s.device, DEVICES),
    ):
        if value not in allowed:
            raise ValueError(f"{name}={value!r}; expected one of {allowed}")


def _build_model(config: Any, s: _Settings) -> torch.nn.Module:
    """The model as `llmtune.model.load_model` builds it for training, on fake tensors."""
    from transformers import AutoModelForCausalLM

    from llmtune.model import check_attn_implementation, check_bitsandbytes_device

    check_attn_implementation(config, s.attn_implementation, installed=False)
    check_bitsandbytes_device(s.lora.method if s.lora else "none", s.optimizer, s.device)
    cfg = copy.deepcopy(config)
    cfg.use_cache = False
    dtype = torch.bfloat16 if s.precision == "bf16-true" else torch.float32
    # flash-attention-2 may not be installed here (planning for a GPU). transformers runs it without a
    # mask on packed rows (varlen) and with native GQA; SDPA's flash kernel, run without a mask below,
    # keeps the same output and fp32 log-sum-exp, so it stands in for it.
    attn = "sdpa" if s.attn_implementation == "flash_attention_2" else s.attn_implementation
    # Full init on fake tensors costs nothing real and keeps what init does beyond values
    # (tying the lm head to the embedding).
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=dtype)
    lora = s.lora
    if lora is None:
        return model
    from peft import LoraConfig, get_peft_model

    target = lora.target_modules
    # peft moves each new adapter to its base layer's device with Module.to(), which on fake
    # parameters takes the swap_tensors path and fails. Everything is already on the (fake)
    # CPU, and adapters stay fp32 as peft's autocast_adapter_dtype=True leaves them.
    move = torch.nn.Module.to
    torch.nn.Module.to = lambda self, *a, **k: self
    try:
        with peft_quietly():
            model = get_peft_model(
                model,
                LoraConfig(
                    r=lora.rank,
                    lora_alpha=lora.alpha,
                    target_modules=target if isinstance(target, str) else list(target),
                    lora_dropout=0.1 if lora.dropout else 0.0,
                    use_dora=lora.method == "dora",
                    task_type="CAUSAL_LM",
                ),
            )
    finally:
        torch.nn.Module.to = move
    if lora.method == "qlora":
        quantize_base_4bit(model, torch.float16 if s.precision == "fp16" else torch.bfloat16)
    return model


def _build_optimizer(params: list[torch.nn.Parameter], optimizer: str, device: str):
    if optimizer == "adamw_fused":
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    if optimizer == "adamw_bf16":  # llmtune's optimizer for bf16 weights: bf16 states, chunked fp32 temporaries
        from llmtune.optim import BF16AdamW

        return BF16AdamW(params, lr=1e-3)
    if optimizer == "adamw_8bit":
        return AdamW8bitModel(params, lr=1e-3)
    # torch's own default for the target device: foreach on CUDA, the per-tensor loop on CPU.
    return torch.optim.AdamW(params, lr=1e-3, foreach=(device == "cuda"))


@dataclass
class _Sharding:
    scale: dict[str, float]
    fwd_bwd_extra: int  # bytes held during forward/backward only
    bwd_extra: int  # more bytes during backward only
    always_extra: int  # bytes held the whole step


def _sharding_plan(
    sharding: str,
    num_processes: int,
    layer_bytes: int,
    layer_grad_bytes: int,
    grad_bytes: int,
    ddp_bucket_view: bool,
) -> _Sharding:
    w = max(1, num_processes)
    if sharding == "none":
        # DDP allocates its gradient buckets (a second copy of all grads) at wrap time, unless
        # gradient_as_bucket_view=True makes .grad a view into them. One process: no DDP.
        extra = grad_bytes if (w > 1 and not ddp_bucket_view) else 0
        return _Sharding({}, 0, 0, extra)
    # The optimizer runs on each process's shard only, so its temporaries shrink too.
    states = {"gradients": 1 / w, "optimizer_states": 1 / w, "optimizer_step_temporaries": 1 / w}
    if sharding == "zero2":
        # Weights replicated; grads reduce-scattered into shards; bucket buffers not modelled.
        return _Sharding(states, 0, 0, 0)
    # fsdp (FSDP2 full shard) and zero3: parameters sharded too; while a layer runs, its
    # parameters are all-gathered and the next layer's are prefetched (2 layers), and in backward
    # one layer's unsharded gradients wait for the reduce-scatter.
    return _Sharding({**states, "weights": 1 / w}, 2 * layer_bytes, layer_grad_bytes, 0)


@contextmanager
def _no_packed_mask() -> Iterator[None]:
    """flash-attention-2 stands in as SDPA without a mask (see `_build_model`). transformers' mask builder
    cannot look at fake position ids, assumes packed rows and would materialise a (batch, 1, seq, seq)
    block mask, which flash-attention-2 never builds (it takes the packed segments as varlen)."""
    import transformers.masking_utils as mu

    original = mu.find_packed_sequence_indices
    mu.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = original


@contextmanager
def _hooks(handles: list[Any]) -> Iterator[None]:
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@dataclass(frozen=True)
class _Settings:
    micro_batch_size: int
    seq_len: int
    layout: str
    precision: str
    checkpointing: Checkpointing
    attn_implementation: str
    optimizer: str
    loss: str
    chunk_size: int
    lora: LoraSpec | None
    num_processes: int
    sharding: str
    device: str
    grad_accum_steps: int
    ddp_bucket_view: bool
    trained_fraction: float
    expandable_segments: bool
    objective: str
    reference: str


@dataclass
class _SegmentPeak:
    bytes: int
    by_tag: dict[str, int]
    phase: str


class _TraceCounter(LiveStorageCounter):
    """Counter that recognises autocast's casts of weights and keeps the peak of each segment
    of the step (embedding, each layer's forward and backward, head and loss, optimizer step),
    so that a trace of a few layers can be extrapolated to many."""

    def __init__(self, trained_fraction: float, chunk_rows: int | None, selective: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.selective = selective
        self.trained_fraction = trained_fraction
        self.chunk_rows = chunk_rows
        self._untraced_rows: dict[int, torch.Tensor] = {}
        self.phase = "forward"  # forward / backward / optimizer_step: where each segment's peak happened
        self.segment: tuple[str, ...] = ()
        self.segments: dict[str, _SegmentPeak] = {}
        self.events: list[tuple[int, int]] = []  # (storage, bytes) allocated, (storage, 0) freed, in order
        # What the step computes, for the time model: the head and loss apart, since the chunked loss's loop is
        # traced on two chunks and the rest is scaled from them (`_trained_rows`).
        self.work = {"body": Work(), "head": Work(), "step": Work()}
        self.untraced_factor = 1.0

    def register(self, t: torch.Tensor, tag: str | None = None) -> None:
        # Each storage's first registration is an allocation for the allocator model (allocator.py).
        known = not isinstance(t, torch.Tensor) or t.device.type == "meta" or id(t.untyped_storage()) in self._live
        super().register(t, tag)
        if not known:
            key = id(t.untyped_storage())
            nbytes, tag, _ = self._live[key]
            self.events.append((key, int(nbytes * self.scale.get(tag, 1.0))))

    def _release(self, key: int) -> None:
        if key in self._live:
            self.events.append((key, 0))
        super()._release(key)

    def _trained_rows(self, labels_mask: torch.Tensor) -> torch.Tensor:
        """`nonzero` of the chunked loss's trained-token mask. Its size depends on the data, which fake
        tensors do not have: the data's `trained_fraction` (1.0, every token, bounds it) gives it.

        The loss then loops over chunks of these rows, each chunk's buffers freed before the next, so the
        loop's peak is that of its second chunk: rows past two chunks are not traced (at 64k tokens that is
        hundreds of identical iterations). A stand-in of their size keeps the index tensor's bytes exact.
        `chunk_rows=None` traces every row (the preference objectives keep the selected rows' hidden states)."""
        rows = math.ceil(labels_mask.numel() * self.trained_fraction)
        traced = rows if self.chunk_rows is None else min(rows, 2 * self.chunk_rows)
        self.untraced_factor = rows / max(1, traced)
        out = torch.empty((traced, labels_mask.dim()), dtype=torch.long)
        self.register(out)
        if traced < rows:
            rest = torch.empty(((rows - traced) * labels_mask.dim(),), dtype=torch.long)
            self.register(rest)
            # Freed with the index tensor it stands for.
            key = id(out.untyped_storage())
            self._untraced_rows[key] = rest
            weakref.finalize(out.untyped_storage(), self._untraced_rows.pop, key, None)
        return out

    def set_segment(self, *names: str) -> None:
        """Peaks from now on count for `names` (a model's only layer is its first and its last)."""
        self.segment = names
        self._check()

    def _check(self) -> None:
        super()._check()
        now = self.live_bytes + self.extra_bytes
        for name in self.segment:
            seg = self.segments.get(name)
            if seg is None or now > seg.bytes:
                by_tag = {k: int(round(v)) for k, v in self._by_tag.items() if v > 0.5}
                if self.extra_bytes:
                    by_tag["sharding_buffers"] = int(self.extra_bytes)
                self.segments[name] = _SegmentPeak(int(round(now)), by_tag, self.phase)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.prim.device.default:
            # `tensor.device` of a fake tensor (the autograd engine and checkpointing ask ~1400 times a layer): an
            # attribute read in a real step, so neither memory nor work; answered here, as FakeTensorMode would,
            # without its dispatch cache's hashing (a third of a deep model's trace time).
            t = args[0]
            return t.fake_device if isinstance(t, FakeTensor) and not t.fake_mode.in_kernel_invocation else func(*args)
        if func is torch.ops.aten.nonzero.default:
            return self._trained_rows(args[0])
        if func is torch.ops.aten._to_copy.default and self.tag_of(args[0]) == "weights":
            saved, self.tag = self.tag, "autocast_weight_copies"
            try:
                out = super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                self.tag = saved
        else:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        bucket = (
            "step" if self.phase == "optimizer_step" else "head" if {"head", "loss_bwd"} & set(self.segment) else "body"
        )
        # Selective checkpointing runs every op of a layer, in forward and in recomputation, through torch's
        # policy dispatch mode: a second Python dispatch each.
        in_layer = self.selective and any(n.startswith(("fwd_", "bwd_")) for n in self.segment)
        self.work[bucket].add(func, args, kwargs or {}, out, 2.0 if in_layer else 1.0)
        return out

    def total_work(self) -> Work:
        """Forward and backward: the chunked loss's two traced chunks stand for all of them."""
        return self.work["body"] + self.work["head"] * self.untraced_factor


def _offload_saved_inputs(model: torch.nn.Module, counter: _TraceCounter) -> None:
    """Activation offloading as transformers runs it (`save_on_cpu` around each checkpointed layer's checkpoint,
    on CUDA): what the checkpoint saves -- the layer's tensor inputs, the hidden states -- is copied to pinned host
    memory in forward, its device copy freed, and copied back when backward recomputes the layer. The trace keeps
    only the shape meanwhile and counts the bytes both ways (`Work.host_bytes`)."""

    def pack(t: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
        counter.work["body"].host_bytes += t.numel() * t.element_size()
        return t.size(), t.dtype

    def unpack(packed: tuple[torch.Size, torch.dtype]) -> torch.Tensor:
        size, dtype = packed
        counter.work["body"].host_bytes += size.numel() * dtype.itemsize
        return torch.empty(size, dtype=dtype)  # the device copy, allocated where backward needs it

    _hook_checkpoints(model, pack, unpack)


def _count_saved_inputs(model: torch.nn.Module, counter: _TraceCounter) -> None:
    """What offloading would copy each way, counted without it (`Work.offloadable`): the planner then knows the time
    of every layer offloaded from the trace of every layer, and traces offloading only if it needs its memory."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        counter.work["body"].offloadable += t.numel() * t.element_size()
        return t

    _hook_checkpoints(model, pack, lambda t: t)


def _hook_checkpoints(model: torch.nn.Module, pack: Any, unpack: Any) -> None:
    """Saved-tensor hooks around each checkpointed layer's checkpoint call: they see what the checkpoint itself
    saves (its inputs); what the layer saves inside is the checkpoint's own business."""
    for m in model.modules():
        func = getattr(m, "_gradient_checkpointing_func", None)
        if func is not None and getattr(m, "gradient_checkpointing", False):
            m._gradient_checkpointing_func = functools.partial(_with_saved_tensor_hooks, func, pack, unpack)


def _with_saved_tensor_hooks(func: Any, pack: Any, unpack: Any, *args: Any, **kwargs: Any) -> Any:
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return func(*args, **kwargs)


def _batch(s: _Settings) -> dict[str, torch.Tensor]:
    """A micro-batch as `llmtune.data.collate` makes it: packed rows carry position ids and no attention
    mask (transformers builds the block-diagonal mask itself), padded rows an attention mask.

    Preference pairs as `llmtune.preference.collate_pairs` makes them: packed, `micro_batch_size` rows of
    `seq_len` tokens holding whole pairs (counted as one pair a row: only [pairs, 2] tensors depend on it);
    padded, a row per sequence, chosen and rejected, each `seq_len // 2` long (a pair fills `max_length`)."""
    rows, width = s.micro_batch_size, s.seq_len
    pairs = s.objective != "sft"
    if pairs and s.layout == "padded":
        rows, width = 2 * s.micro_batch_size, max(2, s.seq_len // 2)
    ids = {
        "input_ids": torch.zeros((rows, width), dtype=torch.long),
        "labels": torch.zeros((rows, width), dtype=torch.long),
    }
    if pairs:
        ids |= {
            "segment_ids": torch.zeros((rows, width), dtype=torch.long),
            "pair_ids": torch.arange(s.micro_batch_size),
        }
        if s.reference == "precomputed":
            ids["ref_logps"] = torch.zeros((s.micro_batch_size, 2), dtype=torch.float32)
    if s.layout == "packed":
        return ids | {"position_ids": torch.zeros((rows, width), dtype=torch.long)}
    return ids | {"attention_mask": torch.ones((rows, width), dtype=torch.long)}


def _step_module(config: Any, model: torch.nn.Module, s: _Settings) -> torch.nn.Module:
    """What the loop trains (`llmtune.train.training_module`): SFT's loss module or the preference objective's,
    with a frozen copy for `reference="copy"` (its weights count as `reference_weights`)."""
    if s.objective == "sft":
        return CausalLMWithLoss(model, s.loss, s.chunk_size)
    from llmtune.preference import PreferenceModel
    from llmtune.recipe import PreferenceConfig

    frozen = None
    if s.reference == "copy":
        frozen = _build_model(config, replace(s, lora=None)).requires_grad_(False).eval()
    return PreferenceModel(model, s.loss, s.objective, PreferenceConfig(), s.reference, frozen, s.chunk_size)


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The model's stack of decoder layers: its longest ModuleList."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return max(lists, key=len, default=None)


def _layer_period(config: Any) -> int:
    """Length of the repeating unit of layer kinds (Gemma2 alternates sliding/full: 2)."""
    kinds = list(getattr(config, "layer_types", None) or [])
    for p in range(1, len(kinds) + 1):
        if all(kinds[i] == kinds[i % p] for i in range(len(kinds))):
            return p
    return 1


def _with_layers(config: Any, n: int) -> Any:
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = n
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[:n]
    return cfg


@dataclass
class _Trace:
    segments: dict[str, _SegmentPeak]
    totals: dict[str, int]
    work: Work
    optimizer_work: Work
    reserved_overhead: int = 0  # what the CUDA caching allocator reserves beyond the peak of live blocks


def _trace_step(config: Any, s: _Settings, period: int) -> _Trace:
    """Run one steady-state training step of `config` on fake tensors and record segment peaks."""
    fa2 = s.attn_implementation == "flash_attention_2"
    with FakeTensorMode(), _no_packed_mask() if fa2 else nullcontext():
        model = _build_model(config, s)
        # A checkpointed block recomputes its forward in backward: with CUDA's kernels too. Offloading is traced
        # by hooks of our own (`_offload_saved_inputs`): transformers' would copy fake tensors to pinned memory.
        recompute = CudaKernels if s.device == "cuda" else None
        apply_checkpointing(model, replace(s.checkpointing, offload=False), recompute=recompute)
        model.train()
        # The module the training loop runs (and refuses what it refuses, with the same message).
        step_module = _step_module(config, model, s)
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = _build_optimizer(trainable, s.optimizer, s.device)
        # Steady state: AdamW creates its states at the first step(), so make them exist now
        # (zero grads + one untracked step) instead of tracing a whole first step.
        for p in trainable:
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=s.grad_accum_steps == 1)

        layers = _decoder_layers(model)
        nbytes = lambda ps: sum(p.numel() * p.element_size() for p in ps)  # noqa: E731
        layer_bytes = max((nbytes(m.parameters()) for m in layers or []), default=0)
        layer_grad_bytes = max((nbytes(p for p in m.parameters() if p.requires_grad) for m in layers or []), default=0)
        grad_bytes = nbytes(trainable)
        plan = _sharding_plan(s.sharding, s.num_processes, layer_bytes, layer_grad_bytes, grad_bytes, s.ddp_bucket_view)
        state_tensors = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
        totals = {
            "parameters": parameter_count(model),
            "trainable_parameters": sum(p.numel() for p in trainable),
            "weights": nbytes(model.parameters()) + nbytes(model.buffers()),  # buffers: rotary tables, 4-bit state
            "gradients": grad_bytes,
            "optimizer_states": nbytes(state_tensors),
        }

        chunk_rows = s.chunk_size if s.objective == "sft" else None
        counter = _TraceCounter(
            s.trained_fraction, chunk_rows, s.checkpointing.selective, round_to=_CUDA_BLOCK if s.device == "cuda" else 1
        )
        for tag, factor in plan.scale.items():
            counter.set_scale(tag, factor)
        if s.checkpointing.offload:
            _offload_saved_inputs(model, counter)
        elif s.checkpointing.enabled:
            _count_saved_inputs(model, counter)
        for p in model.parameters():
            counter.register(p, "weights")
            if p.grad is not None:
                counter.register(p.grad, "gradients")
        for b in model.buffers():
            counter.register(b, "weights")
        if s.reference == "copy":  # the frozen copy PreferenceModel keeps outside its parameters
            for w in step_module._reference_model[0].state_dict().values():
                counter.register(w, "reference_weights")
        for v in state_tensors:
            counter.register(v, "optimizer_states")
        batch = _batch(s)
        for v in batch.values():
            counter.register(v, "inputs")

        def block_names(i: int, phase: str) -> list[str]:
            block, last = i // period, (len(layers) - 1) // period
            names = (["first"] if block == 0 else []) + (["last"] if block == last else [])
            return [f"{phase}_{n}" for n in names or ["mid"]]

        def on_grad(p: torch.Tensor) -> None:
            counter.retag(p.grad, "gradients")

        def on_hidden_grad(_g: torch.Tensor) -> None:
            counter.tag = "backward_temporaries"

        def decoder_post(_module: torch.nn.Module, _args: tuple, out: Any) -> None:
            # From the decoder's last hidden state on: the head and the loss.
            counter.tag = "logits_and_loss"
            counter.set_segment("head")
            hidden = out.last_hidden_state
            if hidden.requires_grad:
                hidden.register_hook(on_hidden_grad)

        def layer_hooks(i: int, layer: torch.nn.Module) -> list[Any]:
            def pre(_m: torch.nn.Module, _args: tuple) -> None:
                if counter.phase == "forward":
                    counter.set_segment(*block_names(i, "fwd"))

            def post(_m: torch.nn.Module, _args: tuple, out: Any) -> None:
                hidden = out[0] if isinstance(out, tuple) else out
                if counter.phase == "forward" and torch.is_tensor(hidden) and hidden.requires_grad:
                    # Fires when backward reaches this layer (its output's gradient is ready).
                    hidden.register_hook(lambda _g: counter.set_segment(*block_names(i, "bwd")))

            return [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]

        handles = [p.register_post_accumulate_grad_hook(on_grad) for p in trainable]
        handles.append(decoder_of(model).register_forward_hook(decoder_post))
        for i, layer in enumerate(layers or []):
            handles += layer_hooks(i, layer)

        autocast = (
            torch.autocast("cpu", dtype=torch.bfloat16 if s.precision == "bf16" else torch.float16)
            if s.precision in ("bf16", "fp16")
            else nullcontext()
        )
        with _hooks(handles), counter:
            counter.phase, counter.tag = "forward", "activations"
            counter.extra_bytes = plan.always_extra + plan.fwd_bwd_extra
            counter.set_segment("pre")
            with autocast, CudaKernels() if s.device == "cuda" else nullcontext():
                step_loss = step_module(**batch).reshape(-1)[0]  # preference: [loss, *statistics]
                if s.precision == "fp16":
                    step_loss = step_loss * 65536.0  # GradScaler's scaled loss: a scalar
            counter.phase = "backward"
            counter.extra_bytes = plan.always_extra + plan.fwd_bwd_extra + plan.bwd_extra
            counter.set_segment("loss_bwd")
            step_loss.backward()
            del step_loss
            counter.phase, counter.tag = "optimizer_step", "optimizer_step_temporaries"
            counter.extra_bytes = plan.always_extra
            counter.set_segment("step")
            opt.step()
            opt.zero_grad(set_to_none=True)
    overhead = 0
    if s.device == "cuda":
        reserved, allocated = reserved_peak(counter.events, expandable_segments=s.expandable_segments)
        overhead = reserved - allocated
    return _Trace(counter.segments, totals, counter.total_work(), counter.work["step"], overhead)


def _extrapolate(a: _Trace, la: int, b: _Trace, lb: int, layers: int, cuda: bool) -> _Trace:
    """Every segment's peak is affine in the layer count (each layer adds the same weights,
    states and kept activations), so two traces fix it. Middle layers are skipped: their
    peaks lie between the first and last layer's."""

    def line(x: float, y: float) -> int:
        return int(round(x + (y - x) * (layers - la) / (lb - la)))

    segments = {}
    for name in a.segments.keys() & b.segments.keys():
        if name.endswith("_mid"):
            continue
        sa, sb = a.segments[name], b.segments[name]
        tags = sa.by_tag.keys() | sb.by_tag.keys()
        by_tag = {t: line(sa.by_tag.get(t, 0), sb.by_tag.get(t, 0)) for t in tags}
        segments[name] = _SegmentPeak(line(sa.bytes, sb.bytes), by_tag, sa.phase)
    totals = {k: line(a.totals[k], b.totals[k]) for k in a.totals}
    x = (layers - la) / (lb - la)
    work, update = a.work + (b.work - a.work) * x, a.optimizer_work + (b.optimizer_work - a.optimizer_work) * x
    # Rounding to allocator pages and fragmentation are not a per-layer cost: the larger of the two, plus
    # one large-pool page for the rounding of the extrapolated peak (CUDA's caching allocator; a CPU has none).
    overhead = max(a.reserved_overhead, b.reserved_overhead) + (LARGE_BUFFER if cuda else 0)
    return _Trace(segments, totals, work, update, overhead)


def _combine(plus: list[_Trace], minus: list[_Trace]) -> _Trace:
    """Segment by segment, tag by tag: the sum of `plus` less the sum of `minus` (segments all of them have)."""
    signs = [(t, 1) for t in plus] + [(t, -1) for t in minus]
    names = set.intersection(*(set(t.segments) for t, _ in signs))
    segments = {}
    for name in names:
        parts = [(t.segments[name], sign) for t, sign in signs]
        tags = set().union(*(p.by_tag for p, _ in parts))
        by_tag = {tag: sum(sign * p.by_tag.get(tag, 0) for p, sign in parts) for tag in tags}
        segments[name] = _SegmentPeak(sum(sign * p.bytes for p, sign in parts), by_tag, parts[0][0].phase)
    work, update = Work(), Work()
    for t, sign in signs:
        work, update = work + t.work * sign, update + t.optimizer_work * sign
    totals = {k: sum(sign * t.totals[k] for t, sign in signs) for k in plus[0].totals}
    return _Trace(segments, totals, work, update, max(t.reserved_overhead for t in plus))


# Traces by (config, layers, settings, period): the planner asks for the same traces again and again (every
# k-th layer checkpointed is composed from the traces of none and of every layer).
_TRACES: dict[tuple, _Trace] = {}
# Why forked traces failed in this process, once they have (then every trace runs in the process itself).
_FORK_REFUSED: list[str] = []


def _cached_trace(config: Any, layers: int, s: _Settings, period: int) -> _Trace:
    key = (config.to_json_string(use_diff=False), layers, s, period)
    if key not in _TRACES:
        if len(_TRACES) >= 64:
            _TRACES.clear()
        _TRACES[key] = _trace_step(_with_layers(config, layers), s, period)
    return _TRACES[key]


def _traces_needed(config: Any, s: _Settings, max_traced_layers: int) -> tuple[str, list[tuple[int, _Settings]]]:
    """How the step of `config` is traced: whole when short; else at 1 and 2 layer-kind periods, extrapolated
    linearly in the layer count; every k-th layer of a deep model recomputed, from the traces of none and of
    every layer (`_assemble`). Returns the kind and the (layers, settings) traces it takes."""
    layers, period = int(config.num_hidden_layers), _layer_period(config)
    if layers <= max_traced_layers * period or layers % period:
        return "whole", [(layers, s)]
    short = (period, 2 * period)
    if 0 < checkpointed_layers(s.checkpointing.every_n_layers, layers) < layers:
        every = replace(s, checkpointing=replace(s.checkpointing, every_n_layers=1))
        none = replace(s, checkpointing=Checkpointing(0))
        return "partial", [(n, every) for n in short] + [(n, none) for n in short]
    return "extrapolated", [(n, s) for n in short]


def _assemble(kind: str, traces: list[_Trace], config: Any, s: _Settings) -> _Trace:
    layers, p, cuda = int(config.num_hidden_layers), _layer_period(config), s.device == "cuda"
    if kind == "whole":
        return traces[0]
    if kind == "extrapolated":
        return _extrapolate(traces[0], p, traces[1], 2 * p, layers, cuda)
    # Every k-th layer recomputed: per layer, the memory and the work of a recomputed layer and of a kept one are
    # affine in the number of each, so the step is every layer recomputed at `recomputed` layers, plus none at
    # `layers`, less none at `recomputed`. The recomputation of the last recomputed layer is thereby counted as if
    # every layer's activations were kept meanwhile, which over-states the peak by a part of one layer's
    # activations (2.1-2.4% on a 6-layer model; tests/test_memory.py bounds it).
    fa, fb, na, nb = traces
    recomputed = checkpointed_layers(s.checkpointing.every_n_layers, layers)
    return _combine(
        [_extrapolate(fa, p, fb, 2 * p, recomputed, cuda), _extrapolate(na, p, nb, 2 * p, layers, cuda)],
        [_extrapolate(na, p, nb, 2 * p, recomputed, cuda)],
    )


def _trace_job(config: Any, layers: int, s: _Settings, period: int) -> _Trace:
    torch.set_num_threads(1)  # in a forked worker: fake tensors compute nothing, and OpenMP's pool is the parent's
    return _trace_step(_with_layers(config, layers), s, period)


def _prefetch(config: Any, jobs: list[tuple[int, _Settings]]) -> None:
    """Trace what `jobs` need and the cache lacks, in parallel over the CPU cores when there are several: traces
    are independent and each is seconds of Python on a deep model (fork: the workers inherit the imports)."""
    import multiprocessing as mp
    import os

    period = _layer_period(config)
    text = config.to_json_string(use_diff=False)
    missing = list(dict.fromkeys((n, s) for n, s in jobs if (text, n, s, period) not in _TRACES))
    workers = min(len(missing), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    if workers < 2 or mp.current_process().daemon or "fork" not in mp.get_all_start_methods() or _FORK_REFUSED:
        return
    if len(_TRACES) + len(missing) > 64:
        _TRACES.clear()
    if not FakeTensorMode.cache:
        # The first trace in a process fills FakeTensorMode's dispatch cache (a class attribute, ~0.5 s on a deep
        # model): done here once, the workers inherit it instead of each filling its own.
        n, s = missing.pop(0)
        _cached_trace(config, n, s, period)
        if len(missing) < 2:
            return
        workers = min(workers, len(missing))
    try:
        with mp.get_context("fork").Pool(workers) as pool:
            done = pool.starmap(_trace_job, [(config, n, s, period) for n, s in missing])
    except RuntimeError as err:
        # torch 2.11 refuses autograd in a child forked after the parent ran a backward ("Unable to handle
        # autograd's threading in combination with fork-based multiprocessing"; 2.13 allows it on a CPU): the
        # traces then run in this process (the caller's), and no later plan forks again.
        log.debug("traces run in one process: %s", err)
        _FORK_REFUSED.append(str(err))
        return
    _TRACES.update({(text, n, s, period): t for (n, s), t in zip(missing, done, strict=True)})


def estimate(config: Any, *, max_traced_layers: int = 4, **settings: Any) -> MemoryEstimate:
    """Peak bytes of a steady-state training micro-step of `config` on one process, with `settings` as
    `settings_of` takes them (micro_batch_size, seq_len, precision, gradient_checkpointing, ...).

    Models with more than `max_traced_layers` layers (in units of the layer-kind period) are
    traced at 1 and 2 periods and extrapolated linearly in the layer count."""
    return estimate_all(config, [settings], max_traced_layers)[0]


def settings_of(
    config: Any,
    *,
    micro_batch_size: int,
    seq_len: int,
    precision: str,
    gradient_checkpointing: bool | Checkpointing,
    layout: str = "packed",
    attn_implementation: str = "sdpa",
    optimizer: str = "adamw",
    loss: str = "hf",
    chunk_size: int | None = None,
    lora: LoraSpec | None = None,
    num_processes: int = 1,
    sharding: str = "none",
    device: str = "cuda",
    grad_accum_steps: int = 1,
    ddp_bucket_view: bool = False,
    trained_fraction: float = 1.0,
    expandable_segments: bool = True,
    objective: str = "sft",
    reference: str = "none",
) -> _Settings:
    """The settings of an estimate, checked. The step: forward on `micro_batch_size` x `seq_len` tokens laid out
    as `layout` (packed or padded rows, only the loss kept), backward, optimizer step,
    `zero_grad(set_to_none=True)`. With `grad_accum_steps > 1` the previous micro-steps' gradients are alive
    during forward and backward.
    `num_processes`/`sharding` divide the sharded states; `"none"` with several processes is
    DDP with its gradient buckets unless `ddp_bucket_view` (gradient_as_bucket_view=True).
    `gradient_checkpointing`: a `Checkpointing` (every k-th layer, selective), or a bool for every layer / none.
    `objective` other than "sft" traces `llmtune.preference.PreferenceModel` on pairs (`micro_batch_size`
    examples, each a pair), with its `reference` forward (adapter_disabled, a frozen copy) or none.
    """
    if micro_batch_size < 1 or seq_len < 2:
        raise ValueError("micro_batch_size must be >= 1 and seq_len >= 2")
    if not 0 < trained_fraction <= 1:
        raise ValueError(f"trained_fraction={trained_fraction}; expected 0 < f <= 1")
    s = _Settings(
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        layout=layout,
        precision=precision,
        checkpointing=checkpointing_of(gradient_checkpointing),
        attn_implementation=attn_implementation,
        optimizer=optimizer,
        loss=loss,
        chunk_size=chunk_size or default_chunk_size(getattr(config, "text_config", config).vocab_size),
        lora=lora,
        num_processes=num_processes,
        sharding=sharding,
        device=device,
        grad_accum_steps=grad_accum_steps,
        ddp_bucket_view=ddp_bucket_view,
        trained_fraction=trained_fraction,
        expandable_segments=expandable_segments,
        objective=objective,
        reference=reference,
    )
    _validate(s)
    return s


def estimate_all(config: Any, settings: list[dict[str, Any]], max_traced_layers: int = 4) -> list[MemoryEstimate]:
    """`estimate` of each of `settings` (keyword arguments of `settings_of`), their traces run in parallel."""
    plans = []
    for kwargs in settings:
        s = settings_of(config, **kwargs)
        plans.append((s, *_traces_needed(config, s, max_traced_layers)))
    _prefetch(config, [job for _, _, jobs in plans for job in jobs])
    period = _layer_period(config)
    return [
        _result(_assemble(kind, [_cached_trace(config, n, x, period) for n, x in jobs], config, s), s, config, jobs)
        for s, kind, jobs in plans
    ]


def _result(trace: _Trace, s: _Settings, config: Any, jobs: list[tuple[int, _Settings]]) -> MemoryEstimate:
    layers = int(config.num_hidden_layers)
    traced = sorted({n for n, _ in jobs})

    name, top = max(trace.segments.items(), key=lambda kv: kv[1].bytes)
    breakdown = dict(sorted(top.by_tag.items(), key=lambda kv: -kv[1]))
    drift = top.bytes - sum(breakdown.values())  # rounding of scaled tags; keep parts summing up
    if drift and breakdown:
        breakdown[next(iter(breakdown))] += drift
    settings = asdict(s)
    settings["layers"] = layers
    settings["traced_layers"] = traced
    settings["peak_segment"] = name
    return MemoryEstimate(
        breakdown=breakdown,
        peak_bytes=top.bytes,
        peak_phase=top.phase,
        reserved_bytes=top.bytes + trace.reserved_overhead,
        totals=trace.totals,
        settings=settings,
        work=trace.work,
        optimizer_work=trace.optimizer_work,
        segment_peaks={name: seg.by_tag for name, seg in trace.segments.items()},
    )


__all__ = ["LoraSpec", "MemoryEstimate", "estimate", "estimate_all", "settings_of"]
