"""A run's output_dir: a second run never destroys the first, `~` is expanded, and one run at a time holds it
(llmtune.run.rundir) -- through the real entry point, with real runs and a real second process."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from test_resilience import PAUSING_ENTRY

from llmtune.cli.main import main
from llmtune.recipe import load_recipe
from llmtune.run import checkpoint
from llmtune.run.rundir import LOCK_FILE


def snapshot(run: Path) -> dict[str, bytes]:
    """Every file of a run folder and its bytes."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def one_error(err: str) -> str:
    (line,) = [line for line in err.splitlines() if line.startswith("llmtune: error:")]
    assert "Traceback" not in err
    return line


def test_a_finished_run_is_not_replaced_by_a_new_one_unless_overwrite(tiny_recipe, tmp_path, capsys):
    recipe = tiny_recipe()  # checkpoint.every_n_steps 0 (the default): no checkpoint guards the first run
    run = tmp_path / "run"
    assert main(["train", "--recipe", str(recipe)]) == 0
    first = snapshot(run)
    assert "final/config.json" in first
    capsys.readouterr()

    assert main(["train", "--recipe", str(recipe), "training.max_steps=2"]) == 2
    line = one_error(capsys.readouterr().err)
    assert str(run) in line and "finished run" in line and "overwrite=true" in line
    assert snapshot(run) == first  # recipe.yaml, metrics.jsonl and final/ untouched

    assert main(["train", "--recipe", str(recipe), "training.max_steps=2", "overwrite=true"]) == 0
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    assert not (run / LOCK_FILE).exists()


def test_a_folder_of_other_files_is_refused_and_left_alone(tiny_recipe, tmp_path, capsys):
    """`output_dir: .` in a project folder: its files (a user's recipe.yaml among them) are not a run's."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "recipe.yaml").write_text("my own recipe\n")
    (project / "notes.txt").write_text("keep me\n")
    before = snapshot(project)
    assert main(["train", "--recipe", str(tiny_recipe()), f"output_dir={project}"]) == 2
    line = one_error(capsys.readouterr().err)
    assert str(project) in line and "recipe.yaml" in line and "notes.txt" in line and "overwrite" in line
    assert snapshot(project) == before


def test_tilde_in_output_dir_is_the_home_folder(tiny_recipe, tmp_path, monkeypatch):
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    recipe = tiny_recipe(output_dir="~/runs/x", training__max_steps=1)
    assert load_recipe(recipe).output_dir == str(home / "runs" / "x")
    assert main(["train", "--recipe", str(recipe)]) == 0
    assert (home / "runs" / "x" / "final" / "config.json").is_file()
    assert not (work / "~").exists()


def test_a_run_refused_before_it_wrote_leaves_no_folder_nor_lock(tiny_recipe, tmp_path, capsys):
    """The lock is taken before the data and model load; a refusal there leaves the folder as it found it."""
    run = tmp_path / "deep" / "run"
    bad = ["model.name_or_path=./no-such-model", f"output_dir={run}"]
    assert main(["train", "--recipe", str(tiny_recipe()), *bad]) == 2
    assert not (tmp_path / "deep").exists()


def test_a_second_launch_on_a_running_folder_fails_at_once_and_a_dead_runs_lock_is_taken_over(
    tiny_recipe, tmp_path, capsys, caplog
):
    recipe = tiny_recipe(training__max_steps=6, checkpoint__every_n_steps=2, checkpoint__resume="auto")
    run = tmp_path / "run"
    entry_file = tmp_path / "pausing_entry.py"
    entry_file.write_text(PAUSING_ENTRY)  # sleeps after its checkpoint of step 2: a run still going on
    first = subprocess.Popen(
        [sys.executable, str(entry_file), "--recipe", str(recipe)],
        env={**os.environ, "PAUSE_STEP": "2"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        ready = run / "checkpoints" / "step-000002" / checkpoint.STATE_FILE
        deadline = time.monotonic() + 240
        while not ready.exists():
            assert first.poll() is None, first.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        holder = json.loads((run / LOCK_FILE).read_text())
        assert holder == {"pid": first.pid, "host": socket.gethostname()}

        started = time.monotonic()
        assert main(["train", "--recipe", str(recipe)]) == 2  # would resume step 2 beside the live run
        line = one_error(capsys.readouterr().err)
        assert f"pid {first.pid} on host {socket.gethostname()}" in line and str(run) in line
        assert time.monotonic() - started < 30  # at once: before any model or data loads
        assert first.poll() is None
    finally:
        first.kill()
        first.wait()

    # SIGKILL left its lock behind; the process is gone, so the next launch takes it over and resumes.
    assert (run / LOCK_FILE).exists()
    caplog.set_level(logging.INFO)
    assert main(["train", "--recipe", str(recipe)]) == 0
    assert "taking over the lock" in caplog.text and "resumed from" in caplog.text
    assert (run / "final" / "config.json").is_file() and not (run / LOCK_FILE).exists()
