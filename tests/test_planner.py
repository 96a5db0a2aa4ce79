"""Planner v2: the checkpointing settings it weighs, the time model's work, and the fastest plan that fits."""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import replace

import pytest
import torch
from conftest import planner_rates
from test_memory import assert_close, measured_peak, real_batch, tiny_config

from llmtune.cli.main import main
from llmtune.plan import MemoryPlanError, checkpointing_choices, format_plan, plan_micro_batch
from llmtune.plan.cache import clear_traces
from llmtune.plan.estimate import estimate, estimate_all
from llmtune.plan.timing import (
    CPU_PROBE_FLOPS,
    Rates,
    Work,
    datasheet_rates,
    dispatched_ops,
    flop_rate_left,
    layer_step_rates,
    matmul_probe_shape,
    measure_rates,
    narrow_model,
)
from llmtune.recipe import Checkpointing, RecipeError, load_recipe

RATES = planner_rates()  # fixed: the choice depends on the traced work only, the same on every machine
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

    cfg = tiny_config("llama", layers=6)
    settings = [dict(micro_batch_size=2, gradient_checkpointing=c, **KW) for c in (False, True, Checkpointing(2))]

    def fresh() -> list:
        clear_traces()
        FakeTensorMode.cache_clear()
        return estimate_all(cfg, settings, max_traced_layers=1)  # 6 layers traced at 1 and 2: 6 traces

    forked = fresh()
    assert FakeTensorMode.cache  # the first trace ran here
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0})  # one core: all in this process
    alone = fresh()
    assert [(e.peak_bytes, e.work) for e in forked] == [(e.peak_bytes, e.work) for e in alone]


def stuck_forever(*args, **kwargs):
    time.sleep(3600)


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="traces fork only on 2 or more cores")
def test_forked_traces_that_never_answer_are_run_in_this_process(monkeypatch):
    """A worker forked while another thread held a lock waits forever (the floor suite hung there once): the traces
    are then given up and run in this process, with the same estimates, and later plans do not fork again."""
    from llmtune.plan import cache

    cfg = tiny_config("llama", layers=6)
    settings = [dict(micro_batch_size=2, gradient_checkpointing=c, **KW) for c in (False, True, Checkpointing(2))]
    clear_traces()
    alone = estimate_all(cfg, settings, max_traced_layers=1)
    monkeypatch.setattr(cache, "_FORK_REFUSED", [])
    monkeypatch.setattr(cache, "FORKED_TRACES_TIMEOUT_S", 1.0)
    monkeypatch.setattr(cache, "_trace_job", stuck_forever)  # what the forked workers run
    monkeypatch.setattr("threading.active_count", lambda: 1)  # other tests' threads (progress bars) would stop it
    clear_traces()
    given_up = estimate_all(cfg, settings, max_traced_layers=1)
    assert cache._FORK_REFUSED == ["no forked trace in 1 s"]
    assert [(e.peak_bytes, e.work) for e in given_up] == [(e.peak_bytes, e.work) for e in alone]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="traces fork only on 2 or more cores")
def test_a_process_with_other_threads_traces_without_forking(monkeypatch):
    """A thread alive beside the planner may hold a lock a forked child would inherit held: no fork then (the
    workers here would wait forever, and the 1 s guard would record it)."""
    import threading

    from llmtune.plan import cache

    cfg = tiny_config("llama", layers=6)
    settings = [dict(micro_batch_size=2, gradient_checkpointing=c, **KW) for c in (False, True, Checkpointing(2))]
    monkeypatch.setattr(cache, "_FORK_REFUSED", [])
    monkeypatch.setattr(cache, "FORKED_TRACES_TIMEOUT_S", 1.0)
    monkeypatch.setattr(cache, "_trace_job", stuck_forever)
    release = threading.Event()
    other = threading.Thread(target=release.wait, daemon=True)
    other.start()
    try:
        clear_traces()
        estimates = estimate_all(cfg, settings, max_traced_layers=1)
    finally:
        release.set()
    assert cache._FORK_REFUSED == [] and len(estimates) == 3


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

    from llmtune.model.blocks import apply_checkpointing
    from llmtune.ops.loss import CausalLMWithLoss

    cfg = tiny_config("llama", layers=4)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    model.config.use_cache = False
    apply_checkpointing(model, spec)
    step = CausalLMWithLoss(model.train(), impl="chunked", chunk_size=64)
    batch = real_batch(2, 64, "packed")

    real = dispatched_ops(lambda: step(**batch).backward())
    traced = estimate(cfg, micro_batch_size=2, gradient_checkpointing=spec, **KW).work.ops
    assert traced == pytest.approx(real, rel=0.05)


