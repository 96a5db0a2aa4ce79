"""chunked_cross_entropy and CausalLMWithLoss against transformers' own causal-LM loss (CPU, tiny models)."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.nn.functional as F

from benchmarks.loss import HeadTraffic
from llmtune.ops.loss import (
    CausalLMWithLoss,
    LowRank,
    chunked_cross_entropy,
    head_accumulation,
    resolve_loss_impl,
    runnable_impl,
)
from llmtune.ops.measure import PeakMemoryTracker

transformers = pytest.importorskip("transformers")


def _close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, name: str = "") -> None:
    """Elementwise rtol, with an absolute floor at rtol * max|expected| (tiny entries are noise)."""
    atol = rtol * float(expected.abs().max()) + 1e-12
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------- chunked_cross_entropy


def _inputs(n: int, h: int = 16, v: int = 50, bias: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.5
    b = torch.randn(v, generator=g) if bias else None
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::3] = -100  # ignored tokens, including the first
    return hidden, weight, b, labels


def _reference(hidden, weight, bias, labels, scale=1.0, softcap=None):
    z = F.linear(hidden, weight, bias).float() * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return F.cross_entropy(z, labels, reduction="sum")


def _grads(fn, *tensors):
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in tensors]
    loss = fn(*leaves)
    loss.backward()
    return loss.detach(), [t.grad if t is not None else None for t in leaves]


@pytest.mark.parametrize("n,chunk_size", [(37, 8), (37, 1024), (64, 16), (5, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_matches_cross_entropy_fp32(n, chunk_size, bias):
    hidden, weight, b, labels = _inputs(n, bias=bias)
    ref_loss, ref_grads = _grads(lambda h, w, bb: _reference(h, w, bb, labels), hidden, weight, b)
    loss, grads = _grads(
        lambda h, w, bb: chunked_cross_entropy(h, w, labels, bias=bb, chunk_size=chunk_size), hidden, weight, b
    )
    assert loss.dtype == torch.float32 and loss.dim() == 0
    _close(loss, ref_loss, 1e-5, "loss")
    for name, g, rg in zip(("hidden", "weight", "bias"), grads, ref_grads, strict=True):
        if rg is not None:
            _close(g, rg, 1e-5, name)
    assert torch.all(grads[0][labels == -100] == 0)


@pytest.mark.parametrize("scale,softcap", [(0.25, None), (1.0, 1.5), (2.0, 3.0)])
def test_chunked_logit_scale_and_softcap(scale, softcap):
    hidden, weight, b, labels = _inputs(29, bias=True)
    ref_loss, ref_grads = _grads(lambda h, w, bb: _reference(h, w, bb, labels, scale, softcap), hidden, weight, b)
    loss, grads = _grads(
        lambda h, w, bb: chunked_cross_entropy(h, w, labels, bias=bb, chunk_size=7, logit_scale=scale, softcap=softcap),
        hidden,
        weight,
        b,
    )
    _close(loss, ref_loss, 1e-5, "loss")
    for name, g, rg in zip(("hidden", "weight", "bias"), grads, ref_grads, strict=True):
        _close(g, rg, 1e-5, name)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_chunked_low_rank_term_matches_cross_entropy_fp32(softcap):
    """A LoRA'd lm_head: logits = h W^T + b + s u B^T, with u's and B's gradients (W frozen, as under LoRA)."""
    hidden, weight, b, labels = _inputs(37, bias=True)
    g = torch.Generator().manual_seed(1)
    u, lora_b = torch.randn(37, 3, generator=g), torch.randn(50, 3, generator=g)

    def reference(h, u, lb):
        z = F.linear(h, weight, b) + 0.5 * u @ lb.T
        return _reference(z, torch.eye(50), None, labels, 0.7, softcap)  # z through an identity head

    def chunked(h, u, lb):
        lora = LowRank(u, lb, 0.5)
        return chunked_cross_entropy(
            h, weight, labels, bias=b, lora=lora, chunk_size=8, logit_scale=0.7, softcap=softcap
        )

    ref_loss, ref_grads = _grads(reference, hidden, u, lora_b)
    loss, grads = _grads(chunked, hidden, u, lora_b)
    _close(loss, ref_loss, 1e-5, "loss")
    for name, got, want in zip(("hidden", "u", "lora_b"), grads, ref_grads, strict=True):
        _close(got, want, 1e-5, name)
    assert torch.all(grads[1][labels == -100] == 0)


