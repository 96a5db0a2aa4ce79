"""Causal-LM loss without the full N x V fp32 logits.

HF's causal-LM loss materialises the logits in the compute dtype, upcasts them to fp32 and runs
`cross_entropy`; its backward peaks at ~12*N*V bytes (N tokens, V vocab), which for small models or
with gradient checkpointing is often the step's memory peak (see shared/notes/memory-facts.md).

`chunked_cross_entropy` computes the same SUM of token losses chunk by chunk. In forward it also
computes the gradients w.r.t. hidden states, lm_head weight and bias (Liger-style), so backward only
scales them by `grad_output`: no recompute, and the logits of at most one chunk are alive at a time.
Extra memory: N*h (grad of hidden) + V*h fp32 (grad of weight, only when it requires grad) + about
4*chunk*V bytes of per-chunk scratch in fp32 (one fp32 buffer, worked in place), 8*chunk*V in bf16.

`CausalLMWithLoss` wraps a HF causal LM (or a peft model around one) so that DDP/FSDP can wrap one
module whose forward returns the loss.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

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
    """Token rows per loss chunk: ~8 Mi logits (32 MiB in fp32) per chunk, kept between 128 and 1024 rows.

    At vocab 32000 that is 262 rows; at 128256, 128. Sizing chunks by bytes rather than a fixed 1024 rows
    halves the loss buffers at vocab 32000 and costs no speed against HF's loss (benchmarks/loss.py;
    figures in benchmarks/results/measurements.md).
    """
    return max(128, min(1024, 2**23 // vocab_size))


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


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Sum of token cross-entropies; gradients are computed in forward and scaled in backward."""

    @staticmethod
    def forward(
        ctx: Any, hidden, weight, bias, labels, chunk_size, ignore_index, compute_dtype, scale, softcap, grad_enabled
    ) -> Tensor:
        # The arguments are `chunked_cross_entropy`'s, with the matmul's dtype and whether gradients are wanted.
        # needs_input_grad is True under no_grad too: evaluation must not pay for the gradients.
        need_h, need_w = (grad_enabled and ctx.needs_input_grad[i] for i in (0, 1))
        need_b = grad_enabled and bias is not None and ctx.needs_input_grad[2]
        # Only rows with a target cost anything: prompt-masked SFT batches skip their masked share of
        # the three N x V x h matmuls. `nonzero` is a host sync on GPU (one per step).
        rows = (labels != ignore_index).nonzero().squeeze(1)
        n_rows = rows.numel()

        w = weight.to(compute_dtype)
        b = bias.to(compute_dtype) if bias is not None else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.zeros_like(hidden) if need_h else None
        # fp32 accumulation across chunks, whatever the compute dtype.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None

        for start in range(0, n_rows, chunk_size):
            idx = rows[start : start + chunk_size]
            h = hidden.index_select(0, idx).to(compute_dtype)
            target = labels.index_select(0, idx)
            # All further work is in place on this one chunk x V fp32 buffer.
            z, tanh = chunk_logits(h, w, b, scale, softcap)
            # Stable log-sum-exp in place: z <- exp(z - max), lse = max + log(sum).
            z_max = z.amax(dim=1, keepdim=True)
            z.sub_(z_max)
            target_logit = z.gather(1, target.unsqueeze(1))
            sum_exp = z.exp_().sum(dim=1, keepdim=True)
            loss += (sum_exp.log() - target_logit).sum()
            if not (need_h or need_w or need_b):
                del z, tanh
                continue
            # d loss / d logits = softmax - onehot(target).
            grad = z.div_(sum_exp)
            grad.scatter_add_(1, target.unsqueeze(1), grad.new_full((idx.numel(), 1), -1.0))
            through_transform_(grad, tanh, scale)
            del tanh
            if need_b:
                grad_bias += grad.sum(0)
            grad_c = grad.to(compute_dtype)
            del grad, z
            if need_h:
                grad_hidden.index_copy_(0, idx, (grad_c @ w).to(hidden.dtype))
            if need_w:
                if compute_dtype == torch.float32:
                    grad_weight.addmm_(grad_c.t(), h)
                else:  # low-precision matmul like lm_head's backward, summed over chunks in fp32
                    grad_weight.add_(grad_c.t() @ h)
            del grad_c  # before the next chunk's logits: one chunk x V buffer alive at a time

        # Kept on ctx rather than save_for_backward so backward can drop ctx's reference: a gradient
        # returned with no other owner becomes `.grad` as is, instead of AccumulateGrad copying V x h.
        ctx.grads = (grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        grad_hidden, grad_weight, grad_bias = ctx.grads
        ctx.grads = None  # backward runs once: a second call raises instead of returning stale grads
        weight_dtype, bias_dtype = ctx.dtypes
        # In place: these buffers are ours alone now, so scaling (e.g. by 1/tokens) costs no V x h copy
        # and no host sync to test for grad_output == 1.
        if grad_hidden is not None:
            grad_hidden.mul_(grad_output.to(grad_hidden.dtype))
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_output).to(weight_dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.mul_(grad_output).to(bias_dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None


def chunk_logits(
    h: Tensor, weight: Tensor, bias: Tensor | None, scale: float, softcap: float | None
) -> tuple[Tensor, Tensor | None]:
    """fp32 logits of one chunk as the model computes them: lm_head in the inputs' (compute) dtype, then fp32, then
    its transform (`logit_transform`), in place on the one chunk x V fp32 buffer. Also the tanh of the softcap, which
    the gradient needs (`through_transform_`); None without one."""
    z = F.linear(h, weight, bias).float()
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


def chunked_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    chunk_size: int = 1024,
    ignore_index: int = -100,
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> Tensor:
    """SUM over non-ignored tokens of cross_entropy(hidden @ weight.T + bias, labels), as an fp32 scalar.

    Equal to `F.cross_entropy((hidden @ weight.T).float(), labels, reduction="sum")` without ever
    holding more than `chunk_size` rows of logits. The matmul runs in the autocast dtype when autocast
    is on (as the model's lm_head would), else in the inputs' dtype; softmax and the loss in fp32.
    `logit_scale` multiplies the logits, then `softcap` applies `softcap * tanh(logits / softcap)`.

    hidden: [N, h]; weight: [V, h]; labels: [N] (int64); bias: [V] or None.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or labels.dim() != 1 or hidden.shape[0] != labels.shape[0]:
        raise ValueError(
            f"expected hidden [N, h], weight [V, h], labels [N]; got {tuple(hidden.shape)}, "
            f"{tuple(weight.shape)}, {tuple(labels.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    device_type = hidden.device.type
    compute_dtype = matmul_dtype(hidden, weight)
    # The Function casts explicitly; autocast must not re-cast its matmuls (or cast fp32 grads down).
    with torch.autocast(device_type, enabled=False):
        return _ChunkedCrossEntropy.apply(
            hidden,
            weight,
            bias,
            labels.long(),
            chunk_size,
            ignore_index,
            compute_dtype,
            logit_scale,
            softcap,
            torch.is_grad_enabled(),
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
    if hasattr(head, "lora_A") or not isinstance(getattr(head, "weight", None), torch.Tensor):
        # A LoRA-wrapped lm_head's `.weight` is the frozen base weight: the adapter would be ignored.
        raise ValueError(f"loss_impl='chunked' needs a plain lm_head, got {type(head).__name__}; use 'hf'")
    return decoder, head


class CausalLMWithLoss(torch.nn.Module):
    """A causal LM whose forward returns the SUMMED next-token loss (fp32 scalar).

    Wrap THIS module with DDP/FSDP so the loss is computed inside one forward. `impl="hf"` runs the
    model with labels (transformers' ForCausalLMLoss: full logits, fp32 upcast); `impl="chunked"` runs
    the decoder and `chunked_cross_entropy` on the lm_head weight. Under FSDP the lm_head (and, if
    tied, the input embeddings) must not be a separate FSDP unit for "chunked": its weight is read
    outside the lm_head's own forward.
    """

    def __init__(self, model: torch.nn.Module, impl: LossImpl, chunk_size: int | None = None):
        super().__init__()
        if impl not in ("hf", "chunked"):
            raise ValueError(f"impl must be 'hf' or 'chunked' (resolve 'auto' first), got {impl!r}")
        self.model = model
        self.impl = impl
        self.chunk_size = chunk_size or default_chunk_size(text_config(model.config).vocab_size)
        if impl == "chunked":
            decoder_and_head(model)  # refuse a model the chunked loss cannot run now, not at the first step
            self.logit_scale, self.softcap = logit_transform(model.config)

    def forward(
        self,
        input_ids: Tensor,
        labels: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
    ) -> Tensor:
        if self.impl == "hf":
            # ForCausalLMLoss divides the summed loss by num_items_in_batch: 1 keeps the sum.
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                labels=labels,
                num_items_in_batch=torch.ones((), device=input_ids.device),
                use_cache=False,
            )
            return out.loss.float()

        decoder, head = decoder_and_head(self.model)
        hidden = decoder(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        # hidden[t] predicts labels[t + 1]; the last position of each row has no target. Flattening the
        # unshifted hidden is a view; the padded label is skipped before any matmul.
        shift_labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
        return chunked_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]),
            head.weight,
            shift_labels.reshape(-1).to(hidden.device),
            bias=head.bias,
            chunk_size=self.chunk_size,
            logit_scale=self.logit_scale,
            softcap=self.softcap,
        )
