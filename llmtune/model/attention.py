"""Attention over packed rows that runs each document's causal block and nothing else (`VARLEN`).

A packed micro-batch (`llmtune.data.with_documents`) carries, beside its rows and restarting `position_ids`, the
documents of the rows read as one flattened sequence: `cu_seq_lens_q/k` (int32 offsets, the padding at a row's end
one more document) and `max_length_q/k` (Python ints), computed on the host in collate, as TRL's `padding_free` and
transformers' `DataCollatorWithFlattening` do. transformers passes them to the attention function untouched.

`varlen_attention`, registered with transformers' `AttentionInterface` as `VARLEN`, reads them:
* on a CUDA card of compute capability 8.0 or newer (Ampere, Ada, Hopper), in 16-bit: flash attention's varlen
  kernel over the flattened rows, causal within each document (torch's `torch.nn.attention.varlen.varlen_attn`, a
  flash kernel shipped with torch; flash-attn's `flash_attn_varlen_func` where torch has none). Both refuse older
  cards ("FlashAttention only supports Ampere GPUs or newer"): `flash_varlen_runs` decides, for a run and for the
  estimator's trace of a step on a named card alike;
* elsewhere (a CPU, fp32, a T4 or V100): SDPA once per document, causal, or, where rows are short enough that the
  calls cost more than the masked-out scores (`dense_is_cheaper`, measured), one SDPA with the block mask built here
  from the offsets (measured on a CPU in benchmarks/packed_attention.py; figures in docs/data.md). On a card below
  sm80, SDPA runs its memory-efficient kernel (its math one under GQA, `llmtune.plan.kernels.cuda_sdpa_backend`).
No mask function is registered for `VARLEN`, so transformers' mask creation exits early for it: no [B, 1, L, L]
mask, and no reading of `position_ids` on the device to find the documents (`find_packed_sequence_indices`, a
host synchronisation every forward).

`attention_for` is where a run picks it: packed SFT rows and packed preference pairs on a model that calls
`AttentionInterface`, in place of `sdpa` (the recipe default), which would build the block mask. A pair's reference
forward runs the same implementation: the policy itself (adapters off, or a precomputed reference's forward through
the prepared module) or its frozen copy (`objectives.base.frozen_copy`, a deepcopy that keeps the config's choice).
`eager` and `flash_attention_2` are loaded as asked; `flash_attention_2` reads the same `cu_seq_lens` (transformers'
varlen path), which keeps examples apart at any micro-batch size (transformers' own position-id detection treats only
batch size 1 as packed).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from llmtune.data.batch import document_offsets

# The attention of a model split along the sequence (Ulysses): its name in transformers' AttentionInterface, where
# llmtune.parallel.sequence registers it. The model names it here; the parallel dimension implements it.
ULYSSES = "llmtune_ulysses"

VARLEN = "llmtune_varlen"
FLASH_MAX_HEAD_DIM = 256  # flash attention's kernels (torch's and flash-attn's) stop at head dim 256
# ... and run on Ampere (sm80) and newer only; older cards they refuse ("FlashAttention only supports Ampere GPUs").
FLASH_MIN_CAPABILITY = (8, 0)

# The device the kernel is chosen for when it is not the tensors' own, as (type, compute capability): the memory
# estimator traces a CUDA step on fake CPU tensors (llmtune.plan.kernels.CudaKernels sets it). A plain global, not a
# ContextVar: a compiled block reads it, and Dynamo cannot trace `ContextVar.get` (a graph break in every block); it
# guards on a global's value.
_planned_device: tuple[str, tuple[int, int] | None] | None = None


@contextlib.contextmanager
def planned_device(device_type: str, capability: tuple[int, int] | None = None) -> Iterator[None]:
    """Choose the kernel as on `device_type`, a CUDA card of compute `capability` (None: one not known, planned as a
    data-center card, sm80/sm90), whatever device the tensors are on."""
    global _planned_device
    before, _planned_device = _planned_device, (device_type, capability)
    try:
        yield
    finally:
        _planned_device = before


# The objectives whose collate gives a packed micro-batch its documents (`with_documents`) and whose forwards pass them
# to the model: SFT's rows and preference pairs (llmtune.objectives.pair_losses). GRPO never packs, and generates from
# left-padded prompts, which `VARLEN` does not run.
DOCUMENTED_OBJECTIVES = ("sft", "dpo", "orpo", "simpo")


def attention_for(requested: str, *, packed: bool, objective: str, config: PretrainedConfig) -> str:
    """The attention implementation a run loads: `VARLEN` for packed rows of `DOCUMENTED_OBJECTIVES` where `requested`
    is sdpa and the model can run it (`varlen_refusal`), else `requested`."""
    if (
        requested != "sdpa"
        or not packed
        or objective not in DOCUMENTED_OBJECTIVES
        or varlen_refusal(config) is not None
    ):
        return requested
    return VARLEN


def varlen_refusal(config: PretrainedConfig) -> str | None:
    """Why `VARLEN` cannot run `config`'s model exactly, or None: its class does not call `AttentionInterface`, or
    its attention caps its logits or slides a window, which the per-document kernels here do not apply."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if cls is None or not getattr(cls, "_supports_attention_backend", False):
        return "its class does not take a custom attention function"
    text = config.get_text_config()
    if getattr(text, "attn_logit_softcapping", None) is not None:
        return "it soft-caps attention logits"
    window = getattr(text, "sliding_window", None) if getattr(text, "use_sliding_window", True) else None
    if "sliding_attention" in (getattr(text, "layer_types", None) or []) or window is not None:
        return "it has sliding-window attention"
    return None


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [B, H, L, D], key/value [B, H_kv, L, D] -> [B, L, H, D].

    Without `cu_seq_lens_q`, the documents are those of the position ids; while generating (keys beyond the
    queries) each row is one sequence, run by transformers' SDPA causally. No mask is built for this implementation,
    so a left-padded batch is not supported: a run loads it for training on packed rows only (`attention_for`)."""
    if kwargs.get("softcap") is not None or kwargs.get("sliding_window") is not None:
        raise ValueError(f"{VARLEN} runs neither soft-capped nor sliding-window attention; use sdpa or eager")
    query, key, value = autocast_inputs(query, key, value)
    if cu_seq_lens_q is None:
        position_ids = kwargs.get("position_ids")
        if position_ids is None or key.shape[2] != query.shape[2]:  # generating: rows are whole sequences
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
        # A caller that passed no documents (a benchmark's plain collate): found here from the position ids, in every
        # layer, which on a GPU costs a synchronisation; exact either way.
        cu_seq_lens_q = cu_seq_lens_k = document_offsets(position_ids.expand(query.shape[0], -1))
        max_length_q = max_length_k = int(cu_seq_lens_q.diff().max())
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if _runs_flash(query, dropout):
        out = _flash_varlen(query, key, value, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, scale)
    elif dense_is_cheaper(query):
        out = block_mask_sdpa(query, key, value, cu_seq_lens_q, scale, dropout)
    else:
        out = per_document_sdpa(query, key, value, cu_seq_lens_q, scale, dropout)
    return out, None


def autocast_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v in autocast's dtype where autocast is on for their device, as SDPA would cast them. Under mixed
    precision q and k arrive in fp32 (the rotary embeddings, computed in the fp32 residual stream's dtype, promote the
    16-bit projections) and v in 16-bit: uncast, flash's 16-bit kernel would be passed over for SDPA once per
    document (a host read of the offsets every layer), and an all-to-all would move q and k in fp32."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) for t in tensors)


# On a CPU, one masked SDPA over whole rows computes L x H x D products a token; one SDPA call per document costs
# about the time of 1e6 of them (0.6-0.9 ms, forward and backward, 2 Zen 4 cores), over documents of ~15 tokens and
# up: 1e6 / 15 ~ 65k a token. Measured crossover (benchmarks/packed_attention.py): the quickstart (64 x 4 x 32 = 8k)
# runs 4.7x faster masked; 1024-token rows at 8 x 64 run 1.5-7x faster per document, documents of 16 to 512 tokens.
CPU_MASKED_PRODUCTS_PER_TOKEN = 65_536


def dense_is_cheaper(query: torch.Tensor) -> bool:
    """Whether, on a CPU, the rows' one masked SDPA beats one call per document. From the shape alone, so that a run
    and the memory estimator's trace (rows of one document each) choose the same kernel. A card without flash takes
    the same rule, unmeasured there: at a real model's width (heads x head dim >= 2048) only rows under 32 tokens go
    masked, so it runs SDPA per document, whose causal blocks keep no [B, 1, L, L] bias for backward."""
    _, heads, length, head_dim = query.shape
    return length * heads * head_dim < CPU_MASKED_PRODUCTS_PER_TOKEN


def block_mask_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_q: torch.Tensor, scale: float, dropout: float = 0.0
) -> torch.Tensor:
    """One SDPA over the rows with a [B, 1, L, L] mask, causal within each document: [B, H, L, D] -> [B, L, H, D]."""
    b, h, length, _ = query.shape
    starts = torch.zeros(b * length, dtype=torch.int32, device=query.device)
    starts[cu_q[1:-1].long()] = 1
    document = starts.cumsum(0).view(b, length)
    causal = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
    mask = ((document[:, :, None] == document[:, None, :]) & causal)[:, None]
    gqa = key.shape[1] != h
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scale, enable_gqa=gqa
    )
    return out.transpose(1, 2).contiguous()


def flash_capable(capability: tuple[int, int] | None) -> bool:
    """Whether a CUDA card of compute `capability` runs flash attention's kernels (torch's varlen and SDPA flash,
    flash-attn's): sm80 and newer. None: a card not known, planned as a data-center one (sm80/sm90)."""
    return capability is None or tuple(capability) >= FLASH_MIN_CAPABILITY