@pytest.mark.slow
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


OFFLOADED = Checkpointing(1, offload=True)
CUDA_KW = dict(seq_len=256, precision="bf16", device="cuda", loss="chunked", attn_implementation="sdpa")


def test_offloading_takes_every_layers_saved_inputs_off_the_gpu_and_pays_the_copies():
    """Planned for a GPU: with every layer recomputed, what each checkpoint saves is the layer's input (the hidden
    states, fp32 under autocast); offloaded, those go to host memory in forward and come back in backward, over
    the host link both ways."""
    layers, m = 6, 4
    cfg = tiny_config("llama", layers=layers)
    every, off = (estimate(cfg, micro_batch_size=m, gradient_checkpointing=c, **CUDA_KW) for c in (True, OFFLOADED))
    inputs = m * CUDA_KW["seq_len"] * cfg.hidden_size * 4
    assert every.work.host_bytes == 0 and off.work.host_bytes == 2 * layers * inputs
    assert every.work.offloadable == layers * inputs  # what the planner times offloading by, before tracing it
    # At the head (every layer's input kept, without offloading): exactly the inputs fewer on the device. The peak
    # then moves to the backward of the first layer, whose input is back.
    assert every.segment_peaks["head"]["activations"] - off.segment_peaks["head"]["activations"] == layers * inputs
    assert off.peak_bytes < every.peak_bytes and off.peak_phase == "backward"
    assert off.work.flops == every.work.flops
    rates = datasheet_rates("a100-80gb", "bf16")  # PCIe 4.0: 32 GB/s a direction, 80% of it
    assert rates.host_bytes_per_s == pytest.approx(0.8 * 32e9)
    copies = rates.seconds(off.work) - rates.seconds(replace(off.work, host_bytes=0.0))
    assert copies == pytest.approx(2 * layers * inputs / rates.host_bytes_per_s)


