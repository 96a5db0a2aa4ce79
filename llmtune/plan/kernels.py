"""Memory models of kernels the estimator cannot run here, written from their sources.

The estimator traces a real training step on fake tensors, so whatever PyTorch and transformers run on
this machine is counted as it really happens. What users plan for but cannot run here: bitsandbytes'
4-bit base weights (QLoRA) and 8-bit AdamW need CUDA, flash-attention-2 needs its CUDA package, and a
CUDA step differs from the CPU one in autocast's op lists and in its attention kernels. Each is replaced,
inside the trace only, by a stand-in that allocates and keeps what the real kernel allocates and keeps
(values are never computed: the tensors are fake). Each stand-in names the source it follows; if that
source changes, so must the stand-in. These are checked on a GPU by benchmarks/gpu_check.py, not here.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from llmtune.model.attention import FLASH_MAX_HEAD_DIM, flash_capable, planned_device
from llmtune.model.experts import experts_modules

# bitsandbytes 0.4x/0.5x `quantize_4bit` (NF4, as llmtune.model.load.load_model asks for it): blocks of 64
# weights share one absmax; with double quantisation those absmaxes are themselves quantised to uint8 in
# blocks of 256, each block with an fp32 absmax, plus a 256-entry fp32 code table.
NF4_BLOCK = 64
NESTED_BLOCK = 256
# bitsandbytes' 8-bit optimizers keep 32-bit states for tensors under `min_8bit_size` elements.
MIN_8BIT_SIZE = 4096
BNB_8BIT_BLOCK = 256  # blockwise dynamic quantisation: one fp32 absmax per 256 state values


class _Dequantize4bitLinear(torch.autograd.Function):
    """bitsandbytes `MatMul4Bit` (autograd/_functions.py): forward dequantises the whole weight to the
    compute dtype, multiplies, and frees it; backward dequantises it again for the input gradient. It
    saves the quantised weight only (no activation: the base weight is frozen). Before 0.43.2 it also kept the
    input (`ctx.tensors = (A, B)`, PR #1270), until backward ended: llmtune refuses those versions for QLoRA
    (`model.QLORA_MIN_BITSANDBYTES`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
        ctx.shape = (out_features, x.shape[-1])
        ctx.save_for_backward(packed)
        weight = torch.empty(ctx.shape, dtype=x.dtype, device=x.device)  # dequantize_4bit's output
        return torch.nn.functional.linear(x, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        weight = torch.empty(ctx.shape, dtype=grad.dtype, device=grad.device)
        return grad @ weight, None, None


class Linear4bitModel(torch.nn.Module):
    """What a bitsandbytes `Linear4bit` (NF4, double quantisation) holds and does, as far as memory goes."""

    def __init__(self, linear: torch.nn.Linear, compute_dtype: torch.dtype) -> None:
        super().__init__()
        n = linear.weight.numel()
        self.logical_numel = n
        self.out_features, self.in_features = linear.weight.shape
        self.compute_dtype = compute_dtype
        blocks = math.ceil(n / NF4_BLOCK)
        # Params4bit: two 4-bit values per byte; its quant_state: uint8 absmax per block, fp32 absmax per
        # nested block, the fp32 code table.
        self.weight = torch.nn.Parameter(torch.empty((n + 1) // 2, 1, dtype=torch.uint8), requires_grad=False)
        self.register_buffer("absmax", torch.empty(blocks, dtype=torch.uint8))
        self.register_buffer("nested_absmax", torch.empty(math.ceil(blocks / NESTED_BLOCK), dtype=torch.float32))
        self.register_buffer("code", torch.empty(256, dtype=torch.float32))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Linear4bit.forward casts the input to the compute dtype (a copy when it differs) and the
        # output back to the input's dtype.
        inp_dtype = x.dtype
        out = _Dequantize4bitLinear.apply(x.to(self.compute_dtype), self.weight, self.out_features)
        if self.bias is not None:
            out = out + self.bias.to(self.compute_dtype)
        return out.to(inp_dtype)


def quantize_base_4bit(model: torch.nn.Module, compute_dtype: torch.dtype) -> int:
    """Replace every frozen nn.Linear except the output head with its 4-bit stand-in (transformers'
    bitsandbytes quantizer skips the head, `get_keys_to_not_convert`); under peft, the LoRA layers' `base_layer`, but
    not the head's where LoRA adapts it (training quantizes at load, before peft wraps it). Returns how many were
    replaced."""
    head = model.get_output_embeddings()
    heads = (head, getattr(head, "base_layer", None))
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and not any(child is h for h in heads) and not child.weight.requires_grad:
                setattr(parent, name, Linear4bitModel(child, compute_dtype))
                count += 1
    return count


def upcast_for_kbit_training(model: torch.nn.Module) -> None:
    """peft's `prepare_model_for_kbit_training` (utils/other.py), which training runs on a QLoRA model: every 16-bit
    parameter that is not 4-bit becomes fp32 (embeddings, the output head, norms). In bf16-true that doubles them
    (+2.1 GB on an 8B model) and makes the residual stream fp32: a 4-bit layer casts its output back to its input's
    dtype, so q, k and v are fp32 too, which CUDA's flash kernel does not take."""
    for param in model.parameters():
        if param.dtype in (torch.float16, torch.bfloat16):
            param.data = param.data.to(torch.float32)


def parameter_count(model: torch.nn.Module) -> int:
    """Parameters as the unquantised model has them (a 4-bit weight packs two per stored byte)."""
    quantized = [m for m in model.modules() if isinstance(m, Linear4bitModel)]
    return sum(p.numel() for p in model.parameters()) + sum(m.logical_numel - m.weight.numel() for m in quantized)


class AdamW8bitModel(torch.optim.Optimizer):
    """bitsandbytes `AdamW8bit` (optim/optimizer.py, Optimizer2State): tensors of at least 4096 elements
    keep both states as uint8 plus an fp32 absmax per 256 values, smaller ones keep fp32 states; the
    update is one fused kernel per tensor that allocates nothing (`optimizer_update_8bit_blockwise`)."""

    def __init__(self, params: Any, lr: float = 1e-3) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    eight_bit = p.numel() >= MIN_8BIT_SIZE
                    dtype = torch.uint8 if eight_bit else torch.float32
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["state1"] = torch.zeros_like(p, dtype=dtype)
                    state["state2"] = torch.zeros_like(p, dtype=dtype)
                    if eight_bit:
                        blocks = math.ceil(p.numel() / BNB_8BIT_BLOCK)
                        state["absmax1"] = torch.zeros(blocks, dtype=torch.float32)
                        state["absmax2"] = torch.zeros(blocks, dtype=torch.float32)
                state["step"] += 1
                p.add_(p.grad, alpha=-group["lr"])  # stands for the fused in-place update


# ---------------------------------------------------------------- what a CUDA step runs, traced on CPU kernels
# The trace runs CPU kernels under CPU autocast (a CPU-only torch cannot run fake CUDA tensors through
# autograd). `CudaKernels` makes the step keep what the CUDA one keeps where the two differ: autocast's
# op lists, and the SDPA kernel CUDA would choose.

F = torch.nn.functional
T = torch.Tensor
# aten/src/ATen/autocast_mode.h, AT_FORALL_FP32: CUDA autocast runs these in fp32 (casts their inputs). CPU
# autocast leaves most of them in the input's dtype.
_CUDA_FP32 = {
    *(torch.exp, T.exp, torch.expm1, torch.log, T.log, torch.log10, torch.log2, torch.log1p, T.log1p),
    *(torch.reciprocal, T.reciprocal, torch.rsqrt, T.rsqrt, torch.pow, T.pow, T.__pow__, T.__rpow__),
    *(torch.acos, torch.asin, torch.cosh, torch.sinh, torch.tan, torch.erfinv, F.softplus),
    *(F.layer_norm, torch.layer_norm, F.group_norm, torch.group_norm, F.cosine_similarity, torch.cdist),
    *(torch.logsumexp, T.logsumexp, torch.dist, torch.renorm),
    *(F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.kl_div, F.nll_loss, F.binary_cross_entropy_with_logits),
}
# AT_FORALL_FP32_SET_OPT_DTYPE: run with dtype=float32 (the input is not copied; the output is fp32).
_CUDA_FP32_SET_DTYPE = {
    *(F.softmax, torch.softmax, T.softmax, F.log_softmax, torch.log_softmax, T.log_softmax),
    *(torch.cumsum, T.cumsum, torch.cumprod, T.cumprod, torch.sum, T.sum, torch.prod, T.prod),
    torch.linalg.vector_norm,
}
# AT_FORALL_LOWER_PRECISION_FP entries that CPU autocast does not list.
_CUDA_LOWER = {torch.einsum, torch.mv, T.mv, torch.addmv, torch.addr}


def cuda_sdpa_backend(
    q: torch.Tensor,
    attn_mask: torch.Tensor | None,
    enable_gqa: bool,
    capability: tuple[int, int] | None = None,
    dropout_p: float = 0.0,
) -> str:
    """The backend torch's `sdp_utils.cpp` picks for a training step on a CUDA GPU of compute `capability` (None: a
    data-center card, sm80 or sm90), in its priority order: flash (sm80+, `flash_capable`; 16-bit, no arbitrary mask,
    head dim <= 256 and a multiple of 8; `check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120`: on
    sm86/89/120/121 not with grad for head dims in (192, 224], nor above 224 with dropout), then memory-efficient (any
    float dtype, masks; no GQA), then the math composite."""
    head_dim = q.shape[-1]
    consumer = capability in ((8, 6), (8, 9), (12, 0), (12, 1))
    refused = consumer and (192 < head_dim <= 224 or (head_dim > 224 and dropout_p > 0))
    if q.dtype in (torch.bfloat16, torch.float16) and attn_mask is None and head_dim <= FLASH_MAX_HEAD_DIM:
        if head_dim % 8 == 0 and flash_capable(capability) and not refused:
            return "flash"
    if not enable_gqa and head_dim % (4 if q.dtype == torch.float32 else 8) == 0:
        return "efficient"
    return "math"


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


# aten/src/ATen/native/transformers/attention.cpp, `preprocess_mask`: the memory-efficient kernel's bias needs every
# stride but the last a multiple of 8 (torch 2.13's own inductor/lowering.py names the same ALIGNMENT = 8). Older
# torch (2.1-2.3) aligned to 16 and padded after expanding to (B, H, L, S); that is not modelled.
MEM_EFF_BIAS_ALIGNMENT = 8


def _additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """attention.cpp `convert_boolean_attn_mask`, run by `scaled_dot_product_attention` on every call before any
    backend: a bool mask becomes a new additive mask of its own shape in q's dtype (`at::where(mask, 0, -inf)`); a
    float mask passes as it is."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, 0.0, torch.scalar_tensor(-math.inf, dtype=dtype, device=mask.device))


def _efficient_bias(bias: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """attention.cpp `preprocess_mask` (the efficient-attention case of `scaled_dot_product_attention`): a bias
    whose strides are aligned is only expanded (a view); otherwise `pad_bias` copies it with its last dim padded by
    `alignment - size % alignment` and slices the padding off. Then the view is expanded to (B, H, L, S)."""
    aligned = bias.stride(-1) == 1 and all(s % MEM_EFF_BIAS_ALIGNMENT == 0 for s in bias.stride()[:-1])
    if not aligned:
        size = bias.shape[-1]
        bias = F.pad(bias, (0, MEM_EFF_BIAS_ALIGNMENT - size % MEM_EFF_BIAS_ALIGNMENT))[..., :size]
    return bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention.default
_EFFICIENT = torch.ops.aten._scaled_dot_product_efficient_attention.default


class _SdpaMemory(torch.autograd.Function):
    """CUDA's flash and memory-efficient attention as far as memory goes; values are never computed.

    Forward runs the very aten op CUDA runs (`_scaled_dot_product_flash_attention` / `_efficient_attention`), here
    through its meta kernel (torch/_meta_registrations.py: the output, an fp32 log-sum-exp (B, H, T), padded to a
    multiple of 32 for memory-efficient, the RNG state), so that selective checkpointing's policy sees the op it
    saves (llmtune.model.blocks._KEPT_OPS) and the time model counts its FLOPs. It keeps what derivatives.yaml saves
    for the op's backward: q, k, v, the output, the log-sum-exp and RNG state, and memory-efficient's bias (the additive
    mask `CudaKernels._sdpa` made, as `scaled_dot_product_attention` makes it).

    Backward runs the op's backward (dq, dk, dv as q, k, v) and allocates its workspaces on top:
    - flash (cuda/flash_attn/flash_api.cpp, `mha_bwd`): `softmax_d`, fp32 (B, H, T rounded to 128); `dq_accum`, fp32
      (B, T rounded to 128, H, head dim rounded to 32, or 64 over 128); with GQA (fewer K/V heads than query heads)
      `dk_expanded` and `dv_expanded` at the query heads, (B, T_k, H, head dim) in q's dtype, summed down into dk, dv.
    - memory-efficient: fp32 `delta` (B, H, T) and, for 16-bit inputs, an fp32 dQ accumulator, plus dK/dV
      accumulators for head dims over 128 (xformers' kernel_backward.h, kNeedsAccumGrad*). No grad of the bias: it
      never requires grad here (grad_input_mask[3] false)."""

    @staticmethod
    def forward(
        ctx: Any, q: T, k: T, v: T, bias: T | None, backend: str, dropout_p: float, is_causal: bool, scale: Any
    ) -> T:
        ctx.backend, ctx.dropout_p, ctx.is_causal, ctx.scale = backend, dropout_p, is_causal, scale
        if backend == "flash":
            out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = _FLASH(q, k, v, dropout_p, is_causal, scale=scale)
            ctx.varlen = (cum_q, cum_k, max_q, max_k)
        else:
            out, lse, seed, offset = _EFFICIENT(q, k, v, bias, True, dropout_p, is_causal, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, seed, offset, bias)
        return out

    @staticmethod
    def backward(ctx: Any, grad: T) -> tuple[Any, ...]:
        q, k, v, out, lse, seed, offset, bias = ctx.saved_tensors
        b, h, t, d = q.shape
        f32 = dict(dtype=torch.float32)
        p, causal = ctx.dropout_p, ctx.is_causal
        if ctx.backend == "flash":
            backward = torch.ops.aten._scaled_dot_product_flash_attention_backward
            dq, dk, dv = backward(grad, q, k, v, out, lse, *ctx.varlen, p, causal, seed, offset, scale=ctx.scale)
            workspace = [
                q.new_empty((b, h, _round_up(t, 128)), **f32),  # softmax_d
                q.new_empty((b, _round_up(t, 128), h, _round_up(d, 32 if d <= 128 else 64)), **f32),  # dq_accum
            ]
            if k.shape[1] != h:  # dk_expanded, dv_expanded
                workspace += [q.new_empty((b, k.shape[2], h, d)), q.new_empty((b, v.shape[2], h, v.shape[-1]))]
        else:
            backward = torch.ops.aten._scaled_dot_product_efficient_attention_backward
            needs = [True, True, True, False]
            dq, dk, dv, _ = backward(grad, q, k, v, bias, out, lse, seed, offset, p, needs, causal, scale=ctx.scale)
            workspace = [q.new_empty((b, h, t), **f32)]
            if q.dtype != torch.float32:
                workspace.append(q.new_empty(q.shape, **f32))
                if d > 128:
                    workspace += [k.new_empty(k.shape, **f32), v.new_empty(v.shape, **f32)]
        del workspace
        return dq, dk, dv, None, None, None, None, None


try:  # torch >= 2.10: importing it registers the torch_attn ops
    import torch.nn.attention.varlen  # noqa: F401

    _VARLEN = torch.ops.torch_attn._varlen_attn
except (ImportError, AttributeError):
    _VARLEN = None


class _VarlenMemory(torch.autograd.Function):
    """Flash's varlen attention (torch's `torch.nn.attention.varlen.varlen_attn`, run by `llmtune.model.attention` on
    packed rows) as far as memory goes: forward and backward are torch's own ops (their fake kernels: the output, an
    fp32 log-sum-exp [H, total], what `_setup_context` saves), and backward allocates `mha_varlen_bwd`'s workspaces on
    top (cuda/flash_attn/flash_api.cpp: `softmax_d` fp32 [H, total + 128 x documents] and `dq_accum` fp32
    [total + 128 x documents, H, head dim rounded to 32, or 64 over 128]); with GQA, `dk_expanded` / `dv_expanded` at
    the query's heads. No [B, 1, L, L] mask: there is none."""

    @staticmethod
    def forward(ctx: Any, q: T, k: T, v: T, cu_q: T, cu_k: T | None, max_q: int, max_k: int, *rest: Any) -> T:
        # `rest`: the op's is_causal, scale, window_size, enable_gqa, ... as varlen_attn passes them (positionally).
        out, lse, rng = _VARLEN.default(q, k, v, cu_q, cu_k, max_q, max_k, *rest)
        ctx.save_for_backward(q, k, v, cu_q, cu_q if cu_k is None else cu_k, out, lse, rng)
        ctx.max, ctx.rest = (max_q, max_k), rest
        return out

    @staticmethod
    def backward(ctx: Any, grad: T) -> tuple[Any, ...]:
        q, k, v, cu_q, cu_k, out, lse, rng = ctx.saved_tensors
        is_causal, scale, window = (*ctx.rest, False, None, None)[:3]
        total, h, d = q.shape
        padded = total + 128 * (cu_q.shape[0] - 1)
        workspace = [
            q.new_empty((h, padded), dtype=torch.float32),  # softmax_d
            q.new_empty((padded, h, _round_up(d, 32 if d <= 128 else 64)), dtype=torch.float32),  # dq_accum
        ]
        if k.shape[1] != h:  # dk_expanded, dv_expanded
            workspace += [k.new_empty((k.shape[0], h, d)), v.new_empty((v.shape[0], h, v.shape[-1]))]
        backward = torch.ops.torch_attn._varlen_attn_backward
        dq, dk, dv = backward(grad, q, k, v, out, lse, cu_q, cu_k, *ctx.max, is_causal, rng, scale, window)
        del workspace
        return dq, dk, dv, *([None] * (4 + len(ctx.rest)))


class CudaKernels(TorchFunctionMode):
    """Inside a CPU-autocast trace: CUDA autocast's op lists where they differ from CPU's, and SDPA as the
    kernel CUDA would pick on a card of compute `capability` (None: sm80/sm90) keeps and allocates it
    (flash/memory-efficient stand-ins; the math composite called by name, which is what CUDA runs too)."""

    def __init__(self, capability: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.capability = capability
        self._planned = contextlib.ExitStack()

    def __enter__(self) -> CudaKernels:
        # llmtune.model.attention picks its packed-row kernel for these CPU fake tensors as on this card: flash's
        # varlen from sm80, else SDPA (per document or masked), which `_sdpa` then stands in for.
        self._planned.enter_context(planned_device("cuda", self.capability))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._planned.close()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self._sdpa(*args, **kwargs)
        if _VARLEN is not None and func in (_VARLEN, _VARLEN.default):
            out = _VarlenMemory.apply(*args, *kwargs.values())
            return out, None, None  # the op's log-sum-exp and RNG state: varlen_attn reads neither
        lower = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        if lower is not None and func in _CUDA_FP32:
            args, kwargs = _cast((args, kwargs), torch.float32)
        elif lower is not None and func in _CUDA_FP32_SET_DTYPE and kwargs.get("dtype") is None:
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if first is not None and first.is_floating_point() and first.dtype != torch.float64:
                kwargs = {**kwargs, "dtype": torch.float32}
        elif lower is not None and func in _CUDA_LOWER:
            args, kwargs = _cast((args, kwargs), lower)
        return func(*args, **kwargs)

    def _sdpa(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        """attention.cpp `scaled_dot_product_attention` as CUDA runs it: the backend `cuda_sdpa_backend` picks, the
        mask converted for it (`convert_boolean_attn_mask`, then `preprocess_mask` for memory-efficient). On CUDA
        autocast, SDPA is on the lower-precision list and its inner ops run with autocast off; so here."""
        if torch.is_autocast_enabled("cpu"):
            (q, k, v), _ = _cast(((q, k, v), {}), torch.get_autocast_dtype("cpu"))
        backend = cuda_sdpa_backend(q, attn_mask, enable_gqa, self.capability, dropout_p)
        with torch.autocast("cpu", enabled=False):
            bias = _additive_mask(attn_mask, q.dtype)
            if backend == "math":
                # Called by name: on this CPU F.scaled_dot_product_attention may pick CPU's flash kernel, which keeps
                # no (B, H, L, S) attention matrix; CUDA's math composite (`_scaled_dot_product_attention_math`) does.
                return torch.ops.aten._scaled_dot_product_attention_math(
                    q, k, v, bias, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
                )[0]
            if bias is not None:
                bias = _efficient_bias(bias, q, k)
            return _SdpaMemory.apply(q, k, v, bias, backend, dropout_p, is_causal, scale)


def _cast(tree: Any, dtype: torch.dtype) -> Any:
    """Floating tensors in `tree` (args, kwargs) cast to `dtype`, outside CPU autocast (which would recast)."""

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64:
            return x.to(dtype)
        return x

    with torch.autocast("cpu", enabled=False):
        return pytree.tree_map(cast, tree)


# ---------------------------------------------------------------- the experts' grouped matmul
_GROUPED_MM = torch.ops.aten._grouped_mm.default


class GroupedMmKernel(TorchDispatchMode):
    """torch's `_grouped_mm` (which transformers' `grouped_mm` experts run) with the operands its kernels take.

    Since torch 2.9 the op runs any float dtype: the CUTLASS kernel in bf16 on sm90, else a loop of matmuls into one
    output in the operands' dtype (aten/src/ATen/native/GroupedMMUtils.h, the fallback). Its meta kernel, which fake
    tensors run, still checks the CUTLASS kernel's operands (torch/_meta_registrations.py `_meta_grouped_mm_common`:
    bf16 only) and refuses fp32 ones. Mixed precision hands it fp32: the grouped matmul is on no autocast list, so
    transformers casts its input to the experts' fp32 master weights (integrations/moe.py `_grouped_mm`). Either
    kernel keeps its output only, shaped as `_create_grouped_mm_output_tensor` shapes it; made here for operands
    the meta kernel refuses."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not _GROUPED_MM or args[0].dtype == torch.bfloat16:
            return func(*args, **kwargs)
        a, b = args[0], args[1]
        offs = args[2] if len(args) > 2 else kwargs.get("offs")
        if a.dim() == 2:  # (tokens, in) x (experts, in, out), or the weights' gradient (in, tokens) x (tokens, out)
            shape = (a.shape[0], b.shape[-1]) if b.dim() == 3 else (offs.shape[0], a.shape[0], b.shape[-1])
        else:
            shape = (a.shape[1], b.shape[1]) if b.dim() == 2 else (a.shape[0], a.shape[1], b.shape[-1])
        return torch.empty(shape, dtype=kwargs.get("out_dtype") or a.dtype, device=a.device)


_NONZERO = torch.ops.aten.nonzero.default
_SCALAR = torch.ops.aten._local_scalar_dense.default


class BalancedRouting(TorchDispatchMode):
    """Inside an experts module's `eager` forward (transformers' loop over the experts a batch hits, each taking its
    tokens by `torch.where` on the routing mask): its data-dependent ops, which fake tensors have no values for,
    answered for a balanced routing. Every one of the `experts` is hit (`nonzero` of the hit mask), and takes
    tokens x top_k / experts of the routed pairs, rounded up (`nonzero` of its routing mask); a value read on the host
    is 0 (the expert indexed, never the expert-parallel sentinel). What backward keeps sums to the routed pairs
    whatever the routing, so it is exact; a transient of one expert's step is that of a balanced share, which an
    imbalanced batch exceeds on its busiest expert."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.experts = experts

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is _SCALAR:
            return False if args[0].dtype == torch.bool else 0
        if func is not _NONZERO:
            return func(*args, **kwargs)
        mask = args[0]
        rows = min(mask.shape[0], self.experts) if mask.dim() == 1 else -(-mask.numel() // self.experts)
        return torch.empty((rows, mask.dim()), dtype=torch.long, device=mask.device)


def route_balanced(model: torch.nn.Module) -> int:
    """Run every experts module of `model` (`llmtune.model.experts.experts_modules`) under `BalancedRouting`; returns
    how many. The model is the trace's own, so its modules'
    forwards are replaced in place."""
    experts = [m for _, m in experts_modules(model)]
    for module in experts:
        module.forward = _balanced(module.forward, module.num_experts)
    return len(experts)


def _balanced(forward: Any, experts: int) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        with BalancedRouting(experts):
            return forward(*args, **kwargs)

    return run


__all__ = [
    "AdamW8bitModel",
    "BalancedRouting",
    "CudaKernels",
    "GroupedMmKernel",
    "Linear4bitModel",
    "cuda_sdpa_backend",
    "parameter_count",
    "quantize_base_4bit",
    "route_balanced",
    "upcast_for_kbit_training",
]