def test_chunked_frozen_weight_and_hidden_without_grad():
    hidden, weight, _, labels = _inputs(40)
    # Frozen lm_head (LoRA): only hidden gets a gradient, and no V x h buffer is kept.
    h = hidden.clone().requires_grad_(True)
    chunked_cross_entropy(h, weight, labels, chunk_size=16).backward()
    h_ref = hidden.clone().requires_grad_(True)
    _reference(h_ref, weight, None, labels).backward()
    _close(h.grad, h_ref.grad, 1e-5, "hidden")
    # Hidden without grad: only the weight gets one.
    w = weight.clone().requires_grad_(True)
    chunked_cross_entropy(hidden, w, labels, chunk_size=16).backward()
    w_ref = weight.clone().requires_grad_(True)
    _reference(hidden, w_ref, None, labels).backward()
    _close(w.grad, w_ref.grad, 1e-5, "weight")
    # Nothing needs grad: just the value.
    _close(chunked_cross_entropy(hidden, weight, labels), _reference(hidden, weight, None, labels), 1e-5)


def test_chunked_scales_by_grad_output_and_all_ignored():
    hidden, weight, _, labels = _inputs(20)
    # Normalised by tokens, as the training loop does: grad_output = 1/7.
    loss, grads = _grads(lambda h, w: chunked_cross_entropy(h, w, labels, chunk_size=6) / 7, hidden, weight)
    ref_loss, ref_grads = _grads(lambda h, w: _reference(h, w, None, labels) / 7, hidden, weight)
    _close(loss, ref_loss, 1e-5)
    for g, rg in zip(grads, ref_grads, strict=True):
        _close(g, rg, 1e-5)
    # A micro-batch with no trained token: loss 0 and zero gradients, as HF's sum gives.
    h = hidden.clone().requires_grad_(True)
    loss = chunked_cross_entropy(h, weight, torch.full_like(labels, -100))
    loss.backward()
    assert loss.item() == 0.0 and torch.all(h.grad == 0)


def test_chunked_no_grad_keeps_no_gradient_buffers():
    hidden, weight, _, labels = _inputs(64, h=32, v=1000)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    labels = labels.int()  # int32 labels too
    with torch.no_grad(), PeakMemoryTracker("cpu", baseline=[hidden, weight, labels]) as counter:
        loss = chunked_cross_entropy(hidden, weight, labels, chunk_size=16)
    _close(loss, _reference(hidden.detach(), weight.detach(), None, labels.long()), 1e-5)
    # One 16 x V fp32 chunk alive at a time and a few small tensors; no V x h weight gradient.
    growth = counter.peak_bytes - counter.entry_bytes
    assert growth < 16 * 1000 * 4 * 1.2, growth


def test_chunked_bf16_autocast_matches_autocast_reference():
    hidden, weight, b, labels = _inputs(64, h=32, v=300, bias=True)

    def ref(h, w, bb):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = F.linear(h, w, bb)  # bf16, as the lm_head under autocast
        assert logits.dtype == torch.bfloat16
        return F.cross_entropy(logits.float(), labels, reduction="sum")

    def chunked(h, w, bb):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return chunked_cross_entropy(h, w, labels, bias=bb, chunk_size=16)

    ref_loss, ref_grads = _grads(ref, hidden, weight, b)
    loss, grads = _grads(chunked, hidden, weight, b)
    assert loss.dtype == torch.float32
    # Same bf16 logits, fp32 softmax: the loss agrees to fp32 summation order.
    _close(loss, ref_loss, 1e-5, "loss")
    # Grads go through bf16 matmuls in both; chunked sums the weight grad over chunks in fp32 where the
    # reference rounds one bf16 matmul: a few bf16 ulps (2**-8 = 0.4%) apart, in norm.
    for name, g, rg in zip(("hidden", "weight", "bias"), grads, ref_grads, strict=True):
        assert g.dtype == rg.dtype == torch.float32
        assert _rel_err(g, rg) < 1e-2, name
    # And both are close to the fp32 truth, in norm, to bf16 accuracy.
    _, fp32_grads = _grads(lambda h, w, bb: _reference(h, w, bb, labels), hidden, weight, b)
    for g, tg in zip(grads, fp32_grads, strict=True):
        assert _rel_err(g, tg) < 2e-2


