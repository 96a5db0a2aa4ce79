"""The training loop end to end on tiny models: precisions, checkpointing, accumulation, outputs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from llmtune.cli.main import main
from llmtune.model.precision import resolve_precision
from llmtune.recipe import load_recipe
from llmtune.run.loop import fit
from llmtune.run.schedule import lr_factor
from llmtune.run.setup import build

ROOT = Path(__file__).resolve().parents[1]
METRIC_FIELDS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "peak_memory_bytes"}


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_entry_point_trains_saves_and_reloads(tiny_recipe, tmp_path):
    recipe = tiny_recipe(
        training__precision="auto",
        training__gradient_checkpointing=True,
        training__max_steps=8,
        logging__progress_bar=True,  # not drawn: stderr is no terminal here (tests/test_logs.py draws it)
        checkpoint__every_n_steps=4,
    )
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "finetune.py"), "--recipe", str(recipe), "logging.every_n_steps=4"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # What a user reads: llmtune's checkpoint line, no warning from DeepSpeed (installed here, unused).
    assert "saved checkpoint" in proc.stderr
    assert "Setting accelerator to CPU" not in proc.stderr
    run = tmp_path / "run"
    steps = [m for m in read_metrics(run) if "loss" in m]
    assert [m["step"] for m in steps] == list(range(1, 9))
    assert all(METRIC_FIELDS <= m.keys() for m in steps)
    assert steps[-1]["loss"] < steps[0]["loss"]
    printed = [float(loss) for loss in re.findall(r"step +\d+  loss (\S+)", proc.stdout)]
    assert printed == pytest.approx([sum(m["loss"] for m in steps[i : i + 4]) / 4 for i in (0, 4)], abs=6e-5)
    summary = json.loads((run / "run_summary.json").read_text())
    assert summary["precision"] == resolve_precision("auto", "cpu") and summary["gradient_checkpointing"] is True
    assert f"precision      {summary['precision']} (auto: this CPU has" in proc.stderr  # which, and why
    assert (summary["micro_batch_size"], summary["grad_accum_steps"], summary["num_processes"]) == (4, 2, 1)
    assert summary["peak_memory_bytes"] > 0 and summary["trained_tokens"] > 0
    assert load_recipe(run / "recipe.yaml").training.max_steps == 8
    model = AutoModelForCausalLM.from_pretrained(run / "final")
    assert model.config.num_hidden_layers == 2


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_precisions_and_checkpointing_train(tiny_recipe, tmp_path, precision, checkpointing):
    recipe = tiny_recipe(training__precision=precision, training__gradient_checkpointing=checkpointing)
    assert main(["train", "--recipe", str(recipe)]) == 0
    summary = json.loads((tmp_path / "run" / "run_summary.json").read_text())
    assert summary["precision"] == precision and summary["gradient_checkpointing"] is checkpointing
    losses = [m["loss"] for m in read_metrics(tmp_path / "run") if "loss" in m]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))


def test_fp16_on_cpu_is_refused_not_silently_replaced(tiny_recipe, capsys):
    assert main(["train", "--recipe", str(tiny_recipe(training__precision="fp16"))]) == 2
    assert "fp16 cannot run on cpu" in capsys.readouterr().err


def test_final_model_reloads_with_the_same_logits(tiny_recipe):
    run = build(load_recipe(tiny_recipe()))
    summary = fit(run)
    in_memory = run.accelerator.unwrap_model(run.model).model.eval()
    reloaded = AutoModelForCausalLM.from_pretrained(summary["final_dir"]).eval()
    ids = torch.randint(0, in_memory.config.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, in_memory(ids).logits, rtol=0, atol=1e-5)


def trained_weights(recipe_path: Path, *overrides: str) -> dict[str, torch.Tensor]:
    run = build(load_recipe(recipe_path, list(overrides)))
    fit(run)
    return {k: v.detach().clone() for k, v in run.accelerator.unwrap_model(run.model).model.state_dict().items()}


def test_gradient_accumulation_matches_one_big_batch(tiny_recipe, tmp_path):
    recipe = tiny_recipe(training__max_steps=2)
    accumulated = trained_weights(recipe, "training.micro_batch_size=2", f"output_dir={tmp_path / 'a'}")
    one_batch = trained_weights(recipe, "training.micro_batch_size=8", f"output_dir={tmp_path / 'b'}")
    for name, value in accumulated.items():
        # atol 1e-5 against steps of up to lr=1e-3: Adam turns a float-rounding difference in a near-zero
        # gradient into a ~1e-6 weight difference (seen with packed rows), a wrong weighting into ~1e-4.
        torch.testing.assert_close(value, one_batch[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.slow
def test_compile_runs_compiled_blocks_and_matches_eager(tiny_recipe, tmp_path):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    losses, keys = {}, {}
    for compiled in (False, True):
        out = tmp_path / f"compile-{compiled}"
        recipe = tiny_recipe(
            training__compile=compiled, training__max_steps=5, logging__every_n_steps=5, output_dir=str(out)
        )
        assert main(["train", "--recipe", str(recipe)]) == 0
        losses[compiled] = [m["loss"] for m in read_metrics(out) if "loss" in m]
        keys[compiled] = set(AutoModelForCausalLM.from_pretrained(out / "final").state_dict())
    # Dynamo really compiled: it steps aside on CPU steps whose memory is tracked (1-3 and logged ones), step 4 ran
    # compiled ...
    assert not counters["graph_break"], dict(counters["graph_break"])  # a break in a block runs it all eagerly
    assert counters["stats"]["unique_graphs"] >= 1
    # ... the same training in fp32 up to kernel rounding, and checkpoints with the eager names.
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-4, atol=0)
    assert keys[True] == keys[False]


@pytest.mark.parametrize("compiled", [False, True])
def test_compiled_runs_pad_packed_micro_batches_to_max_length(tiny_recipe, compiled):
    """A compiled block recompiles for every new shape: with compile on, packed micro-batches all get the
    max_length width (the shape the memory plan assumed); eager runs keep the longest row's width."""
    from llmtune.run.batches import collate_for

    run = build(load_recipe(tiny_recipe(training__compile=compiled, data__max_length=96)))
    assert run.data.packed
    short = [row for row in run.data.train if len(row["input_ids"]) < 96][:2]  # rows first-fit left unfilled
    assert short
    width = collate_for(run, short)["input_ids"].shape[1]
    assert width == (96 if compiled else max(len(row["input_ids"]) for row in short))


