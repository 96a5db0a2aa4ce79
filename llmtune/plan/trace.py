"""One steady-state training step run on fake tensors, and what it keeps: each segment's peak, by tag.

The step is the one `llmtune.plan.step` builds (the model, its module, the optimizer, a micro-batch); a
`TraceCounter` follows every storage while it runs forward, backward and the optimizer step, and hooks on the
decoder's layers tell it which segment of the step it is in (embedding, each layer's forward and backward, head and
loss, optimizer step), so that a trace of a few layers can be extrapolated to many (`llmtune.plan.extrapolate`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from llmtune.model.attention import attention_for
from llmtune.model.blocks import apply_checkpointing
from llmtune.model.experts import experts_implementation_of
from llmtune.model.tiling import tile_mlp
from llmtune.objectives import Objective
from llmtune.ops.loss import decoder_of
from llmtune.parallel.sequence import ULYSSES, planned_degree
from llmtune.plan.allocator import reserved_peak
from llmtune.plan.counter import SegmentPeak, TraceCounter
from llmtune.plan.kernels import CudaKernels, GroupedMmKernel, parameter_count
from llmtune.plan.offload import count_saved_inputs, offload_saved_inputs
from llmtune.plan.settings import Settings
from llmtune.plan.sharding import ModelBytes, Sharding, sharding_plan
from llmtune.plan.step import build_model, micro_batch, objective_of, step_module, step_optimizer
from llmtune.plan.timing import Work

_CUDA_BLOCK = 512  # bytes; the CUDA caching allocator rounds every block up to this


@dataclass
class Trace:
    """What a traced step kept (each segment's peak, the model states' full sizes) and computed."""

    segments: dict[str, SegmentPeak]
    totals: dict[str, int]
    work: Work
    optimizer_work: Work
    reserved_overhead: int = 0  # what the CUDA caching allocator reserves beyond the peak of live blocks


def trace_step(config: Any, s: Settings, period: int) -> Trace:
    """Run one steady-state training step of `config` on fake tensors and record segment peaks."""
    s = replace(s, attn_implementation=_attention_of(config, s))
    fa2 = s.attn_implementation == "flash_attention_2"
    objective = objective_of(s)
    inputs = micro_batch(objective, s)
    # As one process of a sequence group: each all-to-all a buffer of its output's shape (llmtune.parallel.sequence).
    # Below the counter, which counts what the stand-in makes as the grouped matmul's output.
    experts = experts_implementation_of(config, s.experts_implementation)
    grouped_mm = GroupedMmKernel() if experts == "grouped_mm" else nullcontext()
    with (
        FakeTensorMode() as fake,
        grouped_mm,
        _no_packed_mask() if fa2 else nullcontext(),
        planned_degree(s.sequence_parallel),
    ):
        model, module, opt = _steady_state(config, objective, s)
        trainable = [p for p in model.parameters() if p.requires_grad]
        layers = _decoder_layers(model)
        plan = _sharding_of(model, layers, trainable, s)
        state_tensors = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
        totals = {
            "parameters": parameter_count(model),
            "trainable_parameters": sum(p.numel() for p in trainable),
            "weights": _nbytes(model.parameters()) + _nbytes(model.buffers()),  # buffers: rotary tables, 4-bit state
            "gradients": _nbytes(trainable),
            "optimizer_states": _nbytes(state_tensors),
        }
        counter = _counter(model, plan, s)
        batch = {k: _fake_input(fake, k, v) for k, v in inputs.items()}
        _register_states(counter, model, module, state_tensors, batch, s)
        handles = _segment_hooks(counter, model, trainable, layers or [], period)
        with _hooks(handles), counter, _counted_rng_states(counter) if s.device == "cpu" else nullcontext():
            _run_step(counter, module, opt, batch, plan, s)
    overhead = 0
    if s.device == "cuda":
        reserved, allocated = reserved_peak(counter.events, expandable_segments=s.expandable_segments)
        overhead = reserved - allocated
    return Trace(counter.segments, totals, counter.total_work(), counter.work["step"], overhead)


def _attention_of(config: Any, s: Settings) -> str:
    """The attention a run loads for these settings: a sequence shard's, all-to-all'd to whole rows (`ULYSSES`);
    else packed rows' each document alone (`llmtune.model.attention.attention_for`)."""
    if s.sequence_parallel > 1:
        return ULYSSES
    return attention_for(s.attn_implementation, packed=s.layout == "packed", objective=s.objective, config=config)


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The model's stack of decoder layers: its longest ModuleList."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return max(lists, key=len, default=None)


