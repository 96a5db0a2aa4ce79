"""Packed rows' attention: each document alone, for every attention implementation a run accepts, and no more work
than the documents' causal blocks; for SFT's rows and for preference pairs (each sequence of a pair a document).

flash-attn cannot run on a CPU: `reference_flash_attn` registers, where transformers' flash_attention_2 path looks
its kernels up, a pure-torch implementation of flash-attn's contract (`flash_attn_func` on [B, L, H, D],
`flash_attn_varlen_func` on [total, H, D] with cumulative offsets), so that transformers' own flash path runs."""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from llmtune.model.load import load_model
from llmtune.objectives import objective_for
from llmtune.ops.loss import CausalLMWithLoss
from llmtune.recipe import load_recipe

# Two rows of documents (lengths): a micro-batch of 2, the second row shorter (padded in the batch).
ROWS = [[5, 7, 3], [9, 4]]
# Rows long enough (1,024 tokens at 4 heads x 16) that a CPU runs one SDPA per document (`dense_is_cheaper`).
LONG_ROWS = [[200, 256, 180, 240, 148], [256, 250, 230, 200]]


def _documents(rows: list[list[int]] = ROWS) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    docs = []
    for n in (n for row in rows for n in row):
        ids = torch.randint(3, 100, (n,), generator=g).tolist()
        docs.append({"input_ids": ids, "labels": [-100, *ids[1:]]})  # an example's first token is never a target
    return docs


def _packed_rows(docs: list[dict], shape: list[list] = ROWS) -> list[dict]:
    """`docs` packed into rows of `len(shape[i])` each, position ids restarting per document (a pair's own kept)."""
    rows, it = [], iter(docs)
    for lengths in shape:
        row = [next(it) for _ in lengths]
        rows.append(
            {
                "input_ids": [t for d in row for t in d["input_ids"]],
                "labels": [t for d in row for t in d["labels"]],
                "position_ids": [p for d in row for p in d.get("position_ids", range(len(d["input_ids"])))],
            }
        )
    return rows


# Rows of preference pairs (chosen, rejected lengths): a micro-batch of 2, the second row shorter (padded).
PAIR_ROWS = [[(6, 8), (5, 4)], [(9, 7)]]
# Rows of 1,024 and 1,000 tokens: a CPU runs one SDPA per sequence (`dense_is_cheaper`), as for LONG_ROWS.
LONG_PAIR_ROWS = [[(200, 256), (180, 240), (70, 78)], [(256, 250), (230, 200), (40, 24)]]
PROMPT = 3  # each sequence's first tokens, untrained, as a pair's prompt


def _pairs(rows: list[list[tuple[int, int]]] = PAIR_ROWS) -> list[dict]:
    """Pairs as llmtune.data.pairs stores them: the chosen then the rejected sequence, position ids restarting, each
    trained on its completion only."""
    g = torch.Generator().manual_seed(1)
    pairs = []
    for lengths in (pair for row in rows for pair in row):
        sides = [torch.randint(3, 100, (n,), generator=g).tolist() for n in lengths]
        pairs.append(
            {
                "input_ids": [t for side in sides for t in side],
                "labels": [t if i >= PROMPT else -100 for side in sides for i, t in enumerate(side)],
                "position_ids": [p for n in lengths for p in range(n)],
            }
        )
    return pairs


# ---------------------------------------------------------------- flash-attn's contract in pure torch