def test_chunked_bf16_inputs_without_autocast():
    hidden, weight, _, labels = _inputs(33, h=32, v=100)
    h = hidden.bfloat16().requires_grad_(True)
    w = weight.bfloat16().requires_grad_(True)
    loss = chunked_cross_entropy(h, w, labels, chunk_size=8)
    loss.backward()
    assert loss.dtype == torch.float32 and h.grad.dtype == w.grad.dtype == torch.bfloat16
    assert abs(loss.item() - _reference(h.float(), w.float(), None, labels).item()) / loss.item() < 1e-2


def test_chunked_rejects_bad_shapes():
    hidden, weight, _, labels = _inputs(10)
    with pytest.raises(ValueError, match="expected hidden"):
        chunked_cross_entropy(hidden[None], weight, labels)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_cross_entropy(hidden, weight, labels, chunk_size=0)


# ----------------------------------------------------------------------------- CausalLMWithLoss

V = 256


def _llama(tied: bool):
    return transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )


def _qwen2():
    return transformers.Qwen2Config(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )


def _gpt2():
    # Dropout off: train-mode tests compare two forwards.
    return transformers.GPT2Config(
        vocab_size=V,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )


def _gemma2():  # final_logit_softcapping, small so the tanh bends the tiny model's logits
    return transformers.Gemma2Config(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        final_logit_softcapping=0.3,
    )


def _cohere():  # logit_scale multiplies the logits
    return transformers.CohereConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        logit_scale=0.5,
    )


def _granite():  # logits_scaling divides the logits
    return transformers.GraniteConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        logits_scaling=4.0,
    )


CONFIGS = {
    "llama-tied": lambda: _llama(True),
    "llama-untied": lambda: _llama(False),
    "qwen2": _qwen2,
    "gpt2": _gpt2,
    "gemma2-softcap": _gemma2,
    "cohere-scale": _cohere,
    "granite-scaling": _granite,
}


def _model(name: str, seed: int = 0):
    torch.manual_seed(seed)
    config = CONFIGS[name]()
    config._attn_implementation = "eager" if name.startswith("gemma2") else "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config)
    # A random-init tiny model predicts ~uniformly; bigger logits make the test see the softmax shape.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
    return model


def _batch(seed: int = 0, b: int = 3, s: int = 11):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, V, (b, s), generator=g)
    attention_mask = torch.ones(b, s, dtype=torch.long)
    attention_mask[1, -4:] = 0  # right padding
    labels = input_ids.clone()
    labels[attention_mask == 0] = -100
    labels[0, :5] = -100  # a masked prompt
    return input_ids, attention_mask, labels


def _loss_and_grads(model, impl, autocast: bool = False, chunk_size: int = 4):
    model.zero_grad(set_to_none=True)
    wrapped = CausalLMWithLoss(model, impl, chunk_size=chunk_size)
    input_ids, attention_mask, labels = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = wrapped(input_ids, labels, attention_mask=attention_mask)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _assert_same(a, b, rtol: float):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert loss_a.dtype == loss_b.dtype == torch.float32 and loss_a.dim() == 0
    _close(loss_a, loss_b, rtol, "loss")
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_b:
        _close(grads_a[name], grads_b[name], rtol, name)