@pytest.mark.slow
def test_the_planner_offloads_only_on_a_gpu_and_only_when_nothing_else_fits():
    cfg = tiny_config("llama", layers=8)
    assert OFFLOADED in checkpointing_choices(8, offload=True) and OFFLOADED not in checkpointing_choices(8)
    cuda = CUDA_KW | {"seq_len": 1024}  # long enough that activations, not the allocator's pages, set the peak
    kw = dict(global_batch_size=1, gradient_checkpointing="auto", rates=datasheet_rates("a100-80gb", "bf16"))
    every = estimate(cfg, micro_batch_size=1, gradient_checkpointing=True, **cuda).reserved_bytes
    off = estimate(cfg, micro_batch_size=1, gradient_checkpointing=OFFLOADED, **cuda).reserved_bytes
    assert off < every
    tight = plan_micro_batch(cfg, budget_bytes=(every + off) // 2, **kw, **cuda)
    assert tight.checkpointing == OFFLOADED and tight.micro_batch_size == 1 and tight.fits
    # Where every layer recomputed fits, offloading is timed (from every layer's trace) but never traced.
    roomy = plan_micro_batch(cfg, budget_bytes=2**34, **kw | {"global_batch_size": 4}, **cuda)
    offloaded = [c for c in roomy.frontier if c["offload"]]
    assert not roomy.checkpointing.offload and offloaded and all(c["predicted_peak"] is None for c in offloaded)
    # Timed at micro-batch 4 from the trace at 1: the copies scale with the tokens (and take the link's time).
    seconds = {}
    for spec in (True, OFFLOADED):
        fixed = kw | {"global_batch_size": 4, "gradient_checkpointing": spec}
        frontier = plan_micro_batch(cfg, budget_bytes=2**34, **fixed, **cuda).frontier
        seconds[spec] = {c["micro_batch_size"]: 4 * cuda["seq_len"] / c["predicted_tokens_per_s"] for c in frontier}
    copies = 2 * 8 * 4 * cuda["seq_len"] * cfg.hidden_size * 4 / kw["rates"].host_bytes_per_s
    assert copies <= seconds[OFFLOADED][4] - seconds[True][4] < 1.5 * copies
    # ... and the time `auto` gave it untraced is the traced one's (but for the copies' few allocations).
    untraced = {c["micro_batch_size"]: 4 * cuda["seq_len"] / c["predicted_tokens_per_s"] for c in offloaded}
    assert untraced == pytest.approx(seconds[OFFLOADED], rel=0.01)
    cpu = plan_micro_batch(cfg, budget_bytes=2**34, global_batch_size=4, rates=RATES, **KW)
    assert not any(c["offload"] for c in cpu.frontier)  # a CPU's activations are in host memory already


@pytest.mark.slow
def test_offloading_pins_host_memory_in_powers_of_two_and_the_plan_keeps_within_the_host():
    """save_on_cpu copies each checkpointed layer's saved input (the fp32 residual stream) into pinned memory, which
    PyTorch's CachingHostAllocator hands out rounded up to a power of two (`PowerOf2Ceil`) and keeps cached: 8 layers
    x 2^ceil(log2(1000 x hidden x 4)) bytes. Where the host cannot pin that, offloading does not fit."""
    cfg = tiny_config("llama", layers=8)
    cuda = CUDA_KW | {"seq_len": 1000}
    off = estimate(cfg, micro_batch_size=1, gradient_checkpointing=OFFLOADED, **cuda)
    per_layer = 1000 * cfg.hidden_size * 4
    assert off.pinned_host_bytes == 8 * (1 << (per_layer - 1).bit_length()) > 8 * per_layer
    every = estimate(cfg, micro_batch_size=1, gradient_checkpointing=True, **cuda).reserved_bytes
    kw = dict(global_batch_size=1, gradient_checkpointing="auto", rates=datasheet_rates("a100-80gb", "bf16"))
    budget = (every + off.reserved_bytes) // 2  # only offloading fits the device
    roomy = plan_micro_batch(cfg, budget_bytes=budget, host_bytes=off.pinned_host_bytes, **kw, **cuda)
    assert roomy.checkpointing == OFFLOADED and "pins" in format_plan(roomy, "t")
    with pytest.raises(MemoryPlanError):
        plan_micro_batch(cfg, budget_bytes=budget, host_bytes=off.pinned_host_bytes - 1, **kw, **cuda)


def test_offloading_is_refused_on_a_cpu_in_words(tiny_recipe, capsys):
    """transformers' offloading pins host memory, which a CPU-only torch cannot: a recipe asking for it on a CPU
    gets a clear error before anything loads, and so does an estimate for a CPU."""
    recipe = tiny_recipe(training__gradient_checkpointing={"every_n_layers": 1, "offload": True})
    assert main(["train", "--recipe", str(recipe)]) != 0
    assert "offload moves the inputs checkpointing saves from a GPU" in capsys.readouterr().err
    with pytest.raises(ValueError, match="remove offload"):
        estimate(tiny_config("llama"), micro_batch_size=1, gradient_checkpointing=OFFLOADED, **KW)


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


def test_the_flop_rate_follows_the_rows_of_the_step():
    """Measured at 256 and 1024 rows, the FLOP rate is interpolated in log(rows) between them, held outside them,
    and the planner times each micro-batch at its own rows (micro-batch x seq_len)."""
    rates = Rates(1e11, 2e10, 2e-5, "test", flops_by_rows=((256, 6e10), (1024, 1e11)))
    assert rates.flop_rate(128) == rates.flop_rate(256) == 6e10 and rates.flop_rate(4096) == 1e11
    assert rates.flop_rate(512) == pytest.approx(8e10) and rates.flop_rate(None) == 1e11
    cfg = tiny_config("llama", layers=2)
    kw = dict(global_batch_size=4, budget_bytes=2**30, gradient_checkpointing=False, **KW)
    flat = plan_micro_batch(cfg, rates=replace(rates, flops_by_rows=()), **kw).frontier
    rowed = plan_micro_batch(cfg, rates=rates, **kw).frontier
    by_m = lambda frontier: {c["micro_batch_size"]: c["predicted_tokens_per_s"] for c in frontier}  # noqa: E731
    # micro-batch 4 x 64 tokens = 256 rows: the slower rate; the same work otherwise.
    assert by_m(rowed)[4] < by_m(flat)[4] and by_m(rowed)[1] < by_m(flat)[1]


def wide_llama():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=1024,
    )  # fmt: skip