def flash_varlen_runs(
    device_type: str, capability: tuple[int, int] | None, dtype: torch.dtype, head_dim: int, dropout: float
) -> bool:
    """Whether packed rows' attention runs flash's varlen kernel: on a CUDA card that runs flash (`flash_capable`), in
    16-bit, head dim up to 256, without dropout (torch's has none). The one rule of a run and of the estimator's trace
    (`planned_device`), so that a plan keeps what the run's kernel keeps."""
    return (
        device_type == "cuda"
        and flash_capable(capability)
        and dtype in (torch.bfloat16, torch.float16)
        and head_dim <= FLASH_MAX_HEAD_DIM
        and dropout == 0.0
    )


def _runs_flash(query: torch.Tensor, dropout: float) -> bool:
    """`flash_varlen_runs` on the planned device, else on the tensors' own, where a flash varlen kernel is installed."""
    device, capability = _planned_device or (query.device.type, _capability(query.device))
    return flash_varlen_runs(device, capability, query.dtype, query.shape[-1], dropout) and _flash_kernel() is not None


def _capability(device: torch.device) -> tuple[int, int] | None:
    """A CUDA device's compute capability, None elsewhere. From its properties, which Dynamo folds to a constant in a
    compiled block (torch/_dynamo/variables/torch.py, `constant_fold_functions`); `get_device_capability` it does
    not fold."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return props.major, props.minor


@functools.cache
def _flash_kernel() -> Callable[..., torch.Tensor] | None:
    """causal varlen attention (q, k, v [total, heads, dim], cu_q, cu_k, max_q, max_k, scale) -> [total, H, D]: torch's
    `varlen_attn` (torch >= 2.10), else flash-attn's, else None. torch 2.10 took `is_causal` and no GQA; later
    versions take causality as `window_size=(-1, 0)` and K/V with fewer heads under `enable_gqa`."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        varlen_attn = None
    if varlen_attn is not None:
        params = inspect.signature(varlen_attn).parameters
        causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
        native_gqa = "enable_gqa" in params

        def torch_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
            gqa = {}
            if k.shape[1] != q.shape[1]:
                if native_gqa:
                    gqa = {"enable_gqa": True}
                else:
                    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
            return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, **causal, **gqa)

        return torch_varlen
    if importlib.util.find_spec("flash_attn") is not None:
        from flash_attn import flash_attn_varlen_func

        def flash_attn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
            return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=True)

        return flash_attn_varlen
    return None


