"""Causal-LM loss without the full N x V fp32 logits.

HF's causal-LM loss materialises the logits in the compute dtype, upcasts them to fp32 and runs
`cross_entropy`; its backward peaks at ~12*N*V bytes (N tokens, V vocab), which for small models or
with gradient checkpointing is often the step's memory peak (see shared/notes/memory-facts.md).

`chunked_cross_entropy` computes the same SUM of token losses chunk by chunk. In forward it also
computes the gradients w.r.t. hidden states, lm_head weight and bias (Liger-style), so backward only
scales them by `grad_output`: no recompute, and the logits of at most one chunk are alive at a time.
A peft LoRA on the lm_head is computed as peft computes it (`head_lora`), its low-rank term added per chunk.
Extra memory: N*h (grad of hidden) + V*h fp32 (grad of weight, only when it requires grad) + about
4*chunk*V bytes of per-chunk scratch in fp32 (one fp32 buffer, worked in place), 8*chunk*V in bf16; with a LoRA'd
head also N*r (grad of u) + V*r fp32 (grad of lora_B) and one chunk x V buffer for its term.

`CausalLMWithLoss` wraps a HF causal LM (or a peft model around one) so that DDP/FSDP can wrap one
module whose forward returns the loss.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

logger = logging.getLogger(__name__)

LossImpl = Literal["hf", "chunked"]

# Model types whose ForCausalLM forward is `lm_head(last_hidden_state)` followed by transformers'
# ForCausalLMLoss (checked against transformers 5.24), or one of the logit transforms the chunked
# path reproduces (`logit_transform`). `auto` picks chunked only for these.
_PLAIN_MODEL_TYPES = frozenset(
    {
        "llama",
        "mistral",
        "mixtral",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "gpt2",
        "gpt_neox",
        "gptj",
        "phi",
        "phi3",
        "gemma",
        "gemma2",
        "gemma3_text",
        "olmo",
        "olmo2",
        "stablelm",
        "starcoder2",
        "smollm3",
        "cohere",
        "cohere2",
        "granite",
        "granitemoe",
        "opt",
    }
)

# Config attributes that change the logits (or the loss) in a way the chunked path does not reproduce.
_UNSUPPORTED_ATTRS = {
    "lm_head_multiplier": "Falcon-H1 style lm_head multiplier",
    "logit_scale_factor": "learned logit scale",
    "output_multiplier_scale": "output multiplier",
}


def text_config(config: Any) -> Any:
    """The decoder's config: multimodal configs nest it under `text_config`."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def logit_transform(config: Any) -> tuple[float, float | None]:
    """(scale, softcap) such that HF's logits are `softcap * tanh(scale * z / softcap)` (no softcap: `scale * z`).

    Covers Cohere (`logit_scale`, a multiplier), Granite (`logits_scaling`, a divisor) and Gemma 2/3
    (`final_logit_softcapping`). Raises ValueError for transforms the chunked path does not do.
    """
    cfg = text_config(config)
    problems = [f"{name} ({what})" for name, what in _UNSUPPORTED_ATTRS.items() if getattr(cfg, name, None)]
    if getattr(cfg, "output_router_logits", False):
        problems.append("output_router_logits (the MoE auxiliary loss is added to HF's loss)")
    if problems:
        raise ValueError(
            f"loss_impl='chunked' does not reproduce this model's loss ({cfg.model_type}): "
            + ", ".join(problems)
            + "; use loss_impl='hf' (or 'auto')."
        )
    scale = 1.0
    if getattr(cfg, "logit_scale", None) is not None:
        scale *= float(cfg.logit_scale)
    if getattr(cfg, "logits_scaling", None) is not None:
        scale /= float(cfg.logits_scaling)
    softcap = getattr(cfg, "final_logit_softcapping", None)
    return scale, (float(softcap) if softcap else None)


