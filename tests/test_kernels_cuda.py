"""CUDA's SDPA kernels as the estimator's CPU trace stands them in (`llmtune.plan.kernels`), against the kernels'
own sources: each test traces one attention call's forward and backward through `CudaKernels` on fake tensors and
checks the bytes kept for backward, or allocated in it, against the figure worked out from the C++ source it cites
(PyTorch's aten/src/ATen/native/transformers/), not from the stand-in's own formulas."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import checkpoint

from llmtune.model.blocks import _context_fn
from llmtune.ops.measure import LiveStorageCounter
from llmtune.plan.kernels import CudaKernels, cuda_sdpa_backend

BF16, F32 = 2, 4  # bytes an element


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _trace(run: Callable[[], torch.Tensor], *inputs: torch.Tensor) -> tuple[list[int], int, int]:
    """Run `run()` and its backward under a storage counter: the bytes of each distinct storage autograd saved for
    backward, the bytes forward left alive besides `inputs`, and the bytes backward allocated on top of what lived
    when it started (its peak less the live bytes then)."""
    counter = LiveStorageCounter()
    for t in inputs:
        counter.register(t)
    seen: dict[int, torch.UntypedStorage] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.setdefault(id(t.untyped_storage()), t.untyped_storage())
        return t

    with counter:
        before = counter.live_bytes
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = run()
        kept = counter.live_bytes - before
        grad = torch.empty_like(out)
        start = counter.peak_bytes = counter.live_bytes
        out.backward(grad)
    return sorted(s.nbytes() for s in seen.values()), int(kept), int(counter.peak_bytes - start)


def _leaf(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype).requires_grad_()


def test_efficient_attention_keeps_the_additive_bias_it_makes_from_a_bool_mask() -> None:
    """attention.cpp `scaled_dot_product_attention`, efficient_attention case: `convert_boolean_attn_mask` turns the
    bool (B, 1, T, T) block mask into `at::where(mask, 0, -inf)` of the mask's shape in q's dtype, on every call;
    `preprocess_mask` pads its last dim by `8 - T % 8` when T % 8 != 0 (`pad_bias`, mem_eff_alignment 8) and expands
    it to (B, H, T, T) as a view; derivatives.yaml saves `attn_bias` for `_scaled_dot_product_efficient_attention`'s
    backward with q, k, v, the output, the log-sum-exp, fp32 (B, H, T rounded up to 32), and the RNG seed and offset
    (0-dim int64; attention.cu `_efficient_attention_forward`)."""
    b, h, d = 2, 4, 64

    def attention(t: int) -> tuple[list[int], int, int]:
        with FakeTensorMode():
            q, k, v = _leaf(b, h, t, d), _leaf(b, h, t, d), _leaf(b, h, t, d)
            mask = torch.ones(b, 1, t, t, dtype=torch.bool)
            assert cuda_sdpa_backend(q, mask, enable_gqa=False) == "efficient"
            with CudaKernels():
                return _trace(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), q, k, v, mask)

    for t in (100, 128):  # padded, aligned
        saved, kept, _ = attention(t)
        qkv_out = b * h * t * d * BF16
        lse = b * h * _round_up(t, 32) * F32
        bias = b * 1 * t * _round_up(t, 8) * BF16  # one (B, 1, T, T) bias a call: per layer, not shared
        assert saved == sorted([qkv_out] * 4 + [lse, bias, 8, 8]), t
        assert kept == qkv_out + lse + bias + 16, t  # the unpadded bias was freed


def test_efficient_attention_saves_an_aligned_float_mask_as_it_is() -> None:
    """`convert_boolean_attn_mask` passes a float mask through; `preprocess_mask` only expands an aligned one (a
    view): what backward keeps is the caller's mask itself, no copy."""
    b, h, t, d = 2, 4, 64, 64
    with FakeTensorMode():
        q, mask = _leaf(b, h, t, d), torch.zeros(b, 1, t, t, dtype=torch.bfloat16)
        with CudaKernels():
            saved, kept, _ = _trace(lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=mask), q, mask)
    assert mask.untyped_storage().nbytes() in saved
    assert kept == b * h * t * d * BF16 + b * h * t * F32 + 16  # output, log-sum-exp, seed and offset: no mask copy