def _expected_sum(model, input_ids, attention_mask, labels):
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), reduction="sum")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_wrapper_chunked_equals_hf_fp32(name):
    model = _model(name)
    hf = _loss_and_grads(model, "hf")
    _assert_same(_loss_and_grads(model, "chunked"), hf, 1e-5)
    # "hf" is the SUM with the causal shift, not a mean.
    input_ids, attention_mask, labels = _batch()
    _close(hf[0], _expected_sum(model, input_ids, attention_mask, labels), 1e-5, "sum")


@pytest.mark.parametrize("name", ["llama-tied", "qwen2", "gpt2", "gemma2-softcap"])
def test_wrapper_chunked_close_to_hf_bf16_autocast(name):
    model = _model(name)
    loss_hf, grads_hf = _loss_and_grads(model, "hf", autocast=True)
    loss_ch, grads_ch = _loss_and_grads(model, "chunked", autocast=True)
    assert loss_ch.dtype == torch.float32
    # Both run the same bf16 decoder and bf16 lm_head matmul; the loss is fp32 on the same bf16 logits
    # (Gemma2's softcap runs in bf16 in HF, fp32 here: one bf16 rounding of the logits apart).
    assert abs(loss_ch.item() - loss_hf.item()) / loss_hf.item() < 2e-3
    # Gradients differ by bf16 rounding (2**-8) of the lm_head grads, propagated through bf16 layers:
    # measured <= 2e-3 in norm. Gemma2's bf16 softcap (tanh and its derivative in bf16) puts HF itself
    # ~9% from the fp32 gradients (chunked: ~5%), so there the two paths are ~8% apart.
    worst = max(_rel_err(grads_ch[n], grads_hf[n]) for n in grads_hf)
    assert worst < (0.15 if name.startswith("gemma2") else 1e-2), worst
    _, grads_fp32 = _loss_and_grads(model, "hf")
    worst_hf = max(_rel_err(grads_hf[n], grads_fp32[n]) for n in grads_fp32)
    worst_ch = max(_rel_err(grads_ch[n], grads_fp32[n]) for n in grads_fp32)
    # Chunked is no further from the fp32 gradients than HF's own bf16 path (with some slack).
    assert worst_ch < 1.5 * worst_hf + 1e-3, (worst_ch, worst_hf)


@pytest.mark.parametrize("name", ["llama-untied", "gpt2"])
def test_wrapper_gradient_checkpointing(name):
    model = _model(name)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    assert model.is_gradient_checkpointing
    _assert_same(_loss_and_grads(model, "chunked"), _loss_and_grads(model, "hf"), 1e-5)
    # Same numbers as without checkpointing.
    plain = _model(name)
    plain.train()
    _assert_same(_loss_and_grads(model, "chunked"), _loss_and_grads(plain, "hf"), 1e-5)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("autocast", [False, True])
def test_wrapper_lora(checkpointing, autocast):
    peft = pytest.importorskip("peft")
    model = _model("llama-untied")
    if checkpointing:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    lora = peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    )
    lora.train()
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)  # lm_head and embeddings frozen
    hf = _loss_and_grads(lora, "hf", autocast=autocast)
    chunked = _loss_and_grads(lora, "chunked", autocast=autocast)
    assert chunked[1].keys() == trainable == hf[1].keys()
    if autocast:
        assert abs(chunked[0].item() - hf[0].item()) / hf[0].item() < 2e-3
        assert max(_rel_err(chunked[1][n], hf[1][n]) for n in trainable) < 1e-2
    else:
        _assert_same(chunked, hf, 1e-5)
    assert CausalLMWithLoss(lora, "chunked").model is lora  # the loop saves adapters via .model