def test_checkpointing_lowers_measured_peak_memory(tiny_recipe, tmp_path):
    peaks = {}
    for checkpointing in (False, True):
        out = tmp_path / f"gc-{checkpointing}"
        recipe = tiny_recipe(
            training__micro_batch_size=16,
            training__global_batch_size=16,
            training__max_steps=3,
            training__gradient_checkpointing=checkpointing,
            output_dir=str(out),
        )
        assert main(["train", "--recipe", str(recipe)]) == 0
        peaks[checkpointing] = json.loads((out / "run_summary.json").read_text())["peak_memory_bytes"]
    assert peaks[True] < 0.8 * peaks[False], peaks


@pytest.mark.usefixtures("fixed_rates")  # micro-batch 1 or 2: the time model's choice
def test_auto_micro_batch_fits_the_budget_and_keeps_the_global_batch(tiny_recipe, tiny_model_dir):
    from llmtune.plan.estimate import estimate

    config = AutoConfig.from_pretrained(tiny_model_dir)
    settings = dict(seq_len=48, precision="fp32", gradient_checkpointing=True, loss="chunked", device="cpu")
    at = {m: estimate(config, micro_batch_size=m, grad_accum_steps=8 // m, **settings).peak_bytes for m in (2, 4)}
    budget = (at[2] + at[4]) // 2  # 2 fits, 4 does not
    recipe = tiny_recipe(training__micro_batch_size="auto", memory__budget=str(budget), training__loss="chunked")
    run = build(load_recipe(recipe))
    assert (run.plan.micro_batch_size, run.plan.grad_accum_steps, run.plan.source) == (2, 4, "planner")
    summary = fit(run)
    # The plan's own trace has the data's trained share (the loss's trained rows come with the batch).
    trained = run.data.stats.max_trained_fraction
    planned = estimate(config, micro_batch_size=2, grad_accum_steps=4, trained_fraction=trained, **settings)
    assert summary["memory_plan"]["predicted_peak_bytes"] == planned.peak_bytes
    assert summary["memory_plan"]["budget_bytes"] == budget
    # Real rows are shorter than max_length, which the plan assumes: the measured peak stays inside.
    assert 0 < summary["peak_memory_bytes"] <= budget


def test_impossible_budget_is_a_clear_error(tiny_recipe, capsys):
    recipe = tiny_recipe(training__micro_batch_size="auto", memory__budget="1MiB")
    assert main(["train", "--recipe", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "micro-batch 1 x 48 tokens is predicted to peak at" in err
    # Remedies the run already uses (checkpointing is on by default, the chunked loss too) are not offered.
    assert "Try: bf16 (or bf16-true), LoRA, a shorter max_length," in err and "checkpointing" not in err


def test_out_of_memory_halves_the_micro_batch_and_continues_the_same_step(tiny_recipe, tmp_path):
    recipe = tiny_recipe(training__max_steps=4)
    run = build(load_recipe(recipe))
    calls = {"n": 0}

    def fail_big_batches_from_step_2(module, args, kwargs):
        calls["n"] += 1
        if calls["n"] > 2 and kwargs["input_ids"].shape[0] > 2:  # step 1 ran 2 micro-batches of 4
            raise torch.OutOfMemoryError("injected: CUDA out of memory")

    run.model.register_forward_pre_hook(fail_big_batches_from_step_2, with_kwargs=True)
    summary = fit(run)
    assert (summary["micro_batch_size"], summary["grad_accum_steps"]) == (2, 4)
    assert summary["memory_plan"]["source"] == "planner, shrunk after out-of-memory"
    records = read_metrics(Path(run.recipe.output_dir))
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    assert [r["micro_batch_size"] for r in records if "loss" in r] == [4, 2, 2, 2]
    # Same updates as a run that used micro-batch 2 from the start: nothing was lost or repeated.
    reference = build(load_recipe(recipe, ["training.micro_batch_size=2", f"output_dir={tmp_path / 'ref'}"]))
    fit(reference)
    ref = [r["loss"] for r in read_metrics(tmp_path / "ref") if "loss" in r]
    assert [r["loss"] for r in records if "loss" in r] == pytest.approx(ref, rel=1e-5)


def test_warmup_longer_than_the_run_ramps_and_never_reaches_the_peak(tiny_recipe):
    recipe = load_recipe(tiny_recipe(training__max_steps=4, training__warmup_steps=10))
    factors = [lr_factor(step, recipe) for step in range(4)]
    assert factors == pytest.approx([0.1, 0.2, 0.3, 0.4])


@pytest.mark.slow
def test_quickstart_smoke_run_of_one_step(tmp_path, caplog):
    """`training.max_steps=1` on the quickstart (whose warmup is 20 steps) runs through scripts/finetune.py
    (a real process) and `llmtune train` (its `main`, in this process: the console script only calls it)."""
    recipe = str(ROOT / "recipes" / "quickstart.yaml")
    overrides = ["training.max_steps=1", "data.eval=[]", "logging.progress_bar=false", "logging.every_n_steps=1"]
    script = [sys.executable, str(ROOT / "scripts" / "finetune.py"), "--recipe", recipe]
    proc = subprocess.run([*script, *overrides, f"output_dir={tmp_path / 'a'}"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    caplog.set_level("INFO", logger="llmtune")
    assert main(["train", "--recipe", recipe, *overrides, f"output_dir={tmp_path / 'b'}"]) == 0
    for log in (proc.stderr, caplog.text):
        assert "longer than the run: the learning rate stops at 5% of its peak" in log
    for run in ("a", "b"):
        assert json.loads((tmp_path / run / "run_summary.json").read_text())["steps"] == 1
    # The step line says which tokens its speed counts (trained ones; the summary's speed: every position of the rows).
    assert re.search(r"step +1 .* \d+ trained tok/s ", proc.stdout + proc.stderr)


def test_a_pretrained_model_trains_in_training_mode(tiny_recipe):
    """from_pretrained returns a model in eval mode, where transformers skips gradient checkpointing and
    dropout; the loop used to train so until its first evaluation (the preference demo peaked at 2.2x)."""
    from llmtune.recipe import load_recipe
    from llmtune.run.loop import fit
    from llmtune.run.setup import build

    run = build(load_recipe(tiny_recipe(training__gradient_checkpointing=True)))  # the tiny model, from its folder
    modes = []
    hf_model = run.model.model
    hf_model.model.layers[0].register_forward_pre_hook(lambda m, _a: modes.append(m.training))
    fit(run)
    assert modes and all(modes)


@pytest.mark.parametrize(
    "precision,peft,adapters",
    [
        ("fp32", "none", "fp32"),
        ("bf16-true", "none", "fp32"),
        ("bf16-true", "lora", "fp32"),
        ("bf16-true", "lora", "bf16"),
    ],
    ids=["fp32", "bf16", "lora", "lora-bf16-adapters"],
)
def test_estimator_names_the_optimizer_training_builds(tiny_recipe, precision, peft, adapters):
    """`optim.optimizer_choice` (what the memory estimator traces) names the optimizer `make_optimizer` builds from
    the adapted model's parameters."""
    from llmtune.model.load import load_config, load_model
    from llmtune.ops.optim import BF16AdamW, make_optimizer, optimizer_choice
    from llmtune.run.parallelize import adapt

    recipe = load_recipe(tiny_recipe(training__precision=precision, peft__method=peft, peft__adapter_dtype=adapters))
    model = adapt(load_model(recipe, precision, load_config(recipe.model)), recipe)
    built = make_optimizer(model, recipe, torch.device("cpu"))
    choice = optimizer_choice("adamw", precision, peft, adapters)
    assert type(built) is {"adamw_bf16": BF16AdamW, "adamw_fused": torch.optim.AdamW}[choice]