def test_flash_backward_with_gqa_allocates_dk_dv_at_the_query_heads() -> None:
    """flash_attn/flash_api.cpp `mha_bwd` (which `_scaled_dot_product_flash_attention_backward` calls with K/V at
    their own heads: transformers' sdpa_attention_forward passes enable_gqa=True without repeat_kv when there is no
    mask): dq, dk, dv as q, k, v; `softmax_d` fp32 (B, H, T rounded to 128); `dq_accum` fp32 (B, T rounded to 128, H,
    head dim rounded to 32); and, as num_heads_k != num_heads, `dk_expanded` and `dv_expanded` (B, T, H, head dim)
    in q's dtype, summed down into dk, dv before they are freed."""
    b, hq, hk, t, d = 2, 8, 2, 200, 64
    with FakeTensorMode():
        q, k, v = _leaf(b, hq, t, d), _leaf(b, hk, t, d), _leaf(b, hk, t, d)
        assert cuda_sdpa_backend(q, None, enable_gqa=True) == "flash"
        with CudaKernels():
            run = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
            _, _, peak = _trace(run, q, k, v)
    grads = b * hq * t * d * BF16 + 2 * b * hk * t * d * BF16
    softmax_d = b * hq * _round_up(t, 128) * F32
    dq_accum = b * _round_up(t, 128) * hq * _round_up(d, 32) * F32
    expanded = 2 * b * t * hq * d * BF16
    assert peak == grads + softmax_d + dq_accum + expanded


def test_selective_checkpointing_keeps_the_attention_op_outputs() -> None:
    """torch's selective checkpointing keeps what its policy saves (llmtune.model.blocks._KEPT_OPS, which names
    `_scaled_dot_product_efficient_attention`): all the op's outputs (the output, the log-sum-exp, seed and offset)
    stay from forward to backward, and recomputation reuses them. Plain checkpointing keeps none. The bias is no
    kept op's output: recomputed."""
    b, h, t, d = 2, 4, 128, 64

    def kept_by(selective: bool) -> int:
        with FakeTensorMode():
            q, mask = _leaf(b, h, t, d), torch.ones(b, 1, t, t, dtype=torch.bool)

            def layer(q: torch.Tensor) -> torch.Tensor:
                return F.scaled_dot_product_attention(q, q, q, attn_mask=mask) * 2.0  # mul by a scalar saves nothing

            contexts = _context_fn(selective, CudaKernels)
            with CudaKernels():
                return _trace(lambda: checkpoint(layer, q, use_reentrant=False, context_fn=contexts), q, mask)[1]

    kept = {selective: kept_by(selective) for selective in (False, True)}
    out = b * h * t * d * BF16
    assert kept[False] == out  # the layer's own output
    assert kept[True] == out + out + b * h * _round_up(t, 32) * F32 + 16


def test_math_backend_keeps_the_attention_matrix_as_cudas_math_composite() -> None:
    """attention.cpp `_scaled_dot_product_attention_math`, which CUDA runs when neither fused kernel can (here fp32
    with GQA: flash wants 16-bit, memory-efficient no GQA). It scales q (a copy), repeats K/V to the query heads
    (`pre_process_group_query_attention_input`), multiplies by k^T scaled (a copy), `_safe_softmax`es the (B, H, T, T)
    scores and multiplies the probabilities by V: autograd keeps q scaled, k^T scaled, the probabilities and the
    repeated V. CPU's SDPA would have run its flash kernel here, which keeps no (B, H, T, T) matrix."""
    b, hq, hk, t, d = 2, 4, 2, 64, 32
    with FakeTensorMode():
        q = _leaf(b, hq, t, d, dtype=torch.float32)
        k, v = _leaf(b, hk, t, d, dtype=torch.float32), _leaf(b, hk, t, d, dtype=torch.float32)
        assert cuda_sdpa_backend(q, None, enable_gqa=True) == "math"
        with CudaKernels():
            run = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
            saved, _, _ = _trace(run, q, k, v)
    heads = b * hq * t * d * F32
    assert saved == sorted([heads] * 3 + [b * hq * t * t * F32])


