"""Numerical traps of low-precision training: bf16 weights losing small updates, fp16 overflow steps that
go uncounted. Tiny tensors: this CPU may emulate bf16 (~30x slower than fp32)."""

from __future__ import annotations

import pytest
import torch

from llmtune.optim import BF16AdamW, make_optimizer, stochastic_round_
from llmtune.train import optimizer_step

CUDA = pytest.param("cuda", marks=pytest.mark.gpu)


def drift_after(
    optimizer_class, dtype: torch.dtype, steps: int = 100, lr: float = 2e-5, device: str = "cpu", **kwargs
) -> float:
    """Mean change of weights ~N(0, 0.02) after `steps` updates with a constant positive gradient: AdamW's
    update is then lr per step, so fp32 drifts by exactly -lr x steps."""
    torch.manual_seed(0)
    w0 = torch.randn(64, 64, device=device) * 0.02
    p = torch.nn.Parameter(w0.to(dtype, copy=True))
    opt = optimizer_class([p], lr=lr, weight_decay=0.0, **kwargs)
    for _ in range(steps):
        p.grad = torch.full_like(p, 1e-3)
        opt.step()
    return float((p.detach().float() - w0.to(dtype).float()).mean())


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_bf16_weights_keep_small_updates_with_stochastic_rounding(device):
    expected = drift_after(torch.optim.AdamW, torch.float32, device=device)
    assert expected == pytest.approx(-100 * 2e-5, rel=1e-3)
    # The trap: bf16 weights with torch's (fused) AdamW round most of the update away.
    assert abs(drift_after(torch.optim.AdamW, torch.bfloat16, device=device, fused=True)) < 0.5 * abs(expected)
    # The fix keeps it (on average: stochastic rounding is unbiased).
    assert drift_after(BF16AdamW, torch.bfloat16, device=device) == pytest.approx(expected, rel=0.05)
    # fp32 parameters (LoRA adapters) take the exact AdamW update.
    assert drift_after(BF16AdamW, torch.float32, device=device) == pytest.approx(expected, rel=1e-5)


def test_bf16_second_moment_tracks_the_gradient():
    """exp_avg_sq moves by 0.1% a step (beta2 = 0.999), below bf16's resolution: rounded to nearest it
    stalls at about half of g^2 after 1000 steps (updates ~1.4x too large); stochastic rounding keeps it."""
    p = torch.nn.Parameter(torch.full((256,), 0.5, dtype=torch.bfloat16))
    opt = BF16AdamW([p], lr=1e-4, weight_decay=0.0)
    torch.manual_seed(0)
    for _ in range(1000):
        p.grad = torch.full_like(p, 0.01)
        opt.step()
    v_hat = opt.state[p]["exp_avg_sq"].float().mean() / (1 - 0.999**1000)
    assert float(v_hat) == pytest.approx(0.01**2, rel=0.03)


def test_stochastic_rounding_is_unbiased_and_exact_on_bf16_values():
    x = torch.full((20000,), 1.0 + 2**-10)  # an eighth of the way from 1 to the next bf16 value, 1 + 2^-7
    out = torch.empty_like(x, dtype=torch.bfloat16)
    torch.manual_seed(0)
    for sign in (1, -1):
        stochastic_round_(out, sign * x)
        assert set(out.float().abs().unique().tolist()) == {1.0, 1.0 + 2**-7}
        assert float(out.float().mean()) == pytest.approx(sign * (1.0 + 2**-10), abs=2e-4)
    exact = torch.tensor([0.5, -3.0, 2**-20], dtype=torch.bfloat16)
    stochastic_round_(out[:3], exact.float())
    assert torch.equal(out[:3], exact)


def test_make_optimizer_uses_bf16_adamw_for_bf16_weights_only(tiny_recipe, tiny_model_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmtune.model import apply_peft
    from llmtune.recipe import load_recipe

    recipe = load_recipe(tiny_recipe(training__precision="bf16-true"))
    config = AutoConfig.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert isinstance(make_optimizer(model, recipe, torch.device("cpu")), BF16AdamW)
    # LoRA under bf16-true: the adapters are fp32, fused AdamW keeps their updates as before.
    lora = apply_peft(model, load_recipe(tiny_recipe(peft__method="lora")).peft, gradient_checkpointing=False)
    opt = make_optimizer(lora, recipe, torch.device("cpu"))
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"]
    fp32 = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert type(make_optimizer(fp32, recipe, torch.device("cpu"))) is torch.optim.AdamW


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_fp16_overflow_is_detected_from_the_scaler(fused, device):
    """A real GradScaler and AdamW behind Accelerate's optimizer wrapper. Fused AdamW skips an inf step
    inside its kernel, so Accelerate's own `step_was_skipped` stays False; the scale drop tells."""
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    Accelerator(cpu=device == "cpu")  # the wrapper needs an initialised Accelerate state
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8, device=device)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**16)
    opt = AcceleratedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused), scaler=scaler)

    def step(overflow: bool) -> bool:
        scaler.scale(model(torch.randn(4, 8, device=device)).square().mean()).backward()
        if overflow:
            model.weight.grad[0, 0] = float("inf")
        before = model.weight.detach().clone()
        skipped = optimizer_step(opt, scaler)
        assert torch.equal(before, model.weight.detach()) == skipped  # skipped <=> weights unchanged
        opt.zero_grad()
        return skipped

    assert [step(o) for o in (False, True, False, True)] == [False, True, False, True]
    assert scaler.get_scale() == 2.0**14  # halved twice
    assert optimizer_step(torch.optim.SGD(model.parameters(), lr=0.1), None) is False  # no scaler: never skipped