def _steady_state(
    config: Any, objective: Objective, s: Settings
) -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer]:
    """The model, the module the loop trains and the optimizer, with the optimizer's states already there."""
    model = build_model(config, s)
    # A checkpointed block recomputes its forward in backward: with CUDA's kernels too. Offloading is traced
    # by hooks of our own (`offload_saved_inputs`): transformers' would copy fake tensors to pinned memory.
    recompute = functools.partial(CudaKernels, _sdpa_capability(s)) if s.device == "cuda" else None
    apply_checkpointing(model, replace(s.checkpointing, offload=False), recompute=recompute)
    if s.tiled_mlp:  # after checkpointing, as `llmtune.run.parallelize.adapt` tiles them: inside the recomputed layers
        tile_mlp(model)
    model.train()
    # The module the training loop runs (and refuses what it refuses, with the same message).
    module = step_module(config, model, objective, s)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = step_optimizer(trainable, s)
    # Steady state: AdamW creates its states at the first step(), so make them exist now
    # (zero grads + one untracked step) instead of tracing a whole first step.
    for p in trainable:
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=s.grad_accum_steps == 1)
    return model, module, opt


def _sdpa_capability(s: Settings) -> tuple[int, int] | None:
    """The card's compute capability as torch's SDPA rules read it; flash-attention-2 (which SDPA's flash kernel
    stands in for) has rules of its own, and runs its backward on consumer cards at any head dim up to 256."""
    return None if s.attn_implementation == "flash_attention_2" else s.compute_capability


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _sharding_of(
    model: torch.nn.Module, layers: torch.nn.ModuleList | None, trainable: list[torch.nn.Parameter], s: Settings
) -> Sharding:
    """The sharding plan, sized by the model's and its layers' weights and gradients."""
    layers = list(layers or [])
    model_bytes = _nbytes(model.parameters())
    return sharding_plan(
        s,
        ModelBytes(
            weights=model_bytes,
            trainable=_nbytes(trainable),
            layers=len(layers),
            layer=max((_nbytes(m.parameters()) for m in layers), default=0),
            layer_grads=max((_nbytes(p for p in m.parameters() if p.requires_grad) for m in layers), default=0),
            root=model_bytes - sum(_nbytes(m.parameters()) for m in layers),
        ),
    )


def _counter(model: torch.nn.Module, plan: Sharding, s: Settings) -> TraceCounter:
    """The counter, with the sharded tags' scales and the checkpoints' saved-tensor hooks."""
    chunk_rows = s.chunk_size if s.objective == "sft" else None
    counter = TraceCounter(
        s.trained_fraction, chunk_rows, s.checkpointing.selective, round_to=_CUDA_BLOCK if s.device == "cuda" else 1
    )
    for tag, factor in plan.scale.items():
        counter.set_scale(tag, factor)
    if s.checkpointing.offload:
        offload_saved_inputs(model, counter)
    elif s.checkpointing.enabled:
        count_saved_inputs(model, counter)
    return counter


def _register_states(
    counter: TraceCounter,
    model: torch.nn.Module,
    module: torch.nn.Module,
    state_tensors: list[torch.Tensor],
    batch: dict[str, torch.Tensor],
    s: Settings,
) -> None:
    """Count what lives before the step (weights, gradients, optimizer states) and the micro-batch, its `loss_rows`
    sized for the data here. The order is the allocator model's order of allocations (`allocator.reserved_peak`)."""
    for p in model.parameters():
        counter.register(p, "weights")
        if p.grad is not None:
            counter.register(p.grad, "gradients")
    for b in model.buffers():
        counter.register(b, "weights")
    if s.reference == "copy":  # the frozen copy PreferenceModel keeps outside its parameters
        for w in module._reference_model[0].state_dict().values():
            counter.register(w, "reference_weights")
    for v in state_tensors:
        counter.register(v, "optimizer_states")
    if "loss_rows" in batch:  # its length is the data's: the trained share of the rows (`TraceCounter.trained_rows`)
        batch["loss_rows"] = counter.trained_rows(batch["input_ids"])  # as many positions as the labels
    for v in batch.values():
        if isinstance(v, torch.Tensor):
            counter.register(v, "inputs")