def _head_lora(peft, adapters: str, dropout: float = 0.1, **config):
    """llama-untied with LoRA on q_proj and the lm_head: fp32 weights and adapters, the autocast run's bf16, bf16
    weights beside peft's fp32 adapters, or everything bf16 (`peft.adapter_dtype: bf16` under bf16-true)."""
    from llmtune.model.adapters import cast_trained

    model = _model("llama-untied")
    if adapters in ("fp32-over-bf16", "bf16"):
        model.to(torch.bfloat16)
    lora_config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["lm_head", "q_proj"], init_lora_weights=False, **config
    )
    lora = peft.get_peft_model(model, lora_config)
    if adapters == "bf16":
        cast_trained(lora, torch.bfloat16)
    return lora.train()  # adapter dropout on: both paths draw the same masks from the same seed, in the same order


def _seeded(model, impl: str, autocast: bool = False):
    torch.manual_seed(1)
    return _loss_and_grads(model, impl, autocast=autocast)


@pytest.mark.parametrize("adapters", ["fp32", "autocast", "fp32-over-bf16", "bf16"])
def test_wrapper_lora_on_lm_head(adapters):
    peft = pytest.importorskip("peft")
    lora = _head_lora(peft, adapters)
    head = lora.base_model.model.lm_head
    assert {head.lora_A["default"].weight.dtype, head.weight.dtype} == {
        "fp32": {torch.float32},
        "autocast": {torch.float32},
        "fp32-over-bf16": {torch.float32, torch.bfloat16},
        "bf16": {torch.bfloat16},
    }[adapters]
    hf = _seeded(lora, "hf", autocast=adapters == "autocast")
    chunked = _seeded(lora, "chunked", autocast=adapters == "autocast")
    trained = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert {n for n in trained if "lm_head" in n} == {
        "base_model.model.lm_head.lora_A.default.weight",
        "base_model.model.lm_head.lora_B.default.weight",
    }
    assert chunked[1].keys() == trained == hf[1].keys()
    if adapters in ("fp32", "fp32-over-bf16"):  # the same matmuls in the same dtypes, the same roundings
        _assert_same(chunked, hf, 1e-5)
        return
    # With bf16 adapters, the lm_head's adapter gradients are bf16 matmuls that HF runs over all rows at once and the
    # chunked loss sums over chunks in fp32: as the bf16 comparisons above measure it (<= 2e-3 in norm).
    assert abs(chunked[0].item() - hf[0].item()) / hf[0].item() < 2e-3
    worst = max(_rel_err(chunked[1][n], hf[1][n]) for n in trained)
    assert worst < 1e-2, worst


def test_wrapper_lora_on_lm_head_disabled_is_the_base_model():
    peft = pytest.importorskip("peft")
    lora = _head_lora(peft, "fp32", dropout=0.0)
    input_ids, attention_mask, labels = _batch()
    with torch.no_grad():
        adapted = CausalLMWithLoss(lora, "chunked")(input_ids, labels, attention_mask=attention_mask)
        with lora.disable_adapter():
            base = CausalLMWithLoss(lora, "chunked")(input_ids, labels, attention_mask=attention_mask)
            base_hf = CausalLMWithLoss(lora, "hf")(input_ids, labels, attention_mask=attention_mask)
    _close(base, base_hf, 1e-5)
    assert abs(adapted.item() - base.item()) > 1e-3 * base.item()  # the adapter changes the loss it computes


def test_dora_on_lm_head_is_left_to_hf_with_a_reason():
    peft = pytest.importorskip("peft")
    from llmtune.ops.loss import runnable_impl

    lora = _head_lora(peft, "fp32", use_dora=True)
    with pytest.raises(ValueError, match=r"does not compute a DoraLinearVariant \(DoRA\) on the lm_head; use 'hf'"):
        CausalLMWithLoss(lora, "chunked")
    assert runnable_impl(lora, "chunked") == "hf"  # what training and the estimate run (Objective.module)
    assert runnable_impl(_head_lora(peft, "fp32"), "chunked") == "chunked"


