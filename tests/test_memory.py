"""The memory estimator against real CPU training steps, the planner, and the tracker's limit.

Tolerance: the estimate traces the same kernels a real CPU step runs, so on CPU it is exact to
the byte but for what the loop keeps that the estimate does not model (a separate labels tensor
or not: a few KiB here). TOL = 2% leaves room for such bookkeeping while still catching any
modelling error worth the name (a missing autocast copy is ~10%, a missing fp32 logits copy more).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPTNeoXConfig, LlamaConfig, Qwen2Config

from llmtune.memory.estimate import LoraSpec, estimate
from llmtune.memory.measure import PeakMemoryTracker
from llmtune.memory.plan import MemoryPlanError, default_budget, plan_micro_batch
from llmtune.optim import BF16AdamW
from llmtune.units import format_bytes, parse_bytes

TOL = 0.02
VOCAB = 512


def tiny_config(arch: str, layers: int = 2):
    common = dict(vocab_size=VOCAB, max_position_embeddings=512)
    if arch == "llama":
        return LlamaConfig(
            hidden_size=64,
            intermediate_size=172,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            **common,
        )
    if arch == "qwen2":
        return Qwen2Config(
            hidden_size=64,
            intermediate_size=172,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            **common,
        )
    if arch == "gpt2":
        return GPT2Config(n_embd=64, n_layer=layers, n_head=4, vocab_size=VOCAB, n_positions=512)
    if arch == "gptneox":
        return GPTNeoXConfig(
            hidden_size=64, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4, **common
        )
    raise ValueError(arch)


def measured_peak(
    config,
    *,
    batch: int,
    seq_len: int,
    precision: str,
    checkpointing: bool,
    attn: str = "sdpa",
    lora: LoraSpec | None = None,
    chunked: bool = False,
    accum: int = 1,
    optimizer: str = "adamw",
    device: str = "cpu",
) -> int:
    """Steady-state peak of real training steps: the peak of the 2nd optimizer step's window."""
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    model.config.use_cache = False
    if precision == "bf16-true":
        model.to(torch.bfloat16)
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=lora.rank, target_modules=lora.target_modules, task_type="CAUSAL_LM")
        )
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = BF16AdamW(trainable, lr=1e-3) if optimizer == "adamw_bf16" else torch.optim.AdamW(trainable, lr=1e-3)
    x = torch.randint(1, VOCAB, (batch, seq_len), device=device)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16")

    def micro_step() -> None:
        with autocast:
            if chunked:
                from llmtune.loss import CausalLMWithLoss

                loss = CausalLMWithLoss(model, impl="chunked", chunk_size=64)(input_ids=x, labels=x)
            else:
                loss = model(input_ids=x, labels=x).loss
        loss.backward()

    def step() -> None:
        for _ in range(accum):
            micro_step()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with PeakMemoryTracker(device, baseline=[model, opt]) as tracker:
        step()  # AdamW states appear at the first step
        tracker.reset_peak()
        step()
    return tracker.peak_bytes


def predicted(config, **kw) -> int:
    kw.setdefault("device", "cpu")
    return estimate(config, **kw).peak_bytes


def assert_close(pred: int, meas: int) -> None:
    err = pred / meas - 1
    assert abs(err) <= TOL, f"predicted {format_bytes(pred)} vs measured {format_bytes(meas)} ({err:+.2%})"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "gptneox"])
@pytest.mark.parametrize(("precision", "checkpointing"), [("fp32", False), ("bf16", True), ("bf16", False)])
def test_estimate_matches_measured_peak(arch: str, precision: str, checkpointing: bool) -> None:
    cfg = tiny_config(arch)
    meas = measured_peak(cfg, batch=2, seq_len=128, precision=precision, checkpointing=checkpointing)
    pred = predicted(cfg, micro_batch_size=2, seq_len=128, precision=precision, gradient_checkpointing=checkpointing)
    assert_close(pred, meas)


@pytest.mark.parametrize(
    "kw",
    [
        dict(attn="eager", precision="fp32", checkpointing=True),
        dict(precision="bf16-true", checkpointing=False),
        dict(precision="bf16-true", checkpointing=False, optimizer="adamw_bf16"),
        dict(precision="bf16", checkpointing=True, lora=LoraSpec(rank=8)),
        dict(precision="fp32", checkpointing=False, chunked=True),
        dict(precision="fp32", checkpointing=False, accum=2),
    ],
    ids=["eager", "bf16-true", "bf16-true-adamw-bf16", "lora", "chunked-loss", "grad-accum"],
)
def test_estimate_matches_measured_peak_options(kw: dict) -> None:
    cfg = tiny_config("llama")
    meas = measured_peak(cfg, batch=2, seq_len=128, **kw)
    pred = predicted(
        cfg,
        micro_batch_size=2,
        seq_len=128,
        precision=kw["precision"],
        gradient_checkpointing=kw["checkpointing"],
        attn_implementation=kw.get("attn", "sdpa"),
        lora=kw.get("lora"),
        loss="chunked" if kw.get("chunked") else "hf",
        chunk_size=64,
        grad_accum_steps=kw.get("accum", 1),
        optimizer=kw.get("optimizer", "adamw"),
    )
    assert_close(pred, meas)