def _sdpa_bshd(q, k, v, scale, causal) -> torch.Tensor:
    """[B, L, H, D] in and out; flash-attn aligns the causal mask bottom-right (equal lengths here)."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2)


def flash_attn_func(
    q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, deterministic=False
):
    return _sdpa_bshd(q, k, v, softmax_scale, causal)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    deterministic=False,
):
    assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)  # flash-attn takes ints
    bounds = cu_seqlens_q.tolist()
    spans = list(zip(bounds, bounds[1:], strict=False))
    assert bounds == cu_seqlens_k.tolist() and max(b - a for a, b in spans) <= max_seqlen_q
    parts = [_sdpa_bshd(q[None, a:b], k[None, a:b], v[None, a:b], softmax_scale, causal)[0] for a, b in spans]
    return torch.cat(parts)


@contextlib.contextmanager
def reference_flash_attn():
    """transformers' flash_attention_2 path (modeling_flash_attention_utils) with the kernels above."""
    import transformers.modeling_flash_attention_utils as fa

    names = [
        "_loaded_implementation",
        "_flash_fn",
        "_flash_varlen_fn",
        "_flash_with_kvcache_fn",
        "_pad_fn",
        "_unpad_fn",
    ]
    names += ["_process_flash_kwargs_fn", "_process_with_kvcache_kwargs_fn"]  # the latter: transformers >= 5.2x
    saved = {n: getattr(fa, n) for n in names if hasattr(fa, n)}
    fa._loaded_implementation = "flash_attention_2"
    fa._flash_fn, fa._flash_varlen_fn, fa._flash_with_kvcache_fn = flash_attn_func, flash_attn_varlen_func, None
    fa._pad_fn, fa._unpad_fn = fa._pad_input, fa._unpad_input
    fa._process_flash_kwargs_fn = fa._lazy_define_process_function(flash_attn_varlen_func)
    if "_process_with_kvcache_kwargs_fn" in saved:
        fa._process_with_kvcache_kwargs_fn = dict
    try:
        yield
    finally:
        for n, value in saved.items():
            setattr(fa, n, value)


# ---------------------------------------------------------------- packed = unpacked, every implementation


def _model(tiny_recipe, attn: str, load_as: str | None = None, **overrides) -> tuple[torch.nn.Module, object]:
    """The model a packed run loads (`load_model`; SFT unless `overrides` say otherwise), and its objective;
    flash_attention_2 is loaded as sdpa (no flash-attn here) and then switched, as transformers reads the
    implementation at every forward."""
    recipe = load_recipe(tiny_recipe(model__attn_implementation=load_as or attn, **overrides))
    config = __import__("transformers").AutoConfig.from_pretrained(recipe.model.name_or_path)
    model = load_model(recipe, "fp32", config).eval()
    if load_as is not None:
        model.config._attn_implementation = attn
    return model, objective_for(recipe)


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=True)


@contextlib.contextmanager
def varlen_kernel(kernel: str, monkeypatch):
    """`llmtune.model.attention`'s kernel forced: flash's varlen (as on a GPU, by the reference above), the CPU's
    per-document SDPA, or its block-mask SDPA."""
    import llmtune.model.attention as attention

    if kernel == "flash":
        monkeypatch.setattr(attention, "_flash_kernel", lambda: _reference_varlen)
        with attention.planned_device("cuda"), monkeypatch.context() as m:
            m.setattr(attention, "_runs_flash", lambda query, dropout: True)  # a 16-bit dtype on a GPU
            yield
        return
    monkeypatch.setattr(attention, "CPU_MASKED_PRODUCTS_PER_TOKEN", 10**12 if kernel == "block_mask" else 0)
    yield


CASES = ["eager", "flash_attention_2", "sdpa:per_document", "sdpa:block_mask", "sdpa:flash"]


@pytest.mark.parametrize("case", CASES)
def test_packed_micro_batch_loss_equals_documents_alone(case, tiny_recipe, monkeypatch):
    """A micro-batch of 2 packed rows, as a packed SFT run collates and computes it, has the summed loss of its
    documents run one by one: eager; flash_attention_2 (transformers keeps position-id packing apart only at batch
    size 1, and attended across documents before); sdpa, which a packed SFT run loads as `llmtune_varlen`, with each
    of its kernels."""
    attn, _, kernel = case.partition(":")
    model, objective = _model(tiny_recipe, attn, load_as="sdpa" if attn == "flash_attention_2" else None)
    assert model.config._attn_implementation == ("llmtune_varlen" if attn == "sdpa" else attn)
    module = CausalLMWithLoss(model, "chunked")
    docs = _documents()
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(reference_flash_attn() if attn == "flash_attention_2" else contextlib.nullcontext())
        stack.enter_context(varlen_kernel(kernel, monkeypatch) if kernel else contextlib.nullcontext())
        together = module(**objective.collate(_packed_rows(docs), pad_token_id=0, packed=True))
        alone = sum(module(**objective.collate([d], pad_token_id=0, packed=False)) for d in docs)
    assert torch.allclose(together, alone, rtol=1e-5, atol=1e-4), (case, together.item(), alone.item())


