"""`llmtune bench` on tiny models: every trial runs through the real loop; the pure parts on made-up data."""

from __future__ import annotations

import argparse
import json
import statistics

import pytest
import torch

from llmtune.cli import bench
from llmtune.cli.bench import (
    add_bench_parser,
    estimate_kwargs,
    format_table,
    largest_fitting,
    plan_trials,
    run_bench,
    steady_steps,
    step_rates,
    tokens_per_s,
)
from llmtune.model.precision import cpu_supports_bf16
from llmtune.plan.estimate import LoraSpec
from llmtune.recipe import Checkpointing, load_recipe

ON_CPU = not torch.cuda.is_available()
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_bench_measures_each_precision_and_checkpointing(tiny_recipe, tmp_path):
    out = tmp_path / "bench"
    rows = run_bench(str(tiny_recipe()), [], out, steps=3, repeats=1, budget="64MiB")

    assert rows == json.loads((out / "bench.json").read_text())
    grid = {(r["precision"], r["gradient_checkpointing"]): r for r in rows}
    assert set(grid) == {(p, gc) for p in ("fp32", "fp16", "bf16") for gc in (False, True)}
    ran = [r for r in rows if not r["skipped"]]
    expected = {"fp32", "bf16"}  # bf16 runs everywhere; on a CPU without native bf16, emulated and marked so
    assert {r["precision"] for r in ran} == expected
    emulated = ON_CPU and not cpu_supports_bf16()
    assert [r["emulated"] for r in ran if r["precision"] == "bf16"] == [emulated, emulated]
    for r in ran:
        assert r["peak_memory_bytes"] > 0 and r["tokens_per_s"] > 0 and r["max_micro_batch_size"] > 0
        assert r["micro_batch_size"] == 4 and r["grad_accum_steps"] == 2  # the recipe's batch, untouched
        # 3 steps leave no untracked step after the warm-up: the row says which it used. Emulated trials run
        # 2 steps and time the second.
        assert r["tokens_per_s_steps"].startswith("steps 2-2" if r["emulated"] else "steps 3-3")
    base = grid["fp32", False]
    assert base["peak_memory_rel"] == base["tokens_per_s_rel"] == base["max_micro_batch_rel"] == 1.0
    # Checkpointing keeps fewer activations: less memory and a larger micro-batch fit.
    assert grid["fp32", True]["peak_memory_bytes"] < base["peak_memory_bytes"]
    assert grid["fp32", True]["max_micro_batch_size"] > base["max_micro_batch_size"]
    if ON_CPU:
        assert all(grid["fp16", gc]["skipped"] and "cpu" in grid["fp16", gc]["skipped"] for gc in (False, True))

    table = format_table(rows)
    # The table, then what `gradient_checkpointing: auto` would pick here and what it saves and pays.
    md = (out / "bench.md").read_text()
    planner_md = md[len(table) :].strip()
    assert md.startswith(table)
    assert planner_md.startswith("planner (gradient_checkpointing: auto") and "against checkpointing" in planner_md
    assert table.count("| bf16 (emulated) |") == (2 if emulated else 0)
    assert table.count("\n") == 1 + len(rows) + (2 if emulated else 0) and "skipped" in table
    assert (out / "bench.png").read_bytes()[:8] == PNG
    trial_dirs = {p.name for p in (out / "trials").iterdir()}
    assert trial_dirs == {f"{p}{ckpt}-r0" for p in expected for ckpt in ("", "-ckpt")}
    assert all((out / "trials" / d / "metrics.jsonl").is_file() for d in trial_dirs)


