"""Planner v2: the checkpointing settings it weighs, the time model's work, and the fastest plan that fits."""

from __future__ import annotations

import importlib
import json
import os

import pytest
import torch
from test_memory import assert_close, measured_peak, real_batch, tiny_config

from llmtune.cli import main
from llmtune.memory.estimate import estimate, estimate_all
from llmtune.memory.plan import checkpointing_choices, plan_micro_batch
from llmtune.memory.speed import (
    CPU_PROBE_FLOPS,
    Rates,
    Work,
    datasheet_rates,
    dispatched_ops,
    matmul_probe_shape,
    measure_rates,
    narrow_model,
)
from llmtune.recipe import Checkpointing, RecipeError, load_recipe

# Fixed rates: the choice then depends on the traced work only, the same on every machine.
RATES = Rates(flops_per_s=1e11, bytes_per_s=2e10, seconds_per_op=2e-5, source="test")
KW = dict(seq_len=64, precision="fp32", device="cpu", loss="chunked", chunk_size=64)  # as measured_peak runs it


def test_the_choices_span_none_to_every_layer_and_selective():
    names = [c.describe(6) for c in checkpointing_choices(6)]
    assert names == [
        "off",
        "every 6th layer (1 of 6)",
        "every 3rd layer (2 of 6)",
        "every 2nd layer (3 of 6)",
        "every layer",
        "every layer, selective",
    ]


@pytest.mark.parametrize(
    "spec", [Checkpointing(2), Checkpointing(3), Checkpointing(1, selective=True), Checkpointing(2, selective=True)]
)
def test_partial_and_selective_checkpointing_estimates_match_measured_peaks(spec):
    cfg = tiny_config("llama", layers=4)
    pred = estimate(cfg, micro_batch_size=2, gradient_checkpointing=spec, **KW).peak_bytes
    meas = measured_peak(cfg, batch=2, seq_len=64, precision="fp32", checkpointing=spec, chunked=True)
    assert_close(pred, meas)


def test_a_deep_model_composes_every_kth_layer_from_none_and_every_layer_never_under():
    """Traced at 1 and 2 layers (max_traced_layers=1), every 2nd / 3rd layer of 6 is composed from the traces
    of none and of every layer: the same work as the whole trace, and a peak above it by about one layer's
    activations (the recomputation counted beside every layer's), whatever the depth: never below."""
    cfg = tiny_config("llama", layers=6)
    peak = {on: estimate(cfg, micro_batch_size=2, gradient_checkpointing=on, **KW).peak_bytes for on in (False, True)}
    one_layer = (peak[False] - peak[True]) / 6
    for k in (2, 3):
        kw = dict(micro_batch_size=2, gradient_checkpointing=Checkpointing(k), **KW)
        whole, composed = estimate(cfg, max_traced_layers=8, **kw), estimate(cfg, max_traced_layers=1, **kw)
        assert composed.work == pytest.approx(whole.work)
        assert 0 <= composed.peak_bytes - whole.peak_bytes <= 1.5 * one_layer


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="traces fork only on 2 or more cores")
def test_forked_traces_equal_in_process_ones_and_the_first_warms_the_parent(monkeypatch):
    """On several cores `estimate_all` forks its traces, after running the first in this process: the workers then
    inherit FakeTensorMode's dispatch cache instead of each filling its own. Forked or not, the same estimates."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    module = importlib.import_module("llmtune.memory.estimate")
    cfg = tiny_config("llama", layers=6)
    settings = [dict(micro_batch_size=2, gradient_checkpointing=c, **KW) for c in (False, True, Checkpointing(2))]

    def fresh() -> list:
        module._TRACES.clear()
        FakeTensorMode.cache_clear()
        return estimate_all(cfg, settings, max_traced_layers=1)  # 6 layers traced at 1 and 2: 6 traces

    forked = fresh()
    assert FakeTensorMode.cache  # the first trace ran here
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0})  # one core: all in this process
    alone = fresh()
    assert [(e.peak_bytes, e.work) for e in forked] == [(e.peak_bytes, e.work) for e in alone]


def test_the_traced_work_counts_recomputation():
    cfg = tiny_config("llama", layers=4)
    work = {
        name: estimate(cfg, micro_batch_size=2, gradient_checkpointing=spec, **KW).work
        for name, spec in (("off", False), ("every", True), ("selective", Checkpointing(1, selective=True)))
    }
    # Every layer recomputed runs its matmuls again; selective keeps their outputs and recomputes the rest.
    assert work["every"].flops > 1.15 * work["off"].flops
    assert work["selective"].flops == pytest.approx(work["off"].flops)
    assert work["selective"].ops > work["off"].ops and work["selective"].bytes > work["off"].bytes


@pytest.mark.parametrize("spec", [Checkpointing(0), Checkpointing(1), Checkpointing(2)], ids=lambda c: c.describe(4))
def test_the_traced_ops_are_the_ops_a_real_step_dispatches(spec):
    """The time model charges a per-op overhead, measured on real tensors (`measure_rates`): so the trace must count
    the ops a real forward and backward dispatch, not the fake tensors' own bookkeeping (`tensor.device` alone is
    a dispatch on a fake tensor, ~1400 a layer under checkpointing, and was once counted with its input's bytes)."""
    from transformers import AutoModelForCausalLM

    from llmtune.loss import CausalLMWithLoss
    from llmtune.model import apply_checkpointing

    cfg = tiny_config("llama", layers=4)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    model.config.use_cache = False
    apply_checkpointing(model, spec)
    step = CausalLMWithLoss(model.train(), impl="chunked", chunk_size=64)
    batch = real_batch(2, 64, "packed")

    real = dispatched_ops(lambda: step(**batch).backward())
    traced = estimate(cfg, micro_batch_size=2, gradient_checkpointing=spec, **KW).work.ops
    assert traced == pytest.approx(real, rel=0.05)