def test_a_cpu_times_one_full_width_layer_at_256_and_1024_tokens_for_its_flop_rate():
    """The timing is given (`time_step`), so the verdict is the same on every host: each step's FLOPs over the
    seconds its bytes and ops leave. At 1024 tokens the step is 4 x 256 rows of the same layer: 4x the FLOPs."""
    timed = []

    def ten_seconds(step) -> float:
        timed.append(step)
        return 10.0

    free = Rates(flops_per_s=1e11, bytes_per_s=float("inf"), seconds_per_op=0.0, source="test")  # only FLOPs count
    rates = layer_step_rates(wide_llama(), torch.float32, free, time_step=ten_seconds)
    assert [rows for rows, _ in rates] == [256, 1024] and len(timed) == 2
    (_, at_256), (_, at_1024) = rates
    assert at_1024 == pytest.approx(4 * at_256, rel=1e-4)  # less a few FLOPs per forward (the rotary angles)
    # Forward and backward: 6 x the matmuls' weights x tokens (q, o; k, v at 2 of 4 heads; the MLP; the lm_head),
    # and attention's own FLOPs on top.
    weights = 2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 688 + 256 * 1024
    assert 1.0 <= at_256 * 10.0 / (6 * weights * 256) < 1.2
    # The bytes and ops it dispatched are taken off at the probed rates: the same step, less time for its FLOPs.
    slower = layer_step_rates(wide_llama(), torch.float32, replace(free, seconds_per_op=1e-3), time_step=ten_seconds)
    assert slower[0][1] > at_256


def test_a_step_that_is_mostly_overhead_gives_no_flop_rate():
    """A fast CPU runs one narrow layer's step in mostly per-op overhead: under a quarter left for the FLOPs is
    noise, and the matmul probe's rate is kept (the branch that once made a test's verdict depend on the host)."""
    work = Work(flops=1e9, bytes=0.0, ops=1000)
    overhead = Rates(flops_per_s=1e11, bytes_per_s=2e10, seconds_per_op=1e-3, source="test")  # 1 s of ops
    assert flop_rate_left(work, seconds=4.0, probed=overhead) == pytest.approx(1e9 / 3.0)  # 3 s of 4 left
    assert flop_rate_left(work, seconds=1.3, probed=overhead) is None  # 0.3 s of 1.3 left: under a quarter
    every_step_overhead = lambda step: 1e-9  # noqa: E731  (less than the ops alone take)
    assert layer_step_rates(wide_llama(), torch.float32, overhead, time_step=every_step_overhead) == ()


def test_a_layer_too_large_to_time_is_not_timed():
    from transformers import LlamaConfig

    def never(step) -> float:
        raise AssertionError("timed a 70B layer")

    big = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                      num_key_value_heads=8, vocab_size=128256)  # fmt: skip
    assert layer_step_rates(big, torch.float32, RATES, time_step=never) == ()  # ~40 s of one layer at 1e11 FLOP/s


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
    from llmtune.run.setup import build

    def weights(checkpointing) -> list[torch.Tensor]:
        run = build(load_recipe(tiny_recipe(training__gradient_checkpointing=checkpointing)))
        return [p.detach().clone() for p in run.model.parameters()]

    for planned, fixed in zip(weights("auto"), weights(False), strict=True):
        assert torch.equal(planned, fixed)


# Sequence parallelism (issue 45): the planner weighs each degree as one process of a sequence group.
SP_KW = dict(seq_len=512, precision="bf16", device="cpu", loss="chunked", chunk_size=64)


