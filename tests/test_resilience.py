"""Checkpoints, exact resume, preemption and non-finite losses — with real processes and real signals."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import llmtune.run.batches as batches_module
from llmtune.cli.main import main
from llmtune.errors import EXIT_PREEMPTED
from llmtune.plan.planning import TrainingError
from llmtune.recipe import load_recipe
from llmtune.run import checkpoint
from llmtune.run.loop import fit, train
from llmtune.run.schedule import lr_factor
from llmtune.run.setup import build

ROOT = Path(__file__).resolve().parents[1]

# Runs llmtune's entry point with one hook: after the checkpoint of step PAUSE_STEP is complete (or,
# with PAUSE_IN_WRITE=1, while it is being written) the process sleeps, so the test can SIGKILL it there.
PAUSING_ENTRY = """
import os, sys, time
import accelerate
from llmtune.run import checkpoint
from llmtune.cli.main import main

pause_step = int(os.environ["PAUSE_STEP"])
if os.environ.get("PAUSE_IN_WRITE") == "1":
    save_state = accelerate.Accelerator.save_state
    def slow_save_state(self, output_dir=None, **kwargs):
        result = save_state(self, output_dir, **kwargs)
        if f"step-{pause_step:06d}" in str(output_dir):
            time.sleep(120)
        return result
    accelerate.Accelerator.save_state = slow_save_state
else:
    save_checkpoint = checkpoint.save_checkpoint
    def pausing_save(accelerator, output_dir, step, *args, **kwargs):
        path = save_checkpoint(accelerator, output_dir, step, *args, **kwargs)
        if step == pause_step:
            time.sleep(120)
        return path
    checkpoint.save_checkpoint = pausing_save
sys.exit(main(["train", *sys.argv[1:]]))
"""


def losses_by_step(run_dir: Path) -> dict[int, float]:
    """Per-step losses; a resumed run appends, so the last record of a step wins."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def entry(recipe: Path, *overrides: str) -> list[str]:
    return [sys.executable, str(ROOT / "scripts" / "finetune.py"), "--recipe", str(recipe), *overrides]


def start_and_kill_when(cmd: list[str], ready: Path, env: dict[str, str], timeout: float = 240) -> None:
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    while not ready.exists():
        assert proc.poll() is None, f"run ended before {ready} appeared: {proc.stderr.read().decode()[-2000:]}"
        assert time.monotonic() < deadline, f"{ready} never appeared"
        time.sleep(0.1)
    time.sleep(0.5)  # let the writer get well into whatever it is doing
    proc.kill()
    proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("precision,rtol", [("fp32", 1e-6), ("bf16", 1e-3)])
def test_sigkill_after_checkpoint_then_resume_reproduces_losses(tiny_recipe, tmp_path, precision, rtol):
    recipe = tiny_recipe(training__precision=precision, training__max_steps=8, checkpoint__every_n_steps=2)
    train(load_recipe(recipe, [f"output_dir={tmp_path / 'ref'}"]))  # uninterrupted, in this process
    reference = losses_by_step(tmp_path / "ref")

    run = tmp_path / "killed"
    entry_file = tmp_path / "pausing_entry.py"
    entry_file.write_text(PAUSING_ENTRY)
    cmd = [sys.executable, str(entry_file), "--recipe", str(recipe), f"output_dir={run}"]
    start_and_kill_when(cmd, run / "checkpoints" / "step-000004" / checkpoint.STATE_FILE, {"PAUSE_STEP": "4"})
    assert not (run / "final").exists()
    subprocess.run(entry(recipe, f"output_dir={run}", "checkpoint.resume=auto"), check=True, capture_output=True)

    resumed = losses_by_step(run)
    assert sorted(resumed) == list(range(1, 9))
    for step, loss in reference.items():
        assert resumed[step] == pytest.approx(loss, rel=rtol), step
    assert (run / "final" / "config.json").exists()


