"""The time model on several GPUs and the planner choosing the engine (issue 28, item 7): each engine's collectives
from NCCL's bus-bandwidth model, the overlap of launches and of collectives with compute, TF32 as the run sets it,
FSDP2's and DeepSpeed's mixed-precision memory, and every engine ranked for a launch."""

from __future__ import annotations

import json

import pytest
import torch
from test_memory import tiny_config
from transformers import AutoModelForCausalLM

from llmtune.cli.main import main
from llmtune.model.load import resolve_config
from llmtune.plan import BatchPlan, estimate, planning_target, recipe_for_model
from llmtune.plan.communication import LINK_EFFICIENCY, Traffic, engine_traffic, step_seconds
from llmtune.plan.planning import EngineChoice, engine_advice, engine_note, plan_engines
from llmtune.plan.timing import Rates, Work, datasheet_rates

GB = 1e9


@pytest.mark.parametrize(
    ("sharding", "per_micro_step", "last_backward", "after_update"),
    [
        # 8 processes, an 8e9-parameter model trained whole in bf16 mixed precision. DDP: a ring all-reduce of the
        # fp32 gradients (32 GB) moves 2 x 7/8 of them; FSDP2: two all-gathers of the bf16 weights (16 GB, 7/8 each)
        # and a reduce-scatter of fp32 gradients; ZeRO: all in bf16, ZeRO-2 gathering the updated weights after.
        ("none", 0, 56 * GB, 0),
        ("fsdp", 2 * 14 * GB + 28 * GB, 0, 0),
        ("fsdp_no_reshard", 14 * GB + 28 * GB, 0, 0),
        ("zero2", 14 * GB, 0, 14 * GB),
        ("zero3", 2 * 14 * GB + 14 * GB, 0, 0),
    ],
)
def test_each_engines_collectives_move_what_nccl_moves(sharding, per_micro_step, last_backward, after_update):
    traffic = engine_traffic(sharding, 8, "bf16", parameters=8 * 10**9, trainable=8 * 10**9)
    assert traffic == pytest.approx(Traffic(per_micro_step, last_backward, after_update))


def test_one_process_sends_nothing_and_lora_gathers_the_frozen_base():
    assert engine_traffic("fsdp", 1, "bf16", 8 * 10**9, 8 * 10**9) == Traffic()
    # LoRA: 20M trainable of 8B. DDP all-reduces the adapters only; FSDP2 still gathers every weight, twice.
    ddp = engine_traffic("none", 2, "bf16", 8 * 10**9, 20 * 10**6)
    fsdp = engine_traffic("fsdp", 2, "bf16", 8 * 10**9, 20 * 10**6)
    assert ddp.last_backward == pytest.approx(2 * 1 / 2 * 80e6)
    assert fsdp.per_micro_step == pytest.approx(2 * 1 / 2 * 16e9 + 1 / 2 * 80e6)


def test_collectives_overlap_the_micro_steps_they_run_in():
    bus = LINK_EFFICIENCY * 100 * GB
    # Hidden behind compute: the step is its compute.
    hidden = Traffic(per_micro_step=0.05 * bus)
    assert step_seconds(0.1, 4, 0.01, hidden, 100 * GB) == pytest.approx(4 * 0.1 + 0.01)
    # Longer than compute: each micro-step waits for its collectives.
    exposed = Traffic(per_micro_step=1.0 * bus)
    assert step_seconds(0.1, 4, 0.01, exposed, 100 * GB) == pytest.approx(4 * 1.0 + 0.01)
    # DDP's all-reduce starts with the last backward (after a third of the micro-step): 0.1 + 0.5 s.
    ddp = Traffic(last_backward=0.5 * bus)
    assert step_seconds(0.3, 4, 0.01, ddp, 100 * GB) == pytest.approx(3 * 0.3 + 0.6 + 0.01)
    # ZeRO-2's gather of the updated weights has nothing left to hide behind.
    zero2 = Traffic(after_update=0.2 * bus)
    assert step_seconds(0.3, 2, 0.01, zero2, 100 * GB) == pytest.approx(0.6 + 0.01 + 0.2)
    assert step_seconds(0.3, 2, 0.01, exposed, None) == pytest.approx(0.61)  # link unknown: not counted


def test_a_gpu_overlaps_its_launches_with_its_kernels_and_a_cpu_adds_them():
    work = Work(flops=1e12, bytes=1e11, ops=50_000)
    cpu = Rates(1e12, 1e12, 1e-5, "test")
    gpu = Rates(1e12, 1e12, 1e-5, "test", overlapped=True)
    assert cpu.seconds(work) == pytest.approx(1.0 + 0.1 + 0.5)
    assert gpu.seconds(work) == pytest.approx(1.1)  # the device's 1.1 s hides 0.5 s of launches
    assert gpu.seconds(Work(flops=1e9, ops=50_000)) == pytest.approx(0.5)  # small kernels: launch-bound