def _fake_input(fake: FakeTensorMode, key: str, value: Any) -> Any:
    """A micro-batch's value as the traced step takes it: tensors fake; a packed batch's document offsets fake with
    their values (a CPU's per-document attention reads them on the host, `llmtune.model.attention`); its lengths (ints)
    as they are."""
    if not isinstance(value, torch.Tensor):
        return value
    if key.startswith("cu_seq_lens"):
        return fake.fake_tensor_converter.from_real_tensor(fake, value, make_constant=True)
    return fake.from_tensor(value)


def _segment_hooks(
    counter: TraceCounter,
    model: torch.nn.Module,
    trainable: list[torch.nn.Parameter],
    layers: torch.nn.ModuleList | list,
    period: int,
) -> list[Any]:
    """Hooks that move the counter from segment to segment and retag what backward makes."""

    def block_names(i: int, phase: str) -> list[str]:
        block, last = i // period, (len(layers) - 1) // period
        names = (["first"] if block == 0 else []) + (["last"] if block == last else [])
        return [f"{phase}_{n}" for n in names or ["mid"]]

    def on_grad(p: torch.Tensor) -> None:
        counter.retag(p.grad, "gradients")

    def on_hidden_grad(_g: torch.Tensor) -> None:
        counter.tag = "backward_temporaries"

    def decoder_pre(_module: torch.nn.Module, _args: tuple) -> None:
        # A module that runs the decoder twice (a reference forward first: dpo, grpo) keeps the policy's activations
        # as activations, not under the tag the reference's head left.
        if counter.phase == "forward":
            counter.tag = "activations"

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
    handles += [
        decoder_of(model).register_forward_pre_hook(decoder_pre),
        decoder_of(model).register_forward_hook(decoder_post),
    ]
    for i, layer in enumerate(layers):
        handles += layer_hooks(i, layer)
    return handles


def _run_step(
    counter: TraceCounter,
    module: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    plan: Sharding,
    s: Settings,
) -> None:
    """Forward, backward and the optimizer step, each in its phase with the sharding buffers it holds."""
    autocast = (
        torch.autocast("cpu", dtype=torch.bfloat16 if s.precision == "bf16" else torch.float16)
        if s.precision in ("bf16", "fp16") and not s.sharded_16bit
        else nullcontext()
    )
    counter.phase, counter.tag = "forward", "activations"
    counter.extra_bytes = plan.always_extra + plan.fwd_bwd_extra
    counter.set_segment("pre")
    with autocast, CudaKernels(_sdpa_capability(s)) if s.device == "cuda" else nullcontext():
        step_loss = module(**batch).reshape(-1)[0]  # preference: [loss, *statistics]
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


@contextmanager
def _no_packed_mask() -> Iterator[None]:
    """flash-attention-2 stands in as SDPA without a mask (see `step.build_model`). transformers' mask builder
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
def _counted_rng_states(counter: TraceCounter) -> Iterator[None]:
    """Checkpointing keeps the CPU generator's state (5056 bytes) from each checkpointed call to its recomputation.
    `torch.get_rng_state` makes it outside the dispatcher, where the counter does not see it: counted here. Only
    on a CPU device: on a GPU it is host memory, beside the device's own state (also kept on the host)."""
    original = torch.get_rng_state

    def counted() -> torch.Tensor:
        state = original()
        counter.register(state)
        return state

    torch.get_rng_state = counted
    try:
        yield
    finally:
        torch.get_rng_state = original


@contextmanager
def _hooks(handles: list[Any]) -> Iterator[None]:
    try:
        yield
    finally:
        for h in handles:
            h.remove()