def test_wrapper_under_ddp(tmp_path):
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("torch.distributed not built")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = _model("llama-tied")
        ddp = torch.nn.parallel.DistributedDataParallel(CausalLMWithLoss(model, "chunked"))
        input_ids, attention_mask, labels = _batch()
        loss = ddp(input_ids, labels, attention_mask=attention_mask)
        loss.backward()
        assert all(p.grad is not None for p in model.parameters())
        _close(loss.detach(), _loss_and_grads(model, "hf")[0], 1e-5)
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- resolve_loss_impl


@pytest.mark.parametrize("name", list(CONFIGS))
def test_resolve_auto_picks_chunked_for_reproducible_models(name):
    assert resolve_loss_impl("auto", CONFIGS[name]()) == "chunked"
    assert resolve_loss_impl("hf", CONFIGS[name]()) == "hf"


def test_resolve_refuses_what_chunked_does_not_reproduce(caplog):
    falcon = transformers.FalconH1Config(lm_head_multiplier=0.5)
    assert resolve_loss_impl("auto", falcon) == "hf"
    with pytest.raises(ValueError, match="lm_head_multiplier"):
        resolve_loss_impl("chunked", falcon)
    moe = transformers.MixtralConfig(output_router_logits=True)
    assert resolve_loss_impl("auto", moe) == "hf"
    with pytest.raises(ValueError, match="output_router_logits"):
        resolve_loss_impl("chunked", moe)
    assert resolve_loss_impl("auto", transformers.MixtralConfig()) == "chunked"
    # Gemma 3 keeps the decoder config under text_config.
    gemma3 = transformers.Gemma3Config(text_config={"final_logit_softcapping": 30.0})
    assert resolve_loss_impl("auto", gemma3) == "chunked"
    # Unknown model type: auto stays on HF; explicit chunked is allowed with a warning.
    unknown = transformers.BloomConfig()
    assert resolve_loss_impl("auto", unknown) == "hf"
    with caplog.at_level(logging.WARNING, logger="llmtune.ops.loss"):
        assert resolve_loss_impl("chunked", unknown) == "chunked"
    assert "not verified" in caplog.text
    with pytest.raises(ValueError, match="loss_impl must be"):
        resolve_loss_impl("fast", unknown)
    with pytest.raises(ValueError, match="resolve 'auto' first"):
        CausalLMWithLoss(_model("gpt2"), "auto")


# ----------------------------------------------------------------------------- memory


def _peak_live_bytes(model, impl, input_ids, labels, chunk_size):
    wrapped = CausalLMWithLoss(model, impl, chunk_size=chunk_size)
    model.zero_grad(set_to_none=True)
    with PeakMemoryTracker("cpu", baseline=[model, input_ids, labels]) as counter:
        wrapped(input_ids, labels).backward()
    return counter.peak_bytes - counter.entry_bytes


def test_chunked_peak_memory_below_hf():
    torch.manual_seed(0)
    vocab = 16384
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    input_ids = torch.randint(0, vocab, (2, 256))
    n = input_ids.numel()
    hf = _peak_live_bytes(model, "hf", input_ids, input_ids, 128)
    chunked = _peak_live_bytes(model, "chunked", input_ids, input_ids, 128)
    # HF's loss backward holds ~12*N*V bytes (memory-facts.md); the counter must see that much.
    assert hf >= 10 * n * vocab, hf
    # Chunked: one fp32 chunk x V buffer (4*128*V = N*V here) + parameter grads; measured 1.4*N*V.
    assert chunked < 0.2 * hf, (chunked, hf)
    assert chunked < 2 * n * vocab, chunked


# ----------------------------------------------------------------------------- the head's traffic and host syncs


def _sft_batch(rows: int, length: int, prompt: int, vocab: int) -> dict[str, torch.Tensor]:
    """A micro-batch as the SFT objective collates it: `rows` rows of `length` tokens, the first `prompt` of each
    not trained."""
    from llmtune.objectives import objective_named

    g = torch.Generator().manual_seed(0)
    examples = []
    for _ in range(rows):
        ids = torch.randint(1, vocab, (length,), generator=g).tolist()
        examples.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return objective_named("sft", "none").collate(examples, pad_token_id=0, packed=False)