def test_fp32_is_timed_at_tf32_only_where_the_run_turns_it_on_and_the_card_has_it():
    h100_fp32 = datasheet_rates("h100-80gb", "fp32", tf32=False)
    h100_tf32 = datasheet_rates("h100-80gb", "fp32", tf32=True)
    bf16 = datasheet_rates("h100-80gb", "bf16")
    # NVIDIA H100 SXM: 67 TFLOP/s FP32, 494.7 TF32 and 989.4 BF16 dense (at the time model's 60% of peak).
    assert h100_fp32.flops_per_s == pytest.approx(0.6 * 67e12)
    assert h100_tf32.flops_per_s == pytest.approx(bf16.flops_per_s / 2)
    assert datasheet_rates("t4", "fp32", tf32=True).flops_per_s == pytest.approx(0.6 * 8.1e12)  # Turing: no TF32
    assert h100_tf32.link_bytes_per_s == 450 * GB and datasheet_rates("l40s", "bf16").link_bytes_per_s == 32 * GB


def test_a_recipe_sets_tf32_for_the_run(tiny_recipe, monkeypatch):
    """true / false as set; auto (the default) on where the run is on CUDA (faked: the launch's device check and the
    allocator setting answered), off on a CPU."""
    from llmtune.objectives import objective_for
    from llmtune.recipe import load_recipe
    from llmtune.run import launch

    def tf32_after_launch(cuda: bool, **overrides) -> bool:
        with monkeypatch.context() as m:
            m.setattr(torch.cuda, "is_available", lambda: cuda)
            m.setattr(launch, "check_requirements", lambda recipe, device_type: None)
            m.setattr(torch.cuda.memory, "_set_allocator_settings", lambda settings: None)
            m.setattr(launch, "choose_precision", lambda precision, device_type: ("fp32", "as asked"))
            m.setattr(launch, "Accelerator", lambda **kwargs: None)  # a CUDA Accelerator needs the device
            recipe = load_recipe(tiny_recipe(**overrides))
            launch.make_accelerator(recipe, "ddp", objective_for(recipe))
        return torch.backends.cuda.matmul.allow_tf32

    before = torch.backends.cuda.matmul.allow_tf32
    try:
        for value in (True, False):
            assert tf32_after_launch(False, training__tf32=value) is value
        assert tf32_after_launch(False) is False
        assert tf32_after_launch(True) is True
        assert tf32_after_launch(True, training__tf32=False) is False
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_an_fp32_recipe_is_planned_at_tf32s_rate_on_a_gpu_by_default(tiny_recipe, tiny_model_dir):
    """The planner times fp32 matmuls as the run will run them: TF32 by default on a GPU, full fp32 when turned off."""
    from llmtune.plan.planning import plan_recipe
    from llmtune.recipe import load_recipe

    def rates_source(**overrides) -> str:
        batch = {"training__micro_batch_size": 2, "training__global_batch_size": 2}
        recipe = load_recipe(tiny_recipe(training__precision="fp32", **batch, **overrides))
        cfg = resolve_config(str(tiny_model_dir))
        plan, _ = plan_recipe(recipe, cfg, device="cuda", budget_bytes=2**34, num_processes=1, gpu="h100-80gb")
        return plan.rates_source

    assert "TF32 on" in rates_source()
    assert "TF32 off" in rates_source(training__tf32=False)


def test_a_recipe_sets_the_collective_timeout(tiny_recipe):
    from datetime import timedelta

    from llmtune.objectives import objective_for
    from llmtune.recipe import load_recipe
    from llmtune.run.launch import make_accelerator

    for overrides, seconds in (({}, 1800), ({"distributed__timeout": 90}, 90)):
        recipe = load_recipe(tiny_recipe(**overrides))
        accelerator, _, _ = make_accelerator(recipe, "ddp", objective_for(recipe))
        assert accelerator.init_handler.timeout == timedelta(seconds=seconds)


def _bf16_sizes(cfg) -> tuple[int, int, int]:
    """The model's parameter bytes in bf16, one decoder layer's, and the root's (all but the layers)."""
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    total = sum(p.numel() * 2 for p in model.parameters())
    layer = sum(p.numel() * 2 for p in model.model.layers[0].parameters())
    return total, layer, total - len(model.model.layers) * layer


