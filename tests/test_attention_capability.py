"""Packed rows' attention kernel by the card's compute capability. Flash's varlen kernels (torch's `varlen_attn`,
flash-attn's) run on Ampere (sm80) and newer only, and raise "FlashAttention only supports Ampere GPUs or newer"
below; a T4 (sm75) or a V100 (sm70), where `precision: auto` trains in fp16, runs SDPA per document or masked
instead. The run and the estimator's trace of a step on a named card take that choice from one rule
(`llmtune.model.attention.flash_varlen_runs`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import LlamaConfig

import llmtune.model.attention as attention
import llmtune.plan.cache as cache
import llmtune.plan.kernels as kernels
from llmtune.catalogue import compute_capability
from llmtune.plan.estimate import estimate

CARDS = [("t4", False), ("v100-32gb", False), ("a100-80gb", True), ("h100-80gb", True)]


@pytest.mark.parametrize(("capability", "flash"), [((7, 5), False), ((7, 0), False), ((8, 0), True), ((9, 0), True)])
def test_flash_varlen_runs_on_ampere_and_newer_only(capability, flash):
    """16-bit, head dim 128, no dropout: flash's varlen kernel from sm80 on; none on a T4 or V100, in either 16-bit
    dtype (a V100 has no bf16 kernels either); none on a CPU or in fp32 anywhere."""
    for dtype in (torch.float16, torch.bfloat16):
        assert attention.flash_varlen_runs("cuda", capability, dtype, 128, 0.0) is flash
    assert not attention.flash_varlen_runs("cuda", capability, torch.float32, 128, 0.0)
    assert not attention.flash_varlen_runs("cpu", capability, torch.float16, 128, 0.0)


@pytest.mark.parametrize(("card", "flash"), CARDS)
def test_a_run_on_a_cuda_card_reads_its_capability(card, flash, monkeypatch):
    """A run's fp16 q on a CUDA device (a fake tensor: this machine has none) takes flash's varlen kernel as the
    device's capability allows; before, on a T4 or V100 too, where the kernel refused the first forward."""
    major, minor = compute_capability(card)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(major=major, minor=minor))
    monkeypatch.setattr(attention, "_flash_kernel", lambda: _refuse_below_ampere)  # installed, as on such a host
    with FakeTensorMode():
        query = torch.empty(2, 4, 64, 16, dtype=torch.float16, device="cuda")
    assert attention._runs_flash(query, 0.0) is flash


def _refuse_below_ampere(*args: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")


@pytest.mark.parametrize(("card", "flash"), CARDS[:3])
def test_the_plan_for_a_card_traces_the_kernel_its_run_takes(card, flash, monkeypatch):
    """The estimator's trace of a packed fp16 SFT step planned for `card` runs the attention its run takes there:
    flash's varlen ops on an A100; on a T4 or V100 none, and SDPA in their place, as the memory-efficient kernel
    (`cuda_sdpa_backend`'s pick there for rows without GQA). Before, flash's varlen on every card."""
    config = LlamaConfig(
        vocab_size=512,
        max_position_embeddings=512,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    varlen, backends = [], []
    apply, backend = kernels._VarlenMemory.apply, kernels.cuda_sdpa_backend
    monkeypatch.setattr(kernels._VarlenMemory, "apply", lambda *a: varlen.append(a[0].shape) or apply(*a))
    monkeypatch.setattr(kernels, "cuda_sdpa_backend", lambda *a: backends.append(backend(*a)) or backends[-1])
    monkeypatch.setattr(cache, "_TRACES", {})  # traced here, afresh (two layers: one trace, not forked)
    kw = dict(micro_batch_size=2, seq_len=64, precision="fp16", gradient_checkpointing=False, device="cuda")
    estimate(config, compute_capability=compute_capability(card), **kw)
    assert bool(varlen) is flash
    assert set(backends) == (set() if flash else {"efficient"})