def test_a_gpu_plan_runs_the_planned_chunk_of_at_least_1024_rows_reading_the_head_twice_a_chunk():
    """Planned for an H100 (as `llmtune estimate --gpu h100-80gb` plans, on this CPU): the estimate traces the chunk the
    plan carries to training (`BatchPlan.chunk_rows`), at least 1024 rows, and the loss of a step run with it reads the
    head weight twice a chunk (its logits, the hidden states' gradient) over the trained tokens alone, and allocates
    nothing of the weight's size but the fp32 gradient it accumulates into, in place."""
    from llmtune.objectives import objective_named
    from llmtune.plan import recipe_for_model
    from llmtune.plan.planning import plan_recipe

    vocab = 16384
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False,
    )  # fmt: skip
    recipe = recipe_for_model("tiny", config, method="full", seq_len=2048, device="cuda")
    plan, _ = plan_recipe(recipe, config, device="cuda", gpu="h100-80gb", budget_bytes=70 * 2**30, num_processes=1)
    chunk = plan.estimate.settings["chunk_size"]
    assert chunk >= 1024 and plan.chunk_rows == chunk

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.get_input_embeddings().requires_grad_(False)  # its gradient is V x h too, and none of the head's
    module = objective_named("sft", "none").module(model, "chunked", torch.device("cpu"), None, chunk_size=chunk)
    batch = _sft_batch(rows=2, length=2048, prompt=600, vocab=vocab)
    trained = batch["loss_rows"].numel()
    assert trained > chunk  # more than one chunk
    with HeadTraffic(model.lm_head.weight) as traffic:
        module(**batch).backward()
    assert traffic.reads <= 2 * -(-trained // chunk), (traffic.reads, trained, chunk)
    assert traffic.allocated == [torch.float32]  # the weight's gradient, summed over the chunks in place


def test_the_head_weight_gradient_is_summed_in_place_under_autocast():
    """bf16 autocast, 4 chunks: the weight's size is allocated for its bf16 copy (the matmuls' operand, as lm_head's
    autocast makes it) and the fp32 gradient, once each, never per chunk (where `grad_c.t() @ h` made a V x h product
    per chunk to add in). On a CPU the product is made a block of the weight's rows at a time, each no larger than the
    chunk's gradient (here chunk 32 < hidden 96: blocks of a third of V); CUDA's fp32-output matmul, which needs no
    block, cannot run here."""
    hidden, weight, _, labels = _inputs(192, h=96, v=300)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16), HeadTraffic(weight) as traffic:
        chunked_cross_entropy(hidden, weight, labels, chunk_size=32).backward()
    assert sorted(traffic.allocated, key=str) == [torch.bfloat16, torch.float32]
    assert traffic.reads == 1 + 2 * 4  # the cast, then 2 a chunk: 128 trained rows in chunks of 32


def test_the_head_says_how_it_sums_a_16_bit_gradient_on_a_cpu(caplog):
    """A CPU has no fp32-output GEMM: the blocks, and why (`make gpu-check` reports it for its device). A run's set-up
    says it only where the device has a choice (CUDA): not for a CPU's model, nor for the planner's (fake tensors that
    are a CPU's whatever it plans for), whose line on a GPU machine would name the wrong path."""
    from llmtune.ops import loss

    assert head_accumulation("cpu") == (
        "16-bit products a block of rows at a time, added to the fp32 gradient (cpu has no fp32-output GEMM)"
    )
    caplog.set_level(logging.INFO, logger="llmtune")
    assert runnable_impl(_model("llama-tied"), "chunked") == "chunked"
    assert not [m for m in caplog.messages if "lm_head gradients summed" in m]
    loss._say_head_accumulation.__wrapped__(torch.device("cpu"))  # what it would say: the line reaches the log
    assert [m for m in caplog.messages if "lm_head gradients summed" in m] == [
        f"chunked loss on cpu: 16-bit lm_head gradients summed by {head_accumulation('cpu')}"
    ]