@pytest.mark.parametrize("sharding", ["fsdp", "fsdp_no_reshard"])
def test_fsdp2_in_bf16_keeps_fp32_shards_and_gathers_bf16_blocks_and_root(sharding):
    """FSDP2's MixedPrecisionPolicy (torch/distributed/fsdp/_fully_shard): the sharded parameters stay fp32, the
    all-gather's output is in param_dtype bf16, there is no autocast and so no cache of cast weights. The root
    (embeddings, norm, lm head; llmtune.parallel.engines.shard_fsdp2 sets it reshard_after_forward=False) stays
    gathered from forward to backward; the blocks two at a time, or all of them by backward without resharding."""
    cfg = tiny_config("llama", layers=4)
    est = estimate(
        cfg, micro_batch_size=1, seq_len=64, precision="bf16", gradient_checkpointing=True, num_processes=2,
        sharding=sharding, device="cpu",
    )  # fmt: skip
    total, layer, root = _bf16_sizes(cfg)
    assert "autocast_weight_copies" not in est.breakdown
    assert est.breakdown["weights"] == pytest.approx(2 * total / 2, rel=0.01)  # fp32 = 2x bf16, halved
    gathered = 2 * layer if sharding == "fsdp" else 4 * layer
    waiting = layer if est.peak_phase == "backward" else 0  # a block's unsharded gradients before reduce-scatter
    assert est.peak_phase in ("forward", "backward")
    assert est.breakdown["sharding_buffers"] == gathered + root + waiting


def test_deepspeed_in_bf16_keeps_16bit_weights_beside_the_fp32_masters():
    """DeepSpeed's bf16 engine holds the module in bf16 and the trained weights' fp32 masters in its optimizer
    partitions: ZeRO-3 a 1/N share of both, ZeRO-2 the bf16 weights whole and a share of the masters."""
    cfg = tiny_config("llama", layers=4)
    kw = dict(micro_batch_size=1, seq_len=64, precision="bf16", gradient_checkpointing=True, num_processes=2)
    total, _, _ = _bf16_sizes(cfg)
    zero3 = estimate(cfg, sharding="zero3", device="cpu", **kw)
    zero2 = estimate(cfg, sharding="zero2", device="cpu", **kw)
    assert zero3.totals["weights"] == pytest.approx(total, rel=0.01)  # traced in bf16
    assert zero3.breakdown["weights"] == pytest.approx((total + 2 * total) / 2, rel=0.01)
    assert zero2.breakdown["weights"] == pytest.approx(total + 2 * total / 2, rel=0.01)


def _plan(tokens_per_s: float, fits: bool = True) -> BatchPlan:
    return BatchPlan(1, 1, 2, predicted_tokens_per_s=tokens_per_s, predicted_peak_bytes=10 if fits else 30,
                     budget_bytes=20)  # fmt: skip


def test_a_launch_is_told_the_engine_the_planner_would_take():
    ranked = [EngineChoice("fsdp2", "fsdp", _plan(3000)), EngineChoice("ddp", "none", _plan(1000))]
    assert "would launch fsdp2" in engine_note(ranked, "none") and "3.00x" in engine_note(ranked, "none")
    assert engine_note(ranked, "fsdp") is None
    over = [EngineChoice("zero3", "zero3", _plan(3000)), EngineChoice("ddp", "none", _plan(5000, fits=False))]
    assert "over budget" in engine_note(over, "none")
    assert engine_note([EngineChoice("ddp", "none", None, "does not fit")], "fsdp") is None


def _ranked(model: str, method: str, gpu: str, n: int, seq_len: int = 2048) -> list[EngineChoice]:
    config = resolve_config(model)
    target = planning_target(device_memory=None, gpu=gpu, device=None, recipe_budget="auto")
    recipe = recipe_for_model(model, config, method=method, seq_len=seq_len, device="cuda")
    return plan_engines(recipe, config, device="cuda", num_processes=n, budget_bytes=target.budget_bytes, gpu=gpu)


@pytest.mark.slow
def test_the_planner_shards_what_ddp_cannot_hold():
    full = _ranked("llama-3.2-3b", "full", "l4", 4, seq_len=512)
    by_engine = {c.sharding: c for c in full}
    assert by_engine["none"].plan is None and "over the budget" in by_engine["none"].why  # 16 bytes/param: 51 GB
    assert full[0].sharding in ("fsdp", "zero3") and full[0].plan.fits