def fake_trial(calls: list):
    """Stands in for `run_trial`: records the order and the overrides, writes what a real trial writes."""

    def run_trial(recipe_path, overrides, output_dir):
        recipe = load_recipe(recipe_path, overrides)
        calls.append(recipe)
        slow = 2.0 if recipe.training.gradient_checkpointing else 1.0
        records = [
            {
                "step": s,
                "loss": 5.0 - s,
                "trained_tokens": 100,
                "seconds": slow * (3 if s <= 3 else 1),
                "peak_memory_bytes": 1000 if s <= 3 else None,
            }
            for s in range(1, recipe.training.max_steps + 1)
        ]
        summary = {
            "peak_memory_bytes": 500 if recipe.training.gradient_checkpointing else 1000,
            "micro_batch_size": 4,
            "grad_accum_steps": 2,
            "steps": recipe.training.max_steps,
        }
        output_dir.mkdir(parents=True)
        (output_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (output_dir / "run_summary.json").write_text(json.dumps(summary))
        return {"summary": summary, "records": records, "wall_s": 1.0}

    return run_trial


def test_bench_interleaves_rounds_and_keeps_the_recipes_lora(tiny_recipe, tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(bench, "run_trial", fake_trial(calls))
    capacity = {"max_micro_batch_size": 16, "max_micro_batch_method": "fake", "planned_micro_batch_size": 8}
    monkeypatch.setattr(bench, "micro_batch_capacity", lambda *a, **k: capacity)
    recipe = tiny_recipe(peft__method="lora", peft__rank=4, training__warmup_steps=3)
    rows = run_bench(
        str(recipe), ["seed=1"], tmp_path / "b", steps=5, repeats=3, budget="1GiB", precisions=["fp32", "fp16"]
    )

    order = [(r.training.precision, r.training.gradient_checkpointing) for r in calls]
    plain, ckpt = ("fp32", False), ("fp32", True)
    assert order == [plain, ckpt, ckpt, plain, plain, ckpt]  # each round reverses the one before
    for r in calls:  # the trials keep the recipe (and the user's overrides), with the bench's own settings
        assert (r.peft.method, r.peft.rank, r.seed) == ("lora", 4, 1)
        assert (r.training.max_steps, r.checkpoint.every_n_steps, r.logging.progress_bar) == (5, 0, False)
        assert r.data.eval == [] and r.logging.report_to == [] and r.training.warmup_steps == 3
    assert len({r.output_dir for r in calls}) == 6  # a fresh output_dir per trial and round
    off, on, *fp16 = rows
    if ON_CPU:  # skipped rows keep their place in the table, without figures
        assert [r["skipped"] is not None for r in fp16] == [True, True]
        assert fp16[0]["tokens_per_s"] is None and fp16[0]["tokens_per_s_rel"] is None
    assert off["peft"] == on["peft"] == "lora"
    assert off["tokens_per_s_per_round"] == [100.0] * 3 and on["tokens_per_s_per_round"] == [50.0] * 3
    assert off["tokens_per_s_steps"] == "steps 4-5 of each round (6 steps in all), memory tracker off"
    assert (on["peak_memory_rel"], on["tokens_per_s_rel"], on["tokens_per_s_best_rel"]) == (0.5, 0.5, 0.5)
    assert (tmp_path / "b" / "bench.png").read_bytes()[:8] == PNG


def test_estimator_settings_follow_the_recipe(tiny_recipe):
    recipe = load_recipe(tiny_recipe(peft__method="lora", peft__rank=4, peft__target_modules=["q_proj", "v_proj"]))
    kwargs = estimate_kwargs(recipe, "bf16", True, "cpu")
    assert kwargs["lora"] == LoraSpec(rank=4, target_modules=("q_proj", "v_proj"), dropout=False, alpha=32)
    assert (kwargs["precision"], kwargs["gradient_checkpointing"], kwargs["device"]) == (
        "bf16",
        Checkpointing(1),
        "cpu",
    )
    # what make_optimizer builds on a CPU too; loss auto -> chunked for Llama
    assert kwargs["optimizer"] == "adamw_fused" and kwargs["loss"] == "chunked"


def test_fp16_is_skipped_on_cpu_with_the_reason():
    trials = plan_trials("cpu")
    fp16 = [t for t in trials if t.precision == "fp16"]
    assert [t.gradient_checkpointing for t in fp16] == [False, True]
    assert all("fp16 cannot run on cpu" in t.skipped for t in fp16)
    assert all(t.skipped is None for t in trials if t.precision in ("fp32", "bf16"))
    assert [t.emulated for t in trials if t.precision == "bf16"] == [not cpu_supports_bf16()] * 2


@pytest.mark.parametrize("native", [True, False])
def test_emulated_bf16_is_measured_once_with_fewer_steps(tiny_recipe, tmp_path, monkeypatch, native):
    """Where bf16 is emulated (~30x slower) its trials run in the first round only, at EMULATED_STEPS; the rows
    are measured (not skipped) and marked emulated in the JSON, the table and the plot's labels."""
    import llmtune.model.precision
    from llmtune.cli.plot import _trial_label

    calls: list = []
    monkeypatch.setattr(llmtune.model.precision, "cpu_supports_bf16", lambda: native)
    monkeypatch.setattr(bench, "run_trial", fake_trial(calls))
    capacity = {"max_micro_batch_size": 16, "max_micro_batch_method": "fake", "planned_micro_batch_size": 8}
    monkeypatch.setattr(bench, "micro_batch_capacity", lambda *a, **k: capacity)
    rows = run_bench(str(tiny_recipe()), [], tmp_path / "b", steps=6, repeats=2, budget="1GiB", precisions=["bf16"])

    runs = [(r.training.gradient_checkpointing, r.training.max_steps) for r in calls]
    if native:
        assert runs == [(False, 6), (True, 6), (True, 6), (False, 6)]
    else:
        assert runs == [(False, bench.EMULATED_STEPS), (True, bench.EMULATED_STEPS)]
    assert [r["emulated"] for r in rows] == [not native] * 2
    assert all(r["skipped"] is None and r["tokens_per_s"] > 0 for r in rows)
    assert json.loads((tmp_path / "b" / "bench.json").read_text())[0]["emulated"] is (not native)
    assert ("bf16 (emulated)" in format_table(rows)) is (not native)
    assert _trial_label(rows[1]) == ("bf16 (emulated) + ckpt" if not native else "bf16 + ckpt")


def test_steady_steps_skip_warmup_and_prefer_untracked_steps():
    records = [
        {"step": s, "loss": 1.0, "trained_tokens": 100, "seconds": sec, "peak_memory_bytes": peak}
        for s, sec, peak in [(1, 9.0, 5), (2, 2.0, 6), (3, 2.0, 6), (4, 1.0, None), (5, 1.5, None)]
    ]
    records.append({"step": 5, "eval_loss": 1.0, "eval_perplexity": 2.7})
    chosen, tracked = steady_steps(records)
    assert [r["step"] for r in chosen] == [4, 5] and tracked is False
    assert tokens_per_s(chosen) == pytest.approx(200 / 2.5)
    # A burst of other work stalls one step: the median step rate stays put, the pooled rate does not.
    stalled = [chosen[0], {**chosen[0], "step": 6}, {**chosen[0], "step": 7, "seconds": 20.0}]
    assert statistics.median(step_rates(stalled)) == 100.0 and tokens_per_s(stalled) < 15
    chosen, tracked = steady_steps(records[:3])
    assert [r["step"] for r in chosen] == [3] and tracked is True


def test_largest_fitting_micro_batch():
    calls = []

    def peak_of(b: int) -> tuple[int, str]:
        calls.append(b)
        # Two phases: the optimizer step (flat) peaks at small batches, activations (steep) at large ones.
        return max((1000, "step"), (200 + 30 * b, "backward"))

    size, how = largest_fitting(peak_of, budget=10_000, start=4)
    assert size == 326 and "32 and 64" in how  # 200 + 30 * 326 = 9980 <= 10_000 < 10_010
    assert max(calls) <= 64  # extrapolated, not estimated at large micro-batches
    assert largest_fitting(peak_of, budget=1100, start=64)[0] == 30  # bisected below the start
    assert largest_fitting(peak_of, budget=999, start=8)[0] == 0


def test_bench_parser_wires_a_subcommand():
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--recipe", "r.yaml", "data.max_length=32", "--steps", "4", "--budget", "8GiB"])
    assert (args.recipe, args.overrides, args.steps, args.budget, args.out) == (
        "r.yaml",
        ["data.max_length=32"],
        4,
        "8GiB",
        None,
    )
    assert callable(args.func)
    with pytest.raises(SystemExit):  # too few steps to leave out a warm-up: argparse refuses it (exit 2)
        parser.parse_args(["bench", "--recipe", "r.yaml", "--steps", "2"])


@pytest.mark.slow
def test_bench_vs_hf_runs_both_tools_on_the_same_work(tmp_path):
    """`python -m benchmarks.vs_hf` end to end at a toy size: in the identical mode both tools must do the same
    work (same losses) at no more memory for llmtune; the defaults mode must pick its own settings."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "vs_hf.json"
    args = ["--layers", "1", "--hidden", "128", "--max-length", "128", "--vocab", "2000", "--timed-steps", "1"]
    args += ["--rounds", "1", "--peak-repeats", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.vs_hf", *args, "--modes", "identical", "defaults", "--output", str(out)],
        capture_output=True,
        text=True,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    same = result["modes"]["identical"]["rounds"][0]
    torch.testing.assert_close(same["llmtune"]["losses"], same["hf"]["losses"], rtol=1e-5, atol=0)
    assert same["llmtune"]["peak_memory_bytes"] <= same["hf"]["peak_memory_bytes"]
    own = result["modes"]["defaults"]["rounds"][0]["llmtune"]
    # llmtune's own defaults: packed rows, the chunked loss, and checkpointing as the planner chose it.
    assert own["packed"] and own["loss_impl"] == "chunked" and isinstance(own["gradient_checkpointing"], bool)
    assert 0 < result["mfu"]["per_mode_median"]["defaults"] < 1