@pytest.mark.gpu
def test_the_head_says_once_at_set_up_how_it_sums_a_16_bit_gradient_on_this_gpu(caplog, monkeypatch):
    """Issue 54: torch's first fp32-output addmm refused an fp32 gradient beside bf16 operands, and the loss took the
    blocks without a word. A run's set-up (`runnable_impl`, as `Objective.module` calls it) says which path, once;
    either path sums the weight's gradient as the CPU's blocks do, but for the blocks' bf16 products (a few bf16 ulps,
    2**-8 = 0.4%, apart in norm)."""
    from llmtune.ops import loss

    monkeypatch.setattr(loss, "_say_head_accumulation", functools.cache(loss._say_head_accumulation.__wrapped__))
    caplog.set_level(logging.INFO, logger="llmtune")
    model = _model("llama-tied").cuda()
    for _ in range(2):
        runnable_impl(model, "chunked")
    said = [m for m in caplog.messages if "lm_head gradients summed" in m]
    assert said == [f"chunked loss on cuda:0: 16-bit lm_head gradients summed by {head_accumulation('cuda:0')}"]

    hidden, weight, _, labels = _inputs(192, h=96, v=300)
    grads = {}
    for device in ("cpu", "cuda"):
        w = weight.detach().to(device).requires_grad_(True)
        with torch.autocast(device, dtype=torch.bfloat16):
            chunked_cross_entropy(hidden.to(device), w, labels.to(device), chunk_size=32).backward()
        grads[device] = w.grad.cpu()
    assert _rel_err(grads["cuda"], grads["cpu"]) < 1e-2


@pytest.mark.parametrize("objective", ["sft", "dpo"])
def test_the_loss_never_waits_for_the_device(objective):
    """No host synchronisation (`.item()`, `nonzero`, ...) in the loss's forward and backward: the trained rows come
    with the batch from its collate, found on the host (`loss_rows`). The decoder's forward is not counted
    (transformers' mask creation syncs once; llmtune.model.attention's packed path is what avoids it)."""
    from llmtune.objectives import objective_named
    from llmtune.recipe import PreferenceConfig

    torch.manual_seed(0)
    model = _model("llama-untied")
    decoder = model.get_decoder()
    if objective == "sft":
        module = CausalLMWithLoss(model, "chunked", chunk_size=8)
        batch = _sft_batch(rows=2, length=20, prompt=5, vocab=model.config.vocab_size)
    else:
        from llmtune.objectives.pair_losses import PreferenceModel

        module = PreferenceModel(model, "chunked", "dpo", PreferenceConfig(), "precomputed", chunk_size=8)
        pair = {"input_ids": list(range(3, 19)), "labels": [-100] * 4 + list(range(7, 11)) + [-100] * 4 + [5] * 4}
        pair |= {"position_ids": list(range(8)) * 2, "ref_logps": [-3.0, -4.0]}
        batch = objective_named("dpo", "precomputed").collate([pair, pair], pad_token_id=0, packed=True)
    with HeadTraffic(model.get_output_embeddings().weight, decoder) as traffic:
        module(**batch).reshape(-1)[0].backward()
    assert traffic.syncs == []


@pytest.mark.parametrize("micro_batch_size", ["auto", 4])
def test_training_runs_the_chunk_its_plan_carries(tiny_recipe, micro_batch_size):
    """The loss training builds runs the plan's chunk rows (`BatchPlan.chunk_rows`), which the planner's estimate
    traced where it planned (auto), and which a micro-batch fixed by the recipe takes from the same rule (the CPU's,
    here)."""
    from llmtune.recipe import load_recipe
    from llmtune.run.setup import build

    run = build(load_recipe(tiny_recipe(training__micro_batch_size=micro_batch_size)))
    module = run.accelerator.unwrap_model(run.model)
    assert module.chunk_size == run.plan.chunk_rows
    if run.plan.estimate is not None:
        assert run.plan.estimate.settings["chunk_size"] == run.plan.chunk_rows