def test_auto_takes_no_checkpointing_when_it_fits_and_the_fastest_that_fits_when_not():
    cfg = tiny_config("llama", layers=4)
    common = dict(global_batch_size=8, gradient_checkpointing="auto", rates=RATES, **KW)
    loose = plan_micro_batch(cfg, budget_bytes=2**30, **common)
    assert loose.checkpointing == Checkpointing(0) and loose.micro_batch_size == 8 and loose.fits
    # Between the peak of every layer recomputed and that of none, at the largest micro-batch.
    every = estimate(cfg, micro_batch_size=8, gradient_checkpointing=True, **KW).peak_bytes
    none = estimate(cfg, micro_batch_size=8, gradient_checkpointing=False, **KW).peak_bytes
    tight = plan_micro_batch(cfg, budget_bytes=(every + none) // 2, **common)
    assert tight.fits and tight.predicted_peak_bytes <= (every + none) // 2
    weighed = [c for c in tight.frontier if c["fits"] is not None]
    chosen = [c for c in weighed if c["fits"]]
    assert len(chosen) == 1 and chosen[0]["predicted_tokens_per_s"] == pytest.approx(
        tight.predicted_tokens_per_s, rel=1e-3
    )
    # Everything predicted faster than the choice was estimated and found over the budget.
    faster = [c for c in tight.frontier if c["predicted_tokens_per_s"] > chosen[0]["predicted_tokens_per_s"]]
    assert faster and all(c["fits"] is False or c["fits"] is None for c in faster)
    assert any(c["fits"] is False for c in faster)


def test_a_fixed_setting_is_planned_as_given():
    cfg = tiny_config("llama", layers=4)
    plan = plan_micro_batch(
        cfg, global_batch_size=8, budget_bytes=2**30, gradient_checkpointing=Checkpointing(2), rates=RATES, **KW
    )
    assert plan.checkpointing == Checkpointing(2) and plan.micro_batch_size == 8


def test_rates():
    cfg = tiny_config("llama", layers=2)
    here = measure_rates("cpu", torch.float32, cfg)
    assert all(0 < x < float("inf") for x in (here.flops_per_s, here.bytes_per_s, here.seconds_per_op))
    assert datasheet_rates("h100-80gb", "bf16").flops_per_s > datasheet_rates("a100-80gb", "bf16").flops_per_s
    assert datasheet_rates("some-card", "bf16") is None
    assert RATES.seconds(Work(1e11, 2e10, 1000)) == pytest.approx(1 + 1 + 0.02)


def test_the_rate_probes_of_a_70b_config_stay_small_on_a_cpu():
    """`measure_rates` on a CPU: the matmul probe at most CPU_PROBE_FLOPS (a 70B MLP at 2048 rows is ~1 TFLOP), the
    overhead probe a one-layer fp32 model even where the config says bf16 (which an AVX2 CPU emulates)."""
    from transformers import LlamaConfig

    big = LlamaConfig(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, vocab_size=128256, dtype="bfloat16",
    )  # fmt: skip
    rows, hidden, wide = matmul_probe_shape(big, "cpu")
    assert 2 * rows * hidden * wide <= CPU_PROBE_FLOPS and hidden == 8192 and min(rows, wide) >= 256
    assert matmul_probe_shape(big, "cuda") == (2048, 8192, 28672)  # a GPU times the real shape in ~a millisecond
    small = tiny_config("llama", layers=2)
    assert matmul_probe_shape(small, "cpu") == (2048, small.hidden_size, small.intermediate_size)
    narrow = narrow_model(big, "cpu")
    assert narrow.config.num_hidden_layers == 1 and narrow.config.hidden_size == 16 * 64
    assert {p.dtype for p in narrow.parameters()} == {torch.float32}


def test_recipe_checkpointing_values(tiny_recipe):
    for value, expected in (
        ("auto", "auto"),
        (True, True),
        ("selective", "selective"),
        ({"every_n_layers": 2}, Checkpointing(2)),
        ({"every_n_layers": 3, "selective": True}, Checkpointing(3, selective=True)),
    ):
        assert load_recipe(tiny_recipe(training__gradient_checkpointing=value)).training.gradient_checkpointing == (
            expected
        )
    with pytest.raises(RecipeError, match="training.gradient_checkpointing"):
        load_recipe(tiny_recipe(training__gradient_checkpointing={"every_n_layer": 2}))
    with pytest.raises(RecipeError, match="every_n_layers must be >= 0"):
        load_recipe(tiny_recipe(training__gradient_checkpointing={"every_n_layers": -1}))


def test_a_run_with_auto_records_the_plan_and_the_time_models_check(tiny_recipe, tmp_path):
    recipe = tiny_recipe(
        training__gradient_checkpointing="auto", training__micro_batch_size="auto", training__max_steps=5
    )
    assert main(["train", "--recipe", str(recipe)]) == 0
    summary = json.loads((tmp_path / "run" / "run_summary.json").read_text())
    speed = summary["time_model"]
    assert speed["predicted_tokens_per_s"] > 0 and speed["measured_tokens_per_s"] > 0
    # Rounded to 3 decimals in the summary (a loaded machine can measure far below the prediction).
    assert speed["measured_over_predicted"] == pytest.approx(
        speed["measured_tokens_per_s"] / speed["predicted_tokens_per_s"], rel=1e-2, abs=1e-3
    )
    assert summary["checkpointing"]["every_n_layers"] == 0  # a CPU's RAM holds a tiny model without any
    assert summary["memory_plan"]["frontier"]


def test_estimate_prints_what_it_weighed(capsys, tiny_model_dir):
    assert main(["estimate", "--model", str(tiny_model_dir), "--full", "--seq-len", "64", "--gpu", "l4"]) == 0
    out = capsys.readouterr().out
    assert "weighed (time model: l4 datasheet" in out and "<- chosen" in out


def test_planning_leaves_the_runs_random_state_alone(tiny_recipe):
    """The planner measures rates on random tensors before the model is initialised: the weights must not depend
    on whether it ran (the quickstart's accuracy once moved with it)."""
    from llmtune.train import build

    def weights(checkpointing) -> list[torch.Tensor]:
        run = build(load_recipe(tiny_recipe(training__gradient_checkpointing=checkpointing)))
        return [p.detach().clone() for p in run.model.parameters()]

    for planned, fixed in zip(weights("auto"), weights(False), strict=True):
        assert torch.equal(planned, fixed)
