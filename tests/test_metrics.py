"""What a run reports: metrics.jsonl per step and per eval, Accelerate trackers, and the curves drawn from them."""

from __future__ import annotations

import importlib.util
import json
import math
import sys

import pytest
import torch

from llmtune.cli.main import main
from llmtune.cli.plot import CURVES_FILE, PlotDependencyError, PlotError, add_plot_parser, plot_run, read_metrics
from llmtune.run.metrics import TRACKER_MODULES, ModelFlops, datasheet_peak_flops, model_flops, peak_flops

STEP_FIELDS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_memory_bytes", "skipped_steps", "time"}
PNG = b"\x89PNG\r\n\x1a\n"


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_run_writes_metrics_tensorboard_events_and_curves(tiny_recipe, tiny_data, tiny_model_dir, tmp_path):
    """One 4-step run (training is the slow part) with eval data (the training file again) evaluated every 2
    steps and logged to tensorboard; each output is checked on its own below."""
    recipe = tiny_recipe(
        data__eval=[{"path": str(tiny_data)}],
        training__eval_every_n_steps=2,
        logging__report_to=["tensorboard"],
    )
    assert main(["train", "--recipe", str(recipe)]) == 0
    run = tmp_path / "run"
    check_metrics_jsonl(run)
    check_mfu(run, tiny_model_dir, rows=8, max_length=48)
    check_tensorboard_events(run)
    check_curves(run)


def check_metrics_jsonl(run) -> None:
    lines = records(run)
    steps = [r for r in lines if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert STEP_FIELDS <= r.keys(), STEP_FIELDS - r.keys()
        assert math.isfinite(r["loss"]) and r["lr"] > 0 and r["grad_norm"] > 0
        assert r["tokens_per_s"] > 0 and r["skipped_steps"] == 0
        # logging.every_n_steps=1: every step is logged, so on CPU every step is memory-tracked too, except
        # steps 3 and 4, which time the step for the time model (counting storages would slow them down).
        assert (r["peak_memory_bytes"] is None) == (r["step"] in (3, 4) and not torch.cuda.is_available())
    ends = [r["time"] for r in steps]
    assert ends == sorted(ends) and ends[-1] - ends[0] >= sum(r["seconds"] for r in steps[1:])
    evals = [r for r in lines if "eval_loss" in r]
    assert [r["step"] for r in evals][:2] == [2, 4]  # every 2 steps (then once more at the end)
    for r in evals:
        assert r["eval_perplexity"] == pytest.approx(math.exp(r["eval_loss"]), rel=1e-5)
    summary = json.loads((run / "run_summary.json").read_text())
    assert summary["eval_loss"] == pytest.approx(evals[-1]["eval_loss"])
    # The steady-state peak leaves out the first step (AdamW's states appear during it).
    assert summary["peak_memory_bytes"] == max(r["peak_memory_bytes"] or 0 for r in steps[1:])


def check_mfu(run, model_dir, *, rows: int, max_length: int) -> None:
    """MFU is its definition, whatever the host's load: a step's model FLOPs over its seconds over the peak the run
    used (measured once per process at start-up; `peak_flops` is cached, so this is the run's). The FLOPs it implies
    must lie between what the step's trained tokens need at least and what `rows` full rows could need at most. A
    bound like MFU < 1 would read the clock: on a busy host the start-up peak was measured low (MFU 2.79 was seen)."""
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    peak, _ = peak_flops(device, "fp32")
    flops = model_flops(AutoModelForCausalLM.from_pretrained(model_dir))
    for r in (r for r in records(run) if "loss" in r):
        assert math.isfinite(r["mfu"]) and r["mfu"] > 0
        step_flops = r["mfu"] * r["seconds"] * peak
        least = r["trained_tokens"] * (flops.per_token + flops.per_trained_token)
        most = rows * max_length * (flops.per_token + max_length * flops.attention)
        most += r["trained_tokens"] * flops.per_trained_token
        assert least * (1 - 1e-9) <= step_flops <= most * (1 + 1e-9), (r["step"], least, step_flops, most)


def check_tensorboard_events(run) -> None:
    # Accelerate's TensorBoardTracker writes to <project_dir = output_dir>/<project name = "llmtune">; the
    # recipe goes in as hparams, which tensorboard writes to a timestamped folder below that.
    scalars_dir = run / "llmtune"
    assert any(scalars_dir.glob("events.out.tfevents.*"))
    assert all(scalars_dir in e.parents for e in run.rglob("events.out.tfevents.*"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(scalars_dir))
    acc.Reload()
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "mfu", "eval_loss"} <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3, 4]


def check_curves(run) -> None:
    paths = plot_run(run)
    assert paths == [run / CURVES_FILE]
    data = paths[0].read_bytes()
    assert data[:8] == PNG and len(data) > 10_000