@pytest.mark.slow
def test_sigkill_during_checkpoint_write_leaves_previous_one_resumable(tiny_recipe, tmp_path):
    recipe = tiny_recipe(training__max_steps=6, checkpoint__every_n_steps=2)
    run = tmp_path / "run"
    entry_file = tmp_path / "pausing_entry.py"
    entry_file.write_text(PAUSING_ENTRY)
    cmd = [sys.executable, str(entry_file), "--recipe", str(recipe), f"output_dir={run}"]
    half_written = run / "checkpoints" / ".step-000004.tmp" / "model.safetensors"
    start_and_kill_when(cmd, half_written, {"PAUSE_STEP": "4", "PAUSE_IN_WRITE": "1"})

    assert [p.name for p in checkpoint.complete_checkpoints(run)] == ["step-000002"]
    assert checkpoint.resolve_resume(run, "auto").name == "step-000002"
    proc = subprocess.run(entry(recipe, f"output_dir={run}", "checkpoint.resume=auto"), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "resumed from" in proc.stderr and "step-000002" in proc.stderr
    assert [p.name for p in checkpoint.complete_checkpoints(run)] == ["step-000004", "step-000006"]
    assert not list((run / "checkpoints").glob(".*.tmp"))


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_75(tiny_recipe, tmp_path):
    recipe = tiny_recipe(training__max_steps=100_000)
    run = tmp_path / "run"
    proc = subprocess.Popen(entry(recipe, f"output_dir={run}"), stderr=subprocess.PIPE, text=True)
    metrics = run / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == EXIT_PREEMPTED
    (saved,) = checkpoint.complete_checkpoints(run)
    state = json.loads((saved / checkpoint.STATE_FILE).read_text())
    assert state["step"] == max(losses_by_step(run)) >= 3
    assert not (run / "final").exists()
    # The last thing it says is how to continue (the tiny recipe asks for resume=none: the command says to change it).
    last = proc.stderr.read().strip().splitlines()[-1]
    assert f"stopped at step {state['step']} of 100000" in last
    assert last.endswith("run the same command with checkpoint.resume=auto to continue")


def test_resume_seeks_to_the_saved_step_without_replaying_batches(tiny_recipe, monkeypatch):
    recipe = tiny_recipe(checkpoint__every_n_steps=2, checkpoint__keep_last=1)
    fit(build(load_recipe(recipe)))
    assert [p.name for p in checkpoint.complete_checkpoints(load_recipe(recipe).output_dir)] == ["step-000004"]

    requested: list[int] = []
    real = batches_module.batch_for_step

    def spy(data, *, step, **kwargs):
        requested.append(step)
        return real(data, step=step, **kwargs)

    monkeypatch.setattr(batches_module, "batch_for_step", spy)
    resumed = build(load_recipe(recipe, ["training.max_steps=6", "checkpoint.resume=auto"]))
    assert resumed.start_step == 4
    fit(resumed)
    assert requested == [4, 5]


def test_resume_with_changed_model_or_global_batch_is_refused(tiny_recipe, tmp_path, capsys):
    recipe = tiny_recipe(checkpoint__every_n_steps=2, checkpoint__resume="auto")
    assert main(["train", "--recipe", str(recipe)]) == 0
    code = main(
        [
            "train",
            "--recipe",
            str(recipe),
            "training.global_batch_size=16",
            "training.max_steps=6",
            "model.attn_implementation=eager",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "training.global_batch_size: 8 -> 16" in err and "model.attn_implementation: 'sdpa' -> 'eager'" in err
    # harmless changes (max_steps, logging) are allowed
    assert main(["train", "--recipe", str(recipe), "training.max_steps=6", "logging.every_n_steps=3"]) == 0


def nan_at(model: torch.nn.Module, calls: set[int]):
    """Forward hook that turns the loss of the given forward calls (0-based) into NaN."""
    count = {"n": 0}

    def hook(module, args, kwargs, output):
        n = count["n"]
        count["n"] += 1
        return output * float("nan") if n in calls else output

    return model.register_forward_hook(hook, with_kwargs=True)


def test_injected_nonfinite_loss_is_skipped_and_counted(tiny_recipe):
    run = build(load_recipe(tiny_recipe(training__micro_batch_size=8)))  # one forward per step
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    nan_at(run.model, {0})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = fit(run)
    # The first update was skipped: the learning rate still follows the step, and PyTorch has nothing to warn about
    # (a LambdaLR stepped past the skipped update warned "lr_scheduler.step() before optimizer.step()").
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    assert summary["skipped_steps"] == 1
    losses = losses_by_step(Path(run.recipe.output_dir))
    assert losses[1] != losses[1] and all(v == v for s, v in losses.items() if s > 1)  # NaN only at step 1
    records = [json.loads(line) for line in (Path(run.recipe.output_dir) / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in records if "loss" in r]
    assert lrs == pytest.approx([1e-3 * lr_factor(s, run.recipe) for s in range(4)])
    assert any(not torch.equal(before[k], v) for k, v in run.model.state_dict().items())


@pytest.mark.parametrize("clipping", [1.0, 0.0])
def test_a_nonfinite_gradient_with_a_finite_loss_is_skipped_not_stepped(tiny_recipe, clipping):
    """An overflow in backward gives inf/nan gradients under a finite loss: stepping them would put NaN in every
    weight (and in the next checkpoint, as the last good state). Clipping on or off, the norm is measured."""
    recipe = tiny_recipe(training__micro_batch_size=8, training__max_grad_norm=clipping)  # one backward a step
    run = build(load_recipe(recipe))
    calls = {"n": 0}

    def inf_at_step_2(grad: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return grad * float("inf") if calls["n"] == 2 else grad

    next(p for p in run.model.parameters() if p.requires_grad).register_hook(inf_at_step_2)
    summary = fit(run)
    assert summary["skipped_steps"] == 1
    losses = losses_by_step(Path(run.recipe.output_dir))
    assert sorted(losses) == [1, 2, 3, 4] and all(v == v for v in losses.values())  # finite losses, every step
    assert all(torch.isfinite(p).all() for p in run.model.parameters())


def test_a_run_of_nonfinite_losses_stops_cleanly_keeping_the_checkpoint(tiny_recipe):
    recipe = load_recipe(
        tiny_recipe(
            training__micro_batch_size=8,
            training__max_steps=10,
            checkpoint__every_n_steps=2,
            training__max_nonfinite_steps=3,
        )
    )
    run = build(recipe)
    nan_at(run.model, {4, 5, 6, 7, 8})
    with pytest.raises(TrainingError, match="step 7: 3 consecutive non-finite losses"):
        fit(run)
    assert [p.name for p in checkpoint.complete_checkpoints(recipe.output_dir)][-1] == "step-000004"


def test_a_fresh_start_refuses_to_overwrite_an_earlier_runs_checkpoints(tiny_recipe, capsys):
    recipe = tiny_recipe(checkpoint__every_n_steps=2)
    assert main(["train", "--recipe", str(recipe)]) == 0
    assert main(["train", "--recipe", str(recipe)]) == 2
    assert "already holds checkpoints of an earlier run" in capsys.readouterr().err


def test_a_resume_from_an_older_checkpoint_becomes_the_line_that_is_kept_and_resumed(tiny_recipe, tmp_path):
    """Checkpoints 2 and 4, then a resume from 2 that writes 3: keep_last prunes 2 (its own lineage) but not 4 (the
    abandoned branch, newer by step), and `resume: auto` continues 3, the newest written. A user's backup beside
    them (`step-000002.bak`) is no checkpoint: it is neither read, resumed nor pruned."""
    recipe = tiny_recipe(checkpoint__every_n_steps=2, checkpoint__keep_last=2)
    run = tmp_path / "run"
    train(load_recipe(recipe))
    root = checkpoint.checkpoints_root(run)
    assert [p.name for p in checkpoint.complete_checkpoints(run)] == ["step-000002", "step-000004"]
    shutil.copytree(root / "step-000002", root / "step-000002.bak")

    older = f"checkpoint.resume={root / 'step-000002'}"
    train(load_recipe(recipe, [older, "training.max_steps=3", "checkpoint.every_n_steps=1", "checkpoint.keep_last=1"]))
    assert sorted(p.name for p in root.iterdir()) == ["step-000002.bak", "step-000003", "step-000004"]
    assert [p.name for p in checkpoint.complete_checkpoints(run)] == ["step-000004", "step-000003"]
    assert checkpoint.resolve_resume(run, "auto").name == "step-000003"

    more = ["checkpoint.resume=auto", "training.max_steps=5", "checkpoint.every_n_steps=1", "checkpoint.keep_last=1"]
    resumed = build(load_recipe(recipe, more))
    assert resumed.start_step == 3
    fit(resumed)  # its step 4 replaces the abandoned one, then is pruned as its own
    assert sorted(p.name for p in root.iterdir()) == ["step-000002.bak", "step-000005"]


def test_resume_auto_skips_checkpoints_that_are_not_whole_and_says_why(tiny_recipe, tmp_path, caplog):
    """A checkpoint is whole when every file its manifest lists is there with its size: one that lost a process's
    RNG states, or was partly copied (a truncated weights file), is skipped for the newest sound one."""
    recipe = tiny_recipe(training__max_steps=6, checkpoint__every_n_steps=2, checkpoint__keep_last=3)
    run = tmp_path / "run"
    train(load_recipe(recipe))
    root = checkpoint.checkpoints_root(run)
    (root / "step-000006" / "random_states_0.pkl").unlink()
    weights = root / "step-000004" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])

    with pytest.raises(checkpoint.ResumeError, match="step-000006: not a whole .*random_states_0.pkl is missing"):
        build(load_recipe(recipe, [f"checkpoint.resume={root / 'step-000006'}"]))
    caplog.set_level("WARNING", logger="llmtune")
    # More steps than the finished run's 6: the same steps would be a complete run, left as it is.
    resumed = build(load_recipe(recipe, ["checkpoint.resume=auto", "training.max_steps=7"]))
    assert resumed.start_step == 2
    skipped = [r.getMessage() for r in caplog.records if "resume: skipping" in r.getMessage()]
    assert len(skipped) == 2
    assert "step-000006" in skipped[0] and "random_states_0.pkl is missing" in skipped[0]
    assert "step-000004" in skipped[1] and "model.safetensors has 1000 bytes" in skipped[1]
    fit(resumed)


def with_loss_scaler(run, init_scale: float) -> torch.amp.GradScaler:
    """fp16's dynamic loss scaling on a CPU. llmtune refuses fp16 there (Accelerate would train fp32 silently), so
    a real torch GradScaler is put where Accelerate keeps its own: on the accelerator (backward scales the loss) and in
    the prepared optimizer (its step unscales, skips an update with inf/nan gradients and halves the scale)."""
    from accelerate.optimizer import AcceleratedOptimizer

    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    run.accelerator.scaler = scaler
    run.optimizer = AcceleratedOptimizer(run.optimizer.optimizer, device_placement=False, scaler=scaler)
    return scaler


def overflow_in_steps(run, steps: set[int]) -> None:
    """inf gradients in the given 0-based steps (one backward a step)."""
    calls = {"n": 0}

    def hook(grad: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return grad * float("inf") if calls["n"] - 1 in steps else grad

    next(p for p in run.model.parameters() if p.requires_grad).register_hook(hook)


def test_fp16_that_overflows_every_step_stops_once_the_loss_scale_cannot_explain_it(tiny_recipe):
    """Under a loss scaler an overflow skips the update and halves the scale, so the step used to count as finite and
    a run that overflowed every step finished with exit 0 and an untrained final/. Skips at a scale above 1 are the
    scaler finding its level; from scale 1 down the gradients overflow unscaled, and max_nonfinite_steps stops it."""
    recipe = tiny_recipe(training__micro_batch_size=8, training__max_steps=10, training__max_nonfinite_steps=3)
    run = build(load_recipe(recipe))
    with_loss_scaler(run, init_scale=4.0)
    overflow_in_steps(run, set(range(10)))
    # Scales 4 and 2 skip as calibration; 1, 0.5 and 0.25 count: the third is step 5.
    with pytest.raises(TrainingError, match=r"step 5: 3 consecutive non-finite") as stopped:
        fit(run)
    assert "bf16 instead of fp16" in str(stopped.value)
    assert not (Path(run.recipe.output_dir) / "final").exists()


def test_fp16_overflows_while_the_scaler_finds_its_level_do_not_stop_a_run(tiny_recipe):
    recipe = tiny_recipe(training__micro_batch_size=8, training__max_steps=6, training__max_nonfinite_steps=3)
    run = build(load_recipe(recipe))
    scaler = with_loss_scaler(run, init_scale=2.0**16)
    overflow_in_steps(run, {0, 1, 2, 3})  # 4 in a row, more than max_nonfinite_steps, all at scales above 1
    summary = fit(run)
    assert summary["skipped_steps"] == 4 and scaler.get_scale() == 2.0**12


# Replaces DST by SRC with llmtune.files.replace_dir and is SIGKILLed right after its first rename (the atomic swap,
# or the fallback's move of the old folder aside).
KILLED_WHILE_REPLACING = """
import os, signal, sys
from pathlib import Path
import llmtune.files as files

def killed_after(real):
    def wrapped(*args):
        result = real(*args)
        os.kill(os.getpid(), signal.SIGKILL)
        return result
    return wrapped

os.replace = killed_after(os.replace)
if hasattr(files, "_exchange"):
    files._exchange = killed_after(files._exchange)
files.replace_dir(Path(sys.argv[1]), Path(sys.argv[2]))
"""


def test_a_process_killed_while_replacing_final_leaves_a_whole_final(tmp_path):
    """final/ names a whole folder at every instant: the fallback's two renames left none between them (the old one
    in .final.old, the new one in .final.tmp), so a run killed there lost its final/ until someone looked."""
    final, tmp = tmp_path / "final", tmp_path / ".final.tmp"
    for folder, text in ((final, "old"), (tmp, "new")):
        folder.mkdir()
        (folder / "model.safetensors").write_text(text)
    script = tmp_path / "replace.py"
    script.write_text(KILLED_WHILE_REPLACING)
    done = subprocess.run([sys.executable, str(script), str(tmp), str(final)], capture_output=True, timeout=60)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert (final / "model.safetensors").read_text() in ("old", "new")


def test_a_lora_resume_whose_adapters_do_not_match_is_refused(tiny_recipe, capsys):
    """A LoRA checkpoint holds only the adapters and loads non-strictly (no frozen base in it): an adapter whose name
    changed (a peft upgrade) used to resume as a fresh adapter under the old optimizer state, silently."""
    from safetensors.torch import load_file, save_file

    recipe = tiny_recipe(peft__method="lora", checkpoint__every_n_steps=2, checkpoint__resume="auto")
    assert main(["train", "--recipe", str(recipe)]) == 0
    saved = checkpoint.complete_checkpoints(recipe.parent / "run")[-1]
    weights = load_file(saved / "model.safetensors")
    renamed = next(k for k in weights if "lora_A" in k)
    weights[renamed.replace("lora_A", "lora_A_renamed")] = weights.pop(renamed)
    save_file(weights, saved / "model.safetensors")
    checkpoint.write_manifest(saved, [checkpoint.file_sizes(saved)])  # a sound checkpoint, another adapter setup
    capsys.readouterr()
    assert main(["train", "--recipe", str(recipe), "training.max_steps=6"]) == 2
    err = capsys.readouterr().err
    assert "not the ones this run trains" in err and renamed in err, err