@pytest.mark.slow
def test_train_advises_a_multi_gpu_launch_whose_engine_the_planner_would_not_take():
    """`plan_run`'s advice (`engine_advice`): a full fine-tune DDP cannot hold, launched with DDP on 4 GPUs, is told
    the sharded engine the planner ranks first; the planner's own engine, one process or CPUs get no advice."""
    config = resolve_config("llama-3.2-3b")
    recipe = recipe_for_model("llama-3.2-3b", config, method="full", seq_len=512, device="cuda")
    budget = planning_target(device_memory=None, gpu="l4", device=None, recipe_budget="auto").budget_bytes

    def advice(launched: str, device: str = "cuda", n: int = 4) -> str | None:
        return engine_advice(recipe, config, device=device, num_processes=n, launched=launched, budget_bytes=budget,
                             gpu="l4")  # fmt: skip

    best = _ranked("llama-3.2-3b", "full", "l4", 4, seq_len=512)[0]
    note = advice("none")
    assert note is not None and f"would launch {best.engine}:" in note and "over budget" in note
    assert advice(best.sharding) is None
    assert advice("none", device="cpu") is None and advice("none", n=1) is None


@pytest.mark.slow
def test_on_pcie_cards_fsdp2_pays_for_gathering_a_lora_base_and_amortises_it_over_a_larger_micro_batch():
    lora = _ranked("llama-3.2-3b", "lora", "l40s", 4, seq_len=512)
    ddp, fsdp = ({c.sharding: c for c in lora}[s].plan for s in ("none", "fsdp"))
    assert lora[0].sharding == "none"  # no faster engine: DDP first (ties keep ENGINES' order)
    at_ddps = next(
        c for c in fsdp.frontier if c["micro_batch_size"] == ddp.micro_batch_size and c["every_n_layers"] == 0
    )
    assert at_ddps["predicted_tokens_per_s"] < ddp.predicted_tokens_per_s
    assert fsdp.micro_batch_size > ddp.micro_batch_size


@pytest.mark.slow
def test_estimate_ranks_the_engines_and_plans_the_first(capsys):
    assert main(["estimate", "--model", "qwen2.5-0.5b", "--full", "--gpu", "l4", "--num-processes", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    engines = out["engines"]
    assert {e["sharding"] for e in engines} == {"none", "fsdp", "fsdp_no_reshard", "zero2", "zero3"}
    assert out["estimate"]["settings"]["sharding"] == engines[0]["sharding"] and engines[0]["fits"]
    speeds = [e["predicted_tokens_per_s"] for e in engines if e["fits"]]
    assert speeds == sorted(speeds, reverse=True)


def test_compiled_blocks_are_timed_with_their_memory_bound_work_fused():
    """Rates.compiled_blocks takes the block's memory-bound bytes and launches down to what Inductor's kernels move
    (timing.COMPILED_BLOCK_*); matmul FLOPs and the work outside the blocks (head, loss, optimizer) stay as they are."""
    from llmtune.plan.timing import COMPILED_BLOCK_BYTES, COMPILED_BLOCK_OPS, compiled

    work = Work(flops=1e12, bytes=3e9, ops=1000, block_bytes=2e9, block_ops=600)
    eager = Rates(1e12, 1e10, 1e-6, "test")
    fused = compiled(eager)
    assert compiled(fused) == fused
    assert eager.seconds(work) == pytest.approx(1.0 + 0.3 + 1e-3)
    left_bytes = 1e9 + 2e9 * COMPILED_BLOCK_BYTES
    left_ops = 400 + 600 * COMPILED_BLOCK_OPS
    assert fused.seconds(work) == pytest.approx(1.0 + left_bytes / 1e10 + left_ops * 1e-6)


def test_the_planner_times_compiled_blocks_on_a_gpu_by_default(tiny_recipe, tiny_model_dir):
    """compile: auto is on for a GPU plan, and the traced step's block work is what it fuses: part of the bytes, as
    the embedding's backward, the head and the loss stay eager. On a CPU plan, auto is off."""
    from llmtune.plan.planning import plan_recipe
    from llmtune.recipe import load_recipe

    cfg = resolve_config(str(tiny_model_dir))

    def plan(device: str, **overrides) -> BatchPlan:
        recipe = load_recipe(tiny_recipe(training__micro_batch_size=2, training__global_batch_size=2, **overrides))
        kwargs = {"gpu": "h100-80gb"} if device == "cuda" else {}
        return plan_recipe(recipe, cfg, device=device, budget_bytes=2**34, num_processes=1, **kwargs)[0]

    auto, eager = plan("cuda"), plan("cuda", training__compile=False)
    assert auto.rates_source.endswith("decoder blocks compiled") and "compiled" not in eager.rates_source
    assert auto.predicted_tokens_per_s > eager.predicted_tokens_per_s
    work = auto.estimate.work
    assert 0 < work.block_bytes < work.bytes and 0 < work.block_ops < work.ops
    assert "compiled" not in plan("cpu").rates_source