@pytest.mark.parametrize("checkpointing", [Checkpointing(0), Checkpointing(1)])
def test_the_all_to_all_bytes_the_time_model_charges_are_those_a_traced_step_sends(monkeypatch, checkpointing):
    """A degree-2 step of a GQA model traced as one process of its group: every all-to-all it runs (forward, backward,
    a checkpointed layer's recomputation) sends (N - 1) / N of its buffer, and their sum is what the planner charges."""
    import llmtune.parallel.sequence as sequence
    from llmtune.plan.search import alltoall_bytes
    from llmtune.plan.settings import settings_of
    from llmtune.plan.trace import trace_step

    sent, degree = [], 2
    real = sequence._all_to_all

    def counted(x, scatter_dim, gather_dim, group):
        sent.append(x.numel() * x.element_size() * (group.degree - 1) // group.degree)
        return real(x, scatter_dim, gather_dim, group)

    monkeypatch.setattr(sequence, "_all_to_all", counted)
    cfg = tiny_config("llama", layers=2)  # 4 heads, 2 KV heads
    s = settings_of(
        cfg,
        micro_batch_size=2,
        num_processes=2,
        sequence_parallel=degree,
        gradient_checkpointing=checkpointing,
        **SP_KW,
    )
    trace_step(cfg, s, period=1)
    # q, k, v and the output in forward and backward, and again in each recomputed layer's forward.
    assert len(sent) == 4 * (3 if checkpointing.enabled else 2) * cfg.num_hidden_layers
    assert sum(sent) == alltoall_bytes(cfg, 2 * 512, degree, "bf16", checkpointing) > 0


@pytest.mark.slow
def test_auto_splits_rows_across_processes_only_where_whole_rows_do_not_fit():
    """On 2 processes: a roomy budget keeps whole rows (and weighs no other degree); a budget under whole rows' peak but
    over a half row's splits them across both processes, the global batch kept (micro x accumulation x 1)."""
    cfg = tiny_config("llama", layers=2)
    common = dict(global_batch_size=4, num_processes=2, gradient_checkpointing=True, rates=RATES, **SP_KW)
    whole = estimate(cfg, micro_batch_size=1, gradient_checkpointing=True, num_processes=2, **SP_KW).peak_bytes
    half = estimate(cfg, micro_batch_size=1, gradient_checkpointing=True, num_processes=2, sequence_parallel=2, **SP_KW)
    assert half.peak_bytes < whole
    roomy = plan_micro_batch(cfg, budget_bytes=2**34, sequence_parallel="auto", **common)
    assert roomy.sequence_parallel == 1 and [d["sequence_parallel"] for d in roomy.degrees] == [1]
    budget = (half.peak_bytes + whole) // 2
    split = plan_micro_batch(cfg, budget_bytes=budget, sequence_parallel="auto", **common)
    assert split.sequence_parallel == 2 and split.fits and split.predicted_peak_bytes <= budget
    assert split.micro_batch_size * split.grad_accum_steps * (2 // split.sequence_parallel) == 4
    assert split.estimate.settings["sequence_parallel"] == 2
    assert [(d["sequence_parallel"], d["fits"]) for d in split.degrees] == [(1, False), (2, True)]
    with pytest.raises(MemoryPlanError):  # the same budget, rows kept whole
        plan_micro_batch(cfg, budget_bytes=budget, sequence_parallel=1, **common)


@pytest.mark.parametrize(
    ("processes", "degree", "why"),
    [(4, 3, "does not divide the 4 process"), (8, 8, "4 attention heads do not divide by 8")],
)
def test_a_fixed_degree_the_processes_or_heads_cannot_take_is_refused_in_one_line(processes, degree, why):
    from llmtune.plan import SequenceParallelError

    cfg = tiny_config("llama", layers=2)
    with pytest.raises(SequenceParallelError, match=why) as err:
        plan_micro_batch(
            cfg, global_batch_size=8, num_processes=processes, budget_bytes=2**34, sequence_parallel=degree, **SP_KW
        )
    assert "\n" not in str(err.value)


def test_tiled_mlps_are_taken_only_where_nothing_whole_fits():
    cfg = tiny_config("llama", layers=2)
    common = dict(global_batch_size=1, gradient_checkpointing=False, rates=RATES, tiled_mlp="auto", **SP_KW)
    whole = estimate(cfg, micro_batch_size=1, gradient_checkpointing=False, **SP_KW).peak_bytes
    tiled = estimate(cfg, micro_batch_size=1, gradient_checkpointing=False, tiled_mlp=True, **SP_KW).peak_bytes
    assert tiled < whole
    roomy = plan_micro_batch(cfg, budget_bytes=2**34, **common)
    assert not roomy.tiled_mlp and [d["tiled_mlp"] for d in roomy.degrees] == [False]
    tight = plan_micro_batch(cfg, budget_bytes=(tiled + whole) // 2, **common)
    assert tight.tiled_mlp and tight.fits and tight.estimate.settings["tiled_mlp"]


def test_sequence_groups_that_span_nodes_send_that_share_of_their_all_to_alls_over_the_network():
    """Groups of consecutive ranks, nodes filled in rank order (issue 54): a degree that divides a node's processes
    keeps every group on one node; a wider one, or one that straddles a node's edge, sends to other nodes."""
    from llmtune.parallel.sequence import off_node_share
    from llmtune.plan.search import sequence_degrees

    assert [off_node_share(d, 8, 16) for d in (1, 2, 4, 8)] == [0, 0, 0, 0]
    assert off_node_share(16, 8, 16) == 8 / 15  # 8 of its 15 peers on the other node
    assert off_node_share(4, 6, 12) == 2 / 3  # ranks 4-7 straddle the nodes 0-5 and 6-11
    assert off_node_share(4, 4, 4) == off_node_share(4, 16, 4) == 0  # one node holds them all
    cfg = tiny_config("llama", layers=2)  # 4 heads
    assert sequence_degrees(cfg, 4, "auto") == sequence_degrees(cfg, 4, "auto", per_node=4) == [1, 2, 4]
    assert sequence_degrees(cfg, 4, "auto", per_node=2) == [1, 2]
    assert sequence_degrees(cfg, 4, 4, per_node=2) == [4]  # fixed: as asked, timed over the network


@pytest.mark.slow
def test_auto_keeps_sequence_groups_on_a_node_and_a_fixed_degree_across_nodes_is_timed_over_the_network():
    """4 processes whose rows only a split in 4 fits: on one node of 4 auto splits them in 4; on nodes of 2 it weighs 1
    and 2 alone, and its refusal names degree 4 across nodes; fixed at 4 there, it fits, predicted slower than on one
    node (its all-to-alls over the network)."""
    cfg = tiny_config("llama", layers=2)
    rates = replace(RATES, link_bytes_per_s=450e9)  # an NVLink, far faster than the network
    common = dict(global_batch_size=4, num_processes=4, gradient_checkpointing=True, rates=rates, **SP_KW)

    def peak(degree: int) -> int:  # micro-batch 1, a group's rows accumulated: the least a degree keeps
        kw = dict(micro_batch_size=1, grad_accum_steps=degree, num_processes=4, sequence_parallel=degree)
        return estimate(cfg, gradient_checkpointing=True, **kw, **SP_KW).peak_bytes

    budget = (peak(4) + peak(2)) // 2
    one_node = plan_micro_batch(cfg, budget_bytes=budget, sequence_parallel="auto", processes_per_node=4, **common)
    assert one_node.sequence_parallel == 4 and [d["sequence_parallel"] for d in one_node.degrees] == [1, 2, 4]
    across = "parallel.sequence_parallel=4 on these 4 processes (its groups span nodes"
    with pytest.raises(MemoryPlanError, match=re.escape(across)):
        plan_micro_batch(cfg, budget_bytes=budget, sequence_parallel="auto", processes_per_node=2, **common)
    fixed = plan_micro_batch(cfg, budget_bytes=budget, sequence_parallel=4, processes_per_node=2, **common)
    assert fixed.fits and fixed.sequence_parallel == 4
    assert fixed.predicted_tokens_per_s < one_node.predicted_tokens_per_s