@pytest.mark.parametrize("tied", [False, True])
def test_model_flops_count_the_head_per_trained_token_and_no_lookup(tied):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    h, inter, layers, vocab, kv = 64, 160, 2, 500, 2
    config = LlamaConfig(
        hidden_size=h, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=tied,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    head_dim = h // 4
    # q, o: h x h; k, v: h x kv*head_dim; gate, up, down: h x inter; two RMSNorm weights per layer + the final one.
    per_layer = 2 * h * h + 2 * h * kv * head_dim + 3 * h * inter + 2 * h
    body = layers * per_layer + h
    assert model_flops(model) == ModelFlops(6 * body, 6 * vocab * h, 12 * layers * h)

    lora = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    adapters = layers * 2 * (h + h)  # A: 2 x h, B: h x 2 per q_proj
    assert model_flops(lora) == ModelFlops(4 * body + 6 * adapters, 4 * vocab * h, 12 * layers * h)


def test_attention_flops_count_each_packed_example_not_the_row():
    from llmtune.data import squared_lengths

    packed = {"input_ids": [5] * 10, "position_ids": [0, 1, 2, 3, 0, 1, 2, 0, 1, 2]}  # examples of 4, 3, 3
    plain = {"input_ids": [5] * 6}
    assert squared_lengths([packed, plain]) == 16 + 9 + 9 + 36
    flops = ModelFlops(per_token=100.0, per_trained_token=10.0, attention=2.0)
    assert flops.step(processed_tokens=16, trained_tokens=5, squared_lengths=70) == 1600 + 50 + 140


def test_mfu_peak_is_the_datasheet_figure_for_known_gpus_and_measured_elsewhere():
    assert datasheet_peak_flops("NVIDIA H200") == 989.5e12
    assert datasheet_peak_flops("NVIDIA H100 80GB HBM3") == 989.5e12
    assert datasheet_peak_flops("NVIDIA H100 PCIe") == 756.5e12
    assert datasheet_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert datasheet_peak_flops("NVIDIA L4") == 121e12
    assert datasheet_peak_flops("NVIDIA L40S") == 362.05e12
    assert datasheet_peak_flops("NVIDIA GeForce RTX 4090") == 165.2e12
    assert datasheet_peak_flops("NVIDIA A10") == 125e12
    assert datasheet_peak_flops("NVIDIA A10G") is None  # no published figure: measured
    assert datasheet_peak_flops("Some Future GPU") is None
    value, source = peak_flops(torch.device("cpu"), "fp32")
    assert value > 0 and source.startswith("measured")


def test_unknown_tracker_is_refused_at_start(tiny_recipe, tmp_path, capsys):
    recipe = tiny_recipe(logging__report_to=["tensorbored"])
    assert main(["train", "--recipe", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "unknown tracker 'tensorbored'" in err and "tensorboard" in err
    assert not (tmp_path / "run").exists()  # refused before anything ran or was written


def test_tracker_that_is_not_installed_is_refused_at_start(tiny_recipe, tmp_path, capsys):
    missing = [n for n, mods in TRACKER_MODULES.items() if not any(importlib.util.find_spec(m) for m in mods)]
    if not missing:
        pytest.skip("every known tracker is installed here")
    recipe = tiny_recipe(logging__report_to=[missing[0]])
    assert main(["train", "--recipe", str(recipe)]) == 2
    assert f"pip install {missing[0]}" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_plot_keeps_the_last_record_of_a_step_after_resume(tmp_path):
    lines = [
        {"step": 1, "loss": 3.0, "lr": 1e-3, "peak_memory_bytes": None},
        {"step": 2, "loss": 9.0, "lr": 1e-3, "peak_memory_bytes": None},  # lost: resumed from step 1
        {"step": 2, "loss": 2.0, "lr": 1e-3, "peak_memory_bytes": 2**20},
        {"step": 2, "eval_loss": 2.5, "eval_perplexity": math.exp(2.5)},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    steps, evals = read_metrics(tmp_path)
    assert [(r["step"], r["loss"]) for r in steps] == [(1, 3.0), (2, 2.0)] and len(evals) == 1
    assert plot_run(tmp_path)[0].read_bytes()[:8] == PNG  # fields never logged get an empty panel


def test_plot_errors_are_clear(tmp_path, monkeypatch, capsys):
    with pytest.raises(PlotError, match="metrics.jsonl: not found"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(PlotDependencyError, match="pip install matplotlib"):
        plot_run(tmp_path)
    assert issubclass(PlotDependencyError, ValueError)
    # The command reports it as a user error (exit 2), without a traceback.
    import argparse

    parser = argparse.ArgumentParser()
    add_plot_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plot", str(tmp_path)])
    assert args.func(args) == 2
    assert "pip install matplotlib" in capsys.readouterr().err


def test_plot_estimate_draws_memory_against_speed(tiny_recipe, tmp_path):
    from transformers import AutoConfig

    from llmtune.cli.plot import plot_estimate
    from llmtune.plan import plan_micro_batch
    from llmtune.recipe import load_recipe

    recipe = load_recipe(tiny_recipe())
    config = AutoConfig.from_pretrained(recipe.model.name_or_path)
    settings = {"precision": "fp32", "gradient_checkpointing": "auto", "device": "cpu"}
    plan = plan_micro_batch(config, global_batch_size=8, budget_bytes=2**30, seq_len=48, **settings)
    assert any(c["predicted_peak_bytes"] for c in plan.frontier)
    path = plot_estimate(plan, "tiny", tmp_path / "estimate.png")
    assert path.read_bytes()[:8] == PNG


@pytest.mark.gpu
def test_datasheet_peak_bounds_a_large_matmul_on_this_gpu():
    """The table holds dense figures: a large bf16 matmul gets close to it but never above (a sparse figure,
    2x, or another card's would show here)."""
    from llmtune.run.metrics import measure_peak_flops

    name = torch.cuda.get_device_name()
    known = datasheet_peak_flops(name)
    if known is None:
        pytest.skip(f"{name} has no datasheet figure: MFU uses the measured peak")
    measured = measure_peak_flops(torch.device("cuda"), "bf16", max_size=8192)
    assert 0.5 * known < measured <= 1.02 * known, (name, measured / 1e12, known / 1e12)
    assert peak_flops(torch.device("cuda"), "bf16") == (known, f"datasheet: {name}, dense bf16")