# ---------------------------------------------------------------- attention work, counted


class ScoreCount(TorchFunctionMode):
    """The q x k score elements the SDPA calls of a forward are asked to compute, from their shapes: all of
    [L_q, L_k] where a mask is given (a masked kernel computes every score, then masks it), the causal triangle
    L(L+1)/2 under is_causal; per batch row and head. Also eager's q @ k^T matmuls (4-d, contracting head dim)."""

    def __init__(self) -> None:
        super().__init__()
        self.elements = 0
        self.masks: list[tuple[int, ...]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k = args[0], args[1]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            (*lead, lq, _), lk = q.shape, k.shape[-2]
            causal = kwargs.get("is_causal", False) and mask is None
            self.elements += math.prod(lead) * (lq * (lq + 1) // 2 if causal else lq * lk)
            if mask is not None:
                self.masks.append(tuple(mask.shape))
        elif func is torch.matmul and args[0].dim() == 4 and args[1].shape[-2] == args[0].shape[-1]:
            q, kt = args[0], args[1]
            self.elements += math.prod(q.shape[:-1]) * kt.shape[-1]
        return func(*args, **kwargs)


@pytest.mark.parametrize("kernel", ["cpu", "flash"])
def test_packed_attention_computes_only_each_documents_causal_block(kernel, tiny_recipe, monkeypatch):
    """The attention a packed SFT run loads by default computes, on a packed micro-batch, exactly the causal blocks of
    its documents (and of each row's padding, a span of its own): per layer and head, the sum of l(l+1)/2, and no
    [rows, 1, L, L] mask; on a CPU at rows long enough for one SDPA per document to be the faster kernel, and through
    flash's varlen kernel (here its reference), as on a GPU. Before, the block mask made SDPA compute every row's
    full L x L."""
    model, objective = _model(tiny_recipe, "sdpa")
    batch = objective.collate(_packed_rows(_documents(LONG_ROWS), LONG_ROWS), pad_token_id=0, packed=True)
    width = batch["input_ids"].shape[1]
    spans = [n for row in LONG_ROWS for n in row] + [width - sum(row) for row in LONG_ROWS if sum(row) < width]
    heads, layers = model.config.num_attention_heads, model.config.num_hidden_layers
    counted = ScoreCount()
    with torch.no_grad(), varlen_kernel(kernel, monkeypatch) if kernel == "flash" else contextlib.nullcontext():
        with counted:
            CausalLMWithLoss(model, "chunked")(**batch)
    assert counted.masks == []
    assert counted.elements == layers * heads * sum(n * (n + 1) // 2 for n in spans)


def test_under_mixed_precision_a_gpu_runs_flashs_varlen_kernel_in_16_bit(tiny_recipe, monkeypatch):
    """bf16 autocast (mixed precision, fp32 weights): q and k reach attention in fp32, promoted by the rotary embeddings
    of the fp32 residual stream. Attention casts them to bf16 as SDPA would, so a GPU runs flash's 16-bit varlen kernel.
    Before, a GPU fell back to SDPA once per document, reading the offsets on the host in every layer."""
    import llmtune.model.attention as attention

    model, objective = _model(tiny_recipe, "sdpa")
    batch = objective.collate(_packed_rows(_documents(LONG_ROWS), LONG_ROWS), pad_token_id=0, packed=True)
    ran = []

    def flash(q, k, v, *args):
        ran.append((q.dtype, k.dtype, v.dtype))
        return _reference_varlen(q, k, v, *args)

    monkeypatch.setattr(attention, "_flash_kernel", lambda: flash)
    monkeypatch.setattr(attention, "per_document_sdpa", None)  # not a kernel this run may take
    with torch.no_grad(), attention.planned_device("cuda"), torch.autocast("cpu", dtype=torch.bfloat16):
        CausalLMWithLoss(model, "chunked")(**batch)
    assert ran == [(torch.bfloat16,) * 3] * model.config.num_hidden_layers


# ---------------------------------------------------------------- preference pairs


def _dpo(tiny_recipe, attn: str, reference: str, load_as: str | None = None) -> tuple[torch.nn.Module, object, Any]:
    """The model a packed DPO run loads, the module it trains (with its frozen copy, reference "copy") and the
    objective's collate."""
    pairs = [{"path": "pairs.jsonl", "format": "preference"}]  # read by no step here: the recipe must name one
    overrides = dict(training__objective="dpo", data__train=pairs, preference__reference=reference)
    model, objective = _model(tiny_recipe, attn, load_as, **overrides)
    collate = functools.partial(objective.collate, pad_token_id=0)
    return model, objective.module(model, "chunked", torch.device("cpu"), None), collate


@pytest.mark.parametrize("case", ["eager", "flash_attention_2", "sdpa"])
def test_packed_pairs_log_probs_equal_the_pairs_alone(case, tiny_recipe):
    """A micro-batch of 2 packed rows of pairs, as a packed DPO run collates it, gives each sequence the log-prob it
    has in its own row: eager; flash_attention_2 (before, the pairs' forwards passed no documents and a micro-batch of
    2 attended across pairs); sdpa, which a packed DPO run now loads as `llmtune_varlen` (before: sdpa and its
    block mask). Through `reference_only`, the forward a precomputed reference runs through the prepared module."""
    model, module, collate = _dpo(tiny_recipe, case, "precomputed", "sdpa" if case == "flash_attention_2" else None)
    assert model.config._attn_implementation == ("llmtune_varlen" if case == "sdpa" else case)
    pairs = _pairs()
    with torch.no_grad(), reference_flash_attn() if case == "flash_attention_2" else contextlib.nullcontext():
        together = module(**collate(_packed_rows(pairs, PAIR_ROWS), packed=True), reference_only=True)
        alone = torch.cat([module(**collate([p], packed=False), reference_only=True) for p in pairs])
    assert torch.allclose(together, alone, rtol=1e-5, atol=1e-4), (case, together, alone)


@pytest.mark.parametrize("kernel", ["cpu", "flash"])
def test_packed_pairs_attention_computes_only_each_sequences_causal_block(kernel, tiny_recipe, monkeypatch):
    """A packed DPO step with a frozen copy for its reference (`objectives.base.frozen_copy`) computes, in its two
    forwards (the reference's, the policy's), exactly the causal blocks of the pairs' sequences (and of the padding),
    and builds no [rows, 1, L, L] mask: the copy runs the policy's attention. Before, pairs ran sdpa with the block
    mask, every row's full L x L."""
    model, module, collate = _dpo(tiny_recipe, "sdpa", "copy")
    batch = collate(_packed_rows(_pairs(LONG_PAIR_ROWS), LONG_PAIR_ROWS), packed=True)
    width = batch["input_ids"].shape[1]
    spans = [n for row in LONG_PAIR_ROWS for pair in row for n in pair]
    spans += [width - sum(map(sum, row)) for row in LONG_PAIR_ROWS if sum(map(sum, row)) < width]
    heads, layers = model.config.num_attention_heads, model.config.num_hidden_layers
    counted = ScoreCount()
    with torch.no_grad(), varlen_kernel(kernel, monkeypatch) if kernel == "flash" else contextlib.nullcontext():
        with counted:
            module(**batch)
    assert counted.masks == []
    assert counted.elements == 2 * layers * heads * sum(n * (n + 1) // 2 for n in spans)