def test_attention_flops_with_grouped_query_heads_are_those_at_the_query_heads():
    """The flash kernel broadcasts K and V to the query's heads: its FLOPs are multi-head attention's at the query's
    heads (torch 2.13's formula; 2.11's refused the shapes, which stopped planning a GQA model with
    flash_attention_2 on the floor versions)."""
    from llmtune.plan.timing import Work

    flash = torch.ops.aten._scaled_dot_product_flash_attention.default
    flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_backward.default

    def flops(kv_heads: int) -> tuple[float, float]:
        q = torch.empty((2, 8, 64, 32), device="meta", dtype=torch.bfloat16)
        k = v = torch.empty((2, kv_heads, 64, 32), device="meta", dtype=torch.bfloat16)
        forward, backward = Work(), Work()
        forward.add(flash, (q, k, v, 0.0, True), {}, None)
        backward.add(flash_backward, (q, q, k, v, q, None, None, None, 64, 64, 0.0, True, None, None), {}, None)
        return forward.flops, backward.flops

    mha = flops(8)
    assert flops(2) == mha
    assert mha[0] == 2 * (2 * 2 * 8 * 64 * 32 * 64)  # scores and output: two (64 x 32) @ (32 x 64) per batch and head


def test_a_cuda_step_holds_two_cublas_workspaces_in_the_caching_allocator():
    """CublasHandlePool.cpp: a workspace per (cuBLAS handle, stream), from the caching allocator, 32 MiB on sm90+
    (`:4096:8`); one handle for the forward's thread and one for autograd's backward thread. A CPU step has none."""
    from test_memory import tiny_config

    from llmtune.plan import estimate

    kw = dict(micro_batch_size=2, seq_len=32, precision="bf16", gradient_checkpointing=False)
    cuda, cpu = estimate(tiny_config("llama"), device="cuda", **kw), estimate(tiny_config("llama"), device="cpu", **kw)
    assert cuda.breakdown["cublas_workspaces"] == 2 * 4096 * 1024 * 8
    assert "cublas_workspaces" not in cpu.breakdown
    assert cuda.peak_bytes == sum(cuda.breakdown.values()) and cuda.reserved_bytes >= cuda.peak_bytes
    assert cuda.scaled_peak(1.0) == cuda.reserved_bytes  # the workspaces do not grow with the tokens


def test_the_cards_generation_picks_the_kernel_as_sdp_utils_does():
    """`sdp_utils.cpp`: flash needs sm80+, and on sm86/89 (L4, L40S, RTX 3090/4090, A6000) refuses a backward for
    head dims in (192, 224], or above 224 with dropout (`check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89
    _or_120`); the memory-efficient kernel then runs, or math where it cannot (GQA)."""
    from llmtune.catalogue import compute_capability

    q208, q256, q128 = (torch.empty(1, 8, 16, d, dtype=torch.bfloat16, device="meta") for d in (208, 256, 128))
    l4, h100, v100 = (compute_capability(name) for name in ("l4", "h100-80gb", "v100-32gb"))
    assert (l4, h100, v100) == ((8, 9), (9, 0), (7, 0))
    assert cuda_sdpa_backend(q208, None, False, h100) == "flash"
    assert cuda_sdpa_backend(q208, None, False, l4) == "efficient"
    assert cuda_sdpa_backend(q208, None, True, l4) == "math"  # GQA: no memory-efficient kernel either
    assert cuda_sdpa_backend(q256, None, False, l4) == "flash"
    assert cuda_sdpa_backend(q256, None, False, l4, dropout_p=0.1) == "efficient"
    assert cuda_sdpa_backend(q128, None, False, v100) == "efficient"  # before Ampere: no flash


def test_a_consumer_card_keeps_what_the_memory_efficient_kernel_keeps_where_flash_would_run():
    """Head dim 208, causal, no mask: flash on an H100; on an L4 (sm89) `sdp_utils.cpp` refuses flash's backward, and
    `_scaled_dot_product_efficient_attention` keeps the output, an fp32 log-sum-exp of (B, H, T rounded up to 32) and
    its RNG seed and offset (0-dim int64 each; attention.cu `_efficient_attention_forward`)."""
    from llmtune.catalogue import compute_capability

    b, h, t, d = 2, 4, 200, 208

    def kept_on(card: str) -> int:
        with FakeTensorMode():
            q = _leaf(b, h, t, d)
            with CudaKernels(compute_capability(card)):
                return _trace(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True), q)[1]

    out = b * h * t * d * BF16
    assert kept_on("l4") == out + b * h * _round_up(t, 32) * F32 + 16
    assert kept_on("h100-80gb") != kept_on("l4")