def _flash_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor | None,
    max_q: int,
    max_k: int | None,
    scale: float,
) -> torch.Tensor:
    """The rows flattened to one sequence of [total, heads, dim], as flash's varlen kernels take it."""
    b, h, length, d = query.shape
    q, k, v = (t.transpose(1, 2).reshape(b * length, t.shape[1], d) for t in (query, key, value))
    cu_k = cu_q if cu_k is None else cu_k
    out = _flash_kernel()(q, k, v, cu_q, cu_k, max_q, max_k or max_q, scale)
    return out.view(b, length, h, d)


def per_document_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_q: torch.Tensor, scale: float, dropout: float = 0.0
) -> torch.Tensor:
    """SDPA once per document, causal: [B, H, L, D] -> [B, L, H, D]. The rows are flattened to [1, H, B x L, D], split
    at the offsets, read on the host (`tolist`: on a CPU, no synchronisation; on a card without flash, one a layer);
    one split and one cat, whose backwards copy each gradient once (per-document slices of the rows would each
    allocate a gradient of the rows' size)."""
    b, h, length, d = query.shape
    bounds = cu_q.tolist()
    spans = [end - start for start, end in zip(bounds, bounds[1:], strict=False)]
    q, k, v = (t.transpose(0, 1).reshape(1, t.shape[1], b * length, d).split(spans, dim=2) for t in (query, key, value))
    gqa = key.shape[1] != h
    parts = [
        F.scaled_dot_product_attention(qi, ki, vi, dropout_p=dropout, is_causal=True, scale=scale, enable_gqa=gqa)
        for qi, ki, vi in zip(q, k, v, strict=True)
    ]
    return torch.cat(parts, dim=2).view(h, b, length, d).permute(1, 2, 0, 3).contiguous()


AttentionInterface.register(VARLEN, varlen_attention)