@pytest.mark.gpu
@pytest.mark.parametrize(("precision", "checkpointing"), [("bf16", False), ("bf16", True), ("bf16-true", False)])
def test_estimate_matches_max_memory_allocated_on_cuda(precision: str, checkpointing: bool) -> None:
    """The CUDA path is modelled (allocator rounding, CUDA kernels' saved tensors): checked on the GPU."""
    cfg = tiny_config("llama")
    meas = measured_peak(cfg, batch=4, seq_len=256, precision=precision, checkpointing=checkpointing, device="cuda")
    pred = estimate(
        cfg, micro_batch_size=4, seq_len=256, precision=precision, gradient_checkpointing=checkpointing,
        device="cuda", optimizer="adamw_fused",
    ).peak_bytes  # fmt: skip
    assert abs(pred / meas - 1) <= 0.05, f"predicted {format_bytes(pred)} vs measured {format_bytes(meas)}"


def test_layer_extrapolation_equals_full_trace() -> None:
    cfg = tiny_config("llama", layers=8)
    kw = dict(micro_batch_size=2, seq_len=64, precision="bf16", gradient_checkpointing=True, device="cpu")
    full = estimate(cfg, max_traced_layers=100, **kw)
    extrapolated = estimate(cfg, **kw)
    assert extrapolated.settings["traced_layers"] == [2, 3]
    assert extrapolated.peak_bytes == pytest.approx(full.peak_bytes, rel=1e-3)


def test_breakdown_sums_to_peak_and_names_parts() -> None:
    est = estimate(tiny_config("llama"), micro_batch_size=2, seq_len=64, precision="bf16", gradient_checkpointing=False)
    assert sum(est.breakdown.values()) == est.peak_bytes
    assert est.peak_phase in ("forward", "backward", "optimizer_step")
    assert {"weights", "optimizer_states"} <= est.breakdown.keys()
    assert est.to_dict()["peak_bytes"] == est.peak_bytes


def test_70b_llama_config_estimates() -> None:
    cfg = LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
    )
    est = estimate(cfg, micro_batch_size=1, seq_len=4096, precision="bf16", gradient_checkpointing=True)
    assert 70e9 < est.totals["parameters"] < 71e9
    # fp32 weights + grads + AdamW states alone are 16 bytes/param.
    assert est.peak_bytes > 16 * 70e9


def test_sharding_divides_model_states() -> None:
    cfg = tiny_config("llama", layers=4)
    kw = dict(micro_batch_size=1, seq_len=64, precision="fp32", gradient_checkpointing=True, device="cpu")
    single = estimate(cfg, **kw)
    fsdp = estimate(cfg, num_processes=4, sharding="fsdp", **kw)
    ddp = estimate(cfg, num_processes=4, **kw)
    assert fsdp.peak_bytes < single.peak_bytes < ddp.peak_bytes


def test_parse_and_format_bytes() -> None:
    assert parse_bytes("20GiB") == 20 * 1024**3
    assert parse_bytes("1.5 GB") == 1_500_000_000
    assert parse_bytes(123) == 123
    assert format_bytes(1536) == "1.50 KiB"
    with pytest.raises(ValueError):
        parse_bytes("lots")


# -- planner ------------------------------------------------------------------------------------

PLAN_KW = dict(seq_len=64, precision="fp32", gradient_checkpointing=False, device="cpu")


def test_planner_picks_largest_fitting_divisor() -> None:
    cfg = tiny_config("llama")
    peaks = {m: predicted(cfg, micro_batch_size=m, grad_accum_steps=12 // m, **PLAN_KW) for m in (1, 2, 3, 4, 6, 12)}
    budget = (peaks[4] + peaks[6]) // 2  # 4 fits, 6 does not
    plan = plan_micro_batch(cfg, global_batch_size=12, num_processes=1, budget_bytes=budget, **PLAN_KW)
    assert plan.micro_batch_size == 4
    assert plan.grad_accum_steps == 3
    assert plan.micro_batch_size * plan.grad_accum_steps == 12  # the global batch is kept
    assert plan.predicted_peak_bytes == peaks[4] <= budget
    assert plan.to_dict()["micro_batch_size"] == 4


def test_planner_respects_processes() -> None:
    cfg = tiny_config("llama")
    plan = plan_micro_batch(cfg, global_batch_size=8, num_processes=2, budget_bytes=parse_bytes("8GiB"), **PLAN_KW)
    assert (plan.micro_batch_size, plan.grad_accum_steps) == (4, 1)


def test_planner_raises_when_nothing_fits() -> None:
    cfg = tiny_config("llama")
    with pytest.raises(MemoryPlanError, match="gradient checkpointing"):
        plan_micro_batch(cfg, global_batch_size=8, budget_bytes=1024, **PLAN_KW)


def test_default_budget_cpu_is_positive() -> None:
    assert 0 < default_budget("cpu")


# -- tracker ------------------------------------------------------------------------------------


def test_tracker_counts_baseline_and_new_tensors() -> None:
    model = torch.nn.Linear(256, 256)
    with PeakMemoryTracker("cpu", baseline=[model]) as t:
        y = torch.empty(1024, 256)
        del y
    assert t.peak_bytes == (256 * 256 + 256 + 1024 * 256) * 4
    assert t.current_bytes == (256 * 256 + 256) * 4


def test_tracker_limit_raises_out_of_memory() -> None:
    cfg = tiny_config("llama")
    model = AutoModelForCausalLM.from_config(cfg)
    x = torch.randint(0, VOCAB, (4, 128))
    with pytest.raises(torch.OutOfMemoryError):
        with PeakMemoryTracker("cpu", baseline=[model], limit_bytes=4 * 1024**2):
            model(input_ids=x, labels=x).loss.backward()
    # A generous limit lets the same step through.
    model.zero_grad(set_to_none=True)
    with PeakMemoryTracker("cpu", baseline=[model], limit_bytes=1024**3) as t:
        model(input_ids=x, labels=x).loss.backward()
    assert t.peak_bytes > 4 * 1024**2