def default_chunk_size(vocab_size: int) -> int:
    """Token rows per loss chunk on a CPU: ~8 Mi logits (32 MiB in fp32) per chunk, kept between 128 and 1024 rows.

    At vocab 32000 that is 262 rows; at 128256, 128. Sizing chunks by bytes rather than a fixed 1024 rows
    halves the loss buffers at vocab 32000 and costs no speed against HF's loss (benchmarks/loss.py;
    figures in benchmarks/results/measurements.md): a CPU reads a weight as fast as it multiplies it.
    """
    return max(128, min(1024, 2**23 // vocab_size))


# A GPU chunk has at least this many rows: fewer leave its matmuls (rows x h by h x V) short of full tensor-core tiles
# and multiply the chunks' launches; a card whose figures ask for more gets more (`chunk_rows`).
GPU_MIN_CHUNK_ROWS = 1024
# What a chunk row costs in scratch per vocabulary entry, in bytes: its fp32 logits (4), the 16-bit matmul output they
# are upcast from and the 16-bit gradient they are cast back to (2 + 2).
CHUNK_SCRATCH_BYTES = 8
# The share of the memory budget a chunk's scratch may take: the rest is the step's (weights, states, activations).
CHUNK_BUDGET_SHARE = 16


def chunk_rows(
    vocab_size: int, *, device: str, flops_per_byte: float | None = None, budget_bytes: int | None = None
) -> int:
    """Token rows per loss chunk on `device` ("cuda" or "cpu"): what the planner plans and the loss runs.

    Every chunk reads the V x h head weight twice (its logits, the hidden states' gradient) and reads and writes the
    V x h fp32 weight gradient once (8 bytes an element), each for 2 x rows FLOPs an element: the weight gradient's
    matmul is compute-bound from rows = 4 x FLOP/s over bytes/s on. On a GPU (`flops_per_byte`: its 16-bit
    tensor-core peak over its memory bandwidth; None for a card not known) the rows are that, rounded up to a power
    of two, at least `GPU_MIN_CHUNK_ROWS`; then halved while the chunk's scratch (`CHUNK_SCRATCH_BYTES` x rows x V)
    is over 1/`CHUNK_BUDGET_SHARE` of `budget_bytes` (None: not capped). On an H100 (989.5 TFLOP/s, 3.35 TB/s) that
    is 2048 rows, on an H200 (4.8 TB/s) 1024. A CPU has no such gap (`default_chunk_size`).
    """
    if device != "cuda":
        return default_chunk_size(vocab_size)
    rows = max(GPU_MIN_CHUNK_ROWS, 1 << max(0, math.ceil(4 * (flops_per_byte or 0.0)) - 1).bit_length())
    if budget_bytes is not None:
        while rows > 1 and CHUNK_BUDGET_SHARE * CHUNK_SCRATCH_BYTES * rows * vocab_size > budget_bytes:
            rows //= 2
    return rows


def loss_rows(labels: Tensor, ignore_index: int = -100) -> Tensor:
    """Flat indices of the positions of `labels` [rows, width] whose NEXT token is trained: the rows of the flattened
    hidden states the chunked paths compute (hidden[t] predicts labels[t + 1]). `nonzero` waits for the device that
    holds `labels`: collation computes them on the host, where they cost nothing, and the batch carries them."""
    return trained_rows(F.pad(labels, (0, 1), value=ignore_index)[..., 1:].reshape(-1), ignore_index)


def trained_rows(targets: Tensor, ignore_index: int = -100) -> Tensor:
    """Indices of the entries of `targets` [N] that are not `ignore_index`, in order: a host sync where `targets` is
    on a GPU (`loss_rows`)."""
    return (targets != ignore_index).nonzero().squeeze(1)


def resolve_loss_impl(requested: Literal["auto", "hf", "chunked"], config: Any) -> LossImpl:
    """Pick the loss implementation for a model config.

    `auto` -> `chunked` for model types known to compute plain (or reproducible) logits, `hf`
    otherwise. Requesting `chunked` for a config whose logit transform the chunked path does not
    reproduce raises ValueError; for an unknown model type it is allowed with a warning.
    """
    if requested not in ("auto", "hf", "chunked"):
        raise ValueError(f"loss_impl must be 'auto', 'hf' or 'chunked', got {requested!r}")
    if requested == "hf":
        return "hf"
    model_type = getattr(text_config(config), "model_type", None)
    try:
        logit_transform(config)
    except ValueError:
        if requested == "chunked":
            raise
        return "hf"
    if model_type not in _PLAIN_MODEL_TYPES:
        if requested == "auto":
            logger.info("loss_impl=auto: model type %r not verified for the chunked loss, using hf", model_type)
            return "hf"
        logger.warning(
            "loss_impl=chunked for model type %r, not verified against HF's loss: make sure its logits are "
            "lm_head(last_hidden_state)",
            model_type,
        )
    return "chunked"


class LowRank(NamedTuple):
    """A low-rank term of the logits, `scaling * u @ weight.T`: a peft LoRA on the lm_head. u [N, r] is
    lora_A(dropout(hidden)), computed by the adapter's own modules (autograd carries u's gradient back to them);
    weight is lora_B's [V, r]."""

    u: Tensor
    weight: Tensor
    scaling: float


@dataclass(frozen=True)
class ChunkSettings:
    """How the chunked paths compute a chunk's logits: `chunk_logits`' scale and softcap, the matmuls' dtypes (the
    autocast dtype when autocast is on, as the model's modules would run them) and the low-rank term's scaling."""

    chunk_size: int
    compute_dtype: torch.dtype
    scale: float = 1.0
    softcap: float | None = None
    lora_dtype: torch.dtype | None = None
    lora_scaling: float = 1.0


class ChunkGrads:
    """Gradient buffers for the inputs of a chunked Function that need one: hidden and u in their own dtype, filled
    row by row; the head's parameters in fp32, summed over chunks whatever the compute dtype."""

    def __init__(self, need: tuple[bool, ...], hidden: Tensor, weight: Tensor, bias, u, lora_b) -> None:
        def fp32_zeros(t: Tensor) -> Tensor:
            return torch.zeros(t.shape, dtype=torch.float32, device=t.device)

        self.hidden = torch.zeros_like(hidden) if need[0] else None
        self.weight = fp32_zeros(weight) if need[1] else None
        self.bias = fp32_zeros(bias) if need[2] else None
        self.u = torch.zeros_like(u) if need[3] else None
        self.lora_b = fp32_zeros(lora_b) if need[4] else None

    def result(self, dtypes: tuple[torch.dtype | None, ...], grad_output: Tensor | None = None) -> tuple:
        """(hidden, weight, bias, u, lora_b), each times `grad_output` where given, in place (the buffers are ours
        alone: no V x h copy, no host sync to test for 1), and cast to `dtypes` (the inputs')."""
        out = []
        for grad, dtype in zip((self.hidden, self.weight, self.bias, self.u, self.lora_b), dtypes, strict=True):
            if grad is not None and grad_output is not None:
                grad.mul_(grad_output.to(grad.dtype))
            out.append(None if grad is None else grad.to(dtype))
        return tuple(out)


def dtypes_of(*tensors: Tensor | None) -> tuple[torch.dtype | None, ...]:
    return tuple(None if t is None else t.dtype for t in tensors)


class ChunkHead:
    """The lm_head's tensors cast once per pass, and what the chunked Functions do with them per chunk."""

    def __init__(self, weight: Tensor, bias: Tensor | None, lora_b: Tensor | None, settings: ChunkSettings) -> None:
        self.settings = settings
        self.w = weight.to(settings.compute_dtype)
        self.b = None if bias is None else bias.to(settings.compute_dtype)
        self.lora_b = None if lora_b is None else lora_b.to(settings.lora_dtype)

    def logits(self, h: Tensor, u: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """A chunk's fp32 logits and the tanh of its softcap (`chunk_logits`), from h (compute dtype) and u."""
        s = self.settings
        z = F.linear(h, self.w, self.b)
        if self.lora_b is not None:
            # peft's LoRA forward: the base output plus scaling * lora_B(u), summed in the promoted dtype and cast
            # back to the base output's; in place on the low-rank term's buffer where it has that dtype.
            low = F.linear(u.to(s.lora_dtype), self.lora_b).mul_(s.lora_scaling)
            z = low.add_(z) if low.dtype == torch.promote_types(low.dtype, z.dtype) else z + low
            z = z.to(s.compute_dtype)
        return chunk_logits(z, s.scale, s.softcap)

    def split(self, grad: Tensor, tanh: Tensor | None, grads: ChunkGrads) -> tuple[Tensor, Tensor | None]:
        """The fp32 gradient w.r.t. a chunk's logits carried back to the head's raw output (in place; consumes tanh)
        and cast to the two matmuls' dtypes; adds the bias' share. The caller drops `grad` before `accumulate`."""
        through_transform_(grad, tanh, self.settings.scale)
        if grads.bias is not None:
            grads.bias += grad.sum(0)
        grad_c = grad.to(self.settings.compute_dtype)
        # The low-rank term's share is rounded to the compute dtype too: its sum was cast to the base output's dtype.
        low_rank = grads.u is not None or grads.lora_b is not None
        return grad_c, grad_c.to(self.settings.lora_dtype) if low_rank else None

    def accumulate(self, grads: ChunkGrads, rows: Tensor | slice, h: Tensor, u, grad_c: Tensor, grad_l) -> None:
        """Adds one chunk's share to `grads`: the chunk is hidden[rows] (h, cast) and u[rows]."""
        s = self.settings
        if grads.hidden is not None:
            grads.hidden[rows] = (grad_c @ self.w).to(grads.hidden.dtype)
        if grads.weight is not None:  # the matmul in the compute dtype, like lm_head's backward, summed in fp32
            addmm_fp32_(grads.weight, grad_c.t(), h)
        if grads.u is not None:
            grads.u[rows] = (grad_l @ self.lora_b).mul_(s.lora_scaling).to(grads.u.dtype)
        if grads.lora_b is not None:
            addmm_fp32_(grads.lora_b, grad_l.t(), u.to(s.lora_dtype), alpha=s.lora_scaling)


def addmm_fp32_(acc: Tensor, a: Tensor, b: Tensor, alpha: float = 1.0) -> None:
    """acc += alpha * (a @ b) in place, acc fp32 (a gradient summed over chunks, V x h), a and b in the matmul's dtype,
    with no product of acc's size beside it: fp32 runs `addmm_`; 16-bit runs a GEMM that writes fp32 and adds into
    acc in its epilogue where the device has one (`_fp32_out_refusal`: cuBLAS); elsewhere (a CPU has none) the 16-bit
    product is made a block of acc's rows at a time, each block no larger than `a` (the chunk's gradient, already
    alive: the chunk's peak is not raised), and added. Which of the two a device takes: `head_accumulation`."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b, alpha=alpha)
    elif _fp32_out_refusal(acc.device) is None:
        torch.addmm(acc, a, b, out_dtype=torch.float32, alpha=alpha, out=acc)
    else:
        block = max(1, a.numel() // max(1, b.shape[1]))
        for start in range(0, acc.shape[0], block):
            acc[start : start + block].add_(a[start : start + block] @ b, alpha=alpha)


def head_accumulation(device: torch.device | str) -> str:
    """How the chunked loss sums a 16-bit lm_head's fp32 weight gradient over chunks on `device` (`addmm_fp32_`), in
    words: one GEMM writing fp32, or 16-bit products a block of rows at a time and why (`make gpu-check` reports it).
    The blocks sum the same products, more slowly; a run's set-up says which it takes (`runnable_impl`)."""
    why = _fp32_out_refusal(torch.device(device))
    if why is None:
        return "a GEMM accumulating into the fp32 gradient (torch.addmm out_dtype=float32)"
    return f"16-bit products a block of rows at a time, added to the fp32 gradient ({why})"


@functools.cache
def _say_head_accumulation(device: torch.device) -> None:
    """`head_accumulation` at INFO, once per device and process: at set-up, where a run's loss head is chosen."""
    logger.info("chunked loss on %s: 16-bit lm_head gradients summed by %s", device, head_accumulation(device))


@functools.cache
def _fp32_out_refusal(device: torch.device) -> str | None:
    """Why `device` does not run `torch.addmm(fp32, 16-bit, 16-bit, out_dtype=torch.float32)`; None where it does:
    CUDA from torch 2.8, where cuBLAS accumulates into the fp32 output, once torch takes an fp32 `self` beside 16-bit
    operands (the first releases' kernel refused it: "self and mat2 must have the same dtype", pytorch/pytorch#154086).
    Probed once on 1 x 1 tensors: the dtype checks refuse before any kernel runs, and nothing is read back."""
    if device.type != "cuda":
        return f"{device.type} has no fp32-output GEMM"
    one = torch.ones((1, 1), device=device)
    try:
        torch.addmm(one, one.bfloat16(), one.bfloat16(), out_dtype=torch.float32, out=one)
    except (RuntimeError, TypeError, NotImplementedError) as err:
        return f"torch {torch.__version__} refuses the fp32-output GEMM: {str(err).splitlines()[0]}"
    return None


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Sum of token cross-entropies; gradients are computed in forward and scaled in backward."""

    @staticmethod
    def forward(
        ctx: Any, hidden, weight, bias, lora_u, lora_b, labels, rows, settings: ChunkSettings, grad_enabled
    ) -> Tensor:
        # The arguments are `chunked_cross_entropy`'s, with whether gradients are wanted: needs_input_grad is True
        # under no_grad too, and evaluation must not pay for the gradients.
        need = tuple(grad_enabled and ctx.needs_input_grad[i] for i in range(5))
        grads = ChunkGrads(need, hidden, weight, bias, lora_u, lora_b)
        head = ChunkHead(weight, bias, lora_b, settings)
        # Only rows with a target cost anything: prompt-masked SFT batches skip their masked share of the three
        # N x V x h matmuls. `rows` came from the host (`loss_rows`): its length is known there, so neither the loop
        # nor any chunk waits for the device.
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)

        for start in range(0, rows.numel(), settings.chunk_size):
            idx = rows[start : start + settings.chunk_size]
            h = hidden.index_select(0, idx).to(settings.compute_dtype)
            u = None if lora_u is None else lora_u.index_select(0, idx)
            target = labels.index_select(0, idx)
            # All further work is in place on this one chunk x V fp32 buffer.
            z, tanh = head.logits(h, u)
            # Stable log-sum-exp in place: z <- exp(z - max), lse = max + log(sum).
            z_max = z.amax(dim=1, keepdim=True)
            z.sub_(z_max)
            target_logit = z.gather(1, target.unsqueeze(1))
            sum_exp = z.exp_().sum(dim=1, keepdim=True)
            loss += (sum_exp.log() - target_logit).sum()
            if not any(need):
                del z, tanh
                continue
            # d loss / d logits = softmax - onehot(target).
            grad = z.div_(sum_exp)
            grad.scatter_add_(1, target.unsqueeze(1), grad.new_full((idx.numel(), 1), -1.0))
            grad_c, grad_l = head.split(grad, tanh, grads)
            del grad, z, tanh  # the fp32 buffer goes before the matmuls where they run in a lower precision
            head.accumulate(grads, idx, h, u, grad_c, grad_l)
            del grad_c, grad_l  # before the next chunk's logits: one chunk x V buffer alive at a time

        # Kept on ctx rather than save_for_backward so backward can drop ctx's reference: a gradient
        # returned with no other owner becomes `.grad` as is, instead of AccumulateGrad copying V x h.
        ctx.grads = grads
        ctx.dtypes = dtypes_of(hidden, weight, bias, lora_u, lora_b)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        grads, ctx.grads = ctx.grads, None  # backward runs once: a second call raises instead of returning stale grads
        return *grads.result(ctx.dtypes, grad_output), None, None, None, None


def chunk_logits(z: Tensor, scale: float, softcap: float | None) -> tuple[Tensor, Tensor | None]:
    """fp32 logits of one chunk as the model computes them from its lm_head's output `z` (compute dtype): fp32, then
    its transform (`logit_transform`), in place on the one chunk x V fp32 buffer. Also the tanh of the softcap, which
    the gradient needs (`through_transform_`); None without one."""
    z = z.float()
    if scale != 1.0:
        z.mul_(scale)
    if softcap is None:
        return z, None
    tanh = z.div_(softcap).tanh_()
    return tanh * softcap, tanh


def through_transform_(grad: Tensor, tanh: Tensor | None, scale: float) -> None:
    """The gradient w.r.t. a chunk's logits (`grad`, in place) carried back through `chunk_logits`' transform to
    the lm_head's raw output. Consumes `tanh` (squared in place)."""
    if tanh is not None:
        grad.mul_(1.0 - tanh.square_())
    if scale != 1.0:
        grad.mul_(scale)


def matmul_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype lm_head's matmul runs in: the autocast dtype when autocast is on, else the inputs'."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def chunk_settings(
    hidden: Tensor, weight: Tensor, lora: LowRank | None, chunk_size: int, scale: float, softcap: float | None
) -> ChunkSettings:
    """The settings the chunked paths run a head with, taken where the model's own modules would run (autocast)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return ChunkSettings(
        chunk_size,
        matmul_dtype(hidden, weight),
        scale,
        softcap,
        None if lora is None else matmul_dtype(lora.u, lora.weight),
        1.0 if lora is None else float(lora.scaling),
    )


def chunked_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    rows: Tensor | None = None,
    bias: Tensor | None = None,
    lora: LowRank | None = None,
    chunk_size: int = 1024,
    ignore_index: int = -100,
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> Tensor:
    """SUM over non-ignored tokens of cross_entropy(hidden @ weight.T + bias, labels), as an fp32 scalar.

    Equal to `F.cross_entropy((hidden @ weight.T).float(), labels, reduction="sum")` without ever
    holding more than `chunk_size` rows of logits. The matmul runs in the autocast dtype when autocast
    is on (as the model's lm_head would), else in the inputs' dtype; softmax and the loss in fp32.
    `lora` adds its low-rank term to the lm_head's output as peft does. `logit_scale` multiplies the
    logits, then `softcap` applies `softcap * tanh(logits / softcap)`.

    hidden: [N, h]; weight: [V, h]; labels: [N] (int64); bias: [V] or None. `rows`: the indices of the labels that are
    not `ignore_index` (`trained_rows`), where the caller has them from the host; None: found here, which on a GPU
    waits for it.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or labels.dim() != 1 or hidden.shape[0] != labels.shape[0]:
        raise ValueError(
            f"expected hidden [N, h], weight [V, h], labels [N]; got {tuple(hidden.shape)}, "
            f"{tuple(weight.shape)}, {tuple(labels.shape)}"
        )
    settings = chunk_settings(hidden, weight, lora, chunk_size, logit_scale, softcap)
    u, lora_b = (None, None) if lora is None else (lora.u, lora.weight)
    rows = trained_rows(labels, ignore_index) if rows is None else rows
    # The Function casts explicitly; autocast must not re-cast its matmuls (or cast fp32 grads down).
    with torch.autocast(hidden.device.type, enabled=False):
        return _ChunkedCrossEntropy.apply(
            hidden, weight, bias, u, lora_b, labels.long(), rows, settings, torch.is_grad_enabled()
        )


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The HF base model (decoder) of a PreTrainedModel or of a peft model around one."""
    hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model
    return hf_model.get_decoder()


def decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The HF base model (decoder) and lm_head of a PreTrainedModel or a peft model around one."""
    hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = decoder_of(model)
    head = hf_model.get_output_embeddings()
    if decoder is None or head is None or decoder is hf_model:
        raise ValueError(f"{type(hf_model).__name__} has no decoder / output embeddings for the chunked loss")
    return decoder, head


def head_refusal(model: torch.nn.Module) -> str | None:
    """Why the chunked paths cannot compute this model's logits from its lm_head's tensors; None where they can:
    a plain head, or one peft LoRA on it (`head_lora`)."""
    _, head = decoder_and_head(model)
    if not isinstance(getattr(head, "weight", None), torch.Tensor):
        return f"an lm_head without a weight tensor ({type(head).__name__})"
    if not hasattr(head, "lora_A"):
        return None
    active = _adapters_run(head)
    if len(active) > 1:
        return f"{len(active)} adapters active at once on the lm_head"
    if any(a in head.lora_variant for a in active):
        return f"a {type(head.lora_variant[active[0]]).__name__} (DoRA) on the lm_head"
    if any(head.lora_B[a].bias is not None for a in active):
        return "an lm_head adapter with lora_bias"
    return None


def _adapters_run(head: torch.nn.Module) -> list[str]:
    """The adapters peft's forward adds on a LoRA'd head: the active ones it holds a lora_A for."""
    return [a for a in head.active_adapters if a in head.lora_A]


def runnable_impl(model: torch.nn.Module, impl: LossImpl) -> LossImpl:
    """`impl`, or 'hf' where the chunked paths cannot run this model's lm_head (`head_refusal`): the model's own
    forward computes those logits, at the memory of the full N x V logits. Chunked on a GPU, how the head's gradient
    is summed there is said once (`head_accumulation`)."""
    if impl != "chunked":
        return impl
    reason = head_refusal(model)
    if reason is not None:
        _say_once(f"the chunked loss does not compute {reason}: training.loss 'hf' (full logits) instead")
        return "hf"
    weight = decoder_and_head(model)[1].weight
    # Where the device has a choice: a CPU has the blocks alone (and the planner's fake tensors are a CPU's).
    if weight.device.type == "cuda":
        _say_head_accumulation(weight.device)
    return impl


@functools.cache
def _say_once(message: str) -> None:
    """A warning once per process: the planner builds the step module for every estimate it makes."""
    logger.warning(message)


def head_lora(head: torch.nn.Module, hidden: Tensor) -> LowRank | None:
    """The low-rank term a peft LoRA on `head` adds for `hidden` [N, h], its u computed here by the adapter's own
    dropout and lora_A; None for a plain head or one whose adapter is disabled or merged (peft's forward then runs
    the base layer alone). `head_refusal` has ruled out the adapters this does not reproduce."""
    if not hasattr(head, "lora_A") or head.disable_adapters or head.merged:
        return None
    active = _adapters_run(head)
    if not active:
        return None
    (name,) = active
    x = head._cast_input_dtype(hidden, head.lora_A[name].weight.dtype)
    return LowRank(head.lora_A[name](head.lora_dropout[name](x)), head.lora_B[name].weight, head.scaling[name])


class CausalLMWithLoss(torch.nn.Module):
    """A causal LM whose forward returns the SUMMED next-token loss (fp32 scalar).

    Wrap THIS module with DDP/FSDP so the loss is computed inside one forward. `impl="hf"` runs the
    model with labels (transformers' ForCausalLMLoss: full logits, fp32 upcast); `impl="chunked"` runs
    the decoder and `chunked_cross_entropy` on the lm_head weight (and its LoRA). Under FSDP the lm_head (and, if
    tied, the input embeddings) must not be a separate FSDP unit for "chunked": its weight is read
    outside the lm_head's own forward.
    """

    def __init__(self, model: torch.nn.Module, impl: LossImpl, chunk_size: int | None = None):
        super().__init__()
        if impl not in ("hf", "chunked"):
            raise ValueError(f"impl must be 'hf' or 'chunked' (resolve 'auto' first), got {impl!r}")
        self.model = model
        self.impl = impl
        # Training gives the plan's (`BatchPlan.chunk_rows`); the CPU's rule otherwise.
        self.chunk_size = chunk_size or default_chunk_size(text_config(model.config).vocab_size)
        if impl == "chunked":
            reason = head_refusal(model)  # refuse a model the chunked loss cannot run now, not at the first step
            if reason is not None:
                raise ValueError(f"loss_impl='chunked' does not compute {reason}; use 'hf'")
            self.logit_scale, self.softcap = logit_transform(model.config)

    def forward(
        self,
        input_ids: Tensor,
        labels: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        loss_rows: Tensor | None = None,
        shift_labels: Tensor | None = None,
        **documents: Any,
    ) -> Tensor:
        """`documents`: a packed batch's cu_seq_lens / max_length (`llmtune.data.batch.with_documents`), passed on
        to the attention function. `loss_rows`: `llmtune.ops.loss.loss_rows(labels)`, as collation made it on the host
        (None: found here, which on a GPU waits for it). `shift_labels` in place of `labels`: the targets already
        shifted (a sequence shard's, `llmtune.parallel.sequence.shard_batch`)."""
        if self.impl == "hf":
            # ForCausalLMLoss divides the summed loss by num_items_in_batch: 1 keeps the sum; it takes shifted
            # targets as `shift_labels` (and computes only where `labels` is given).
            targets = (
                {"labels": labels} if shift_labels is None else {"labels": shift_labels, "shift_labels": shift_labels}
            )
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                **targets,
                num_items_in_batch=torch.ones((), device=input_ids.device),
                use_cache=False,
                **documents,
            )
            return out.loss.float()

        decoder, head = decoder_and_head(self.model)
        hidden = decoder(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **documents
        ).last_hidden_state
        if shift_labels is None:
            # hidden[t] predicts labels[t + 1]; the last position of each row has no target.
            shift_labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
        # Flattening the unshifted hidden is a view; the padded label is skipped before any matmul.
        hidden = hidden.reshape(-1, hidden.shape[-1])
        return chunked_cross_entropy(
            hidden,
            head.weight,
            shift_labels.reshape(-1).to(hidden.device),
            rows=None if loss_rows is None else loss_rows.to(hidden.device),
            bias=head.bias,
            lora=head_lora(head, hidden),
            chunk_size=self.chunk_size,
            logit_scale=self.logit_scale,
            softcap=self.softcap,
        )
