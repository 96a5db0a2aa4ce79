"""A run's output_dir: a second run never destroys the first, `~` is expanded, and one run at a time holds it
(llmtune.run.rundir) -- through the real entry point, with real runs and a real second process."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_resilience import PAUSING_ENTRY

from llmtune.cli.main import main
from llmtune.recipe import load_recipe
from llmtune.run import checkpoint, rundir
from llmtune.run.rundir import LOCK_FILE, OutputDirError, take_lock


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
        assert (holder["pid"], holder["host"], holder["lease_s"]) == (first.pid, socket.gethostname(), rundir.LEASE_S)

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


# ---------------------------------------------------------------- the lock: a lease, a job's own, taken over once

JOBS = ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


@pytest.fixture
def no_job(monkeypatch):
    """This test's process is no scheduler's job unless the test says so (CI may run under SLURM)."""
    for name in JOBS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def plant(out: Path, renewed_ago: float = 0.0, **holder) -> Path:
    """A lock another launch wrote, last renewed `renewed_ago` seconds ago (its mtime set back: no waiting)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_FILE
    path.write_text(json.dumps(holder) + "\n")
    then = time.time() - renewed_ago
    os.utime(path, (then, then))
    return path


ELSEWHERE = {"pid": 4242, "host": "elsewhere-node-7", "job": None, "attempt": [0, 0], "lease_s": 300.0}


def mine(path: Path) -> bool:
    return json.loads(path.read_text())["pid"] == os.getpid()


def test_a_lock_from_another_host_is_taken_over_once_its_lease_expired_and_refused_while_renewed(
    tmp_path, no_job, caplog
):
    """A run that died on another host (SIGKILL after a peer's death, a lost node) used to leave a lock that refused
    every requeue there for good; now its lease runs out and the next launch takes it over."""
    out = tmp_path / "run"
    plant(out, renewed_ago=10, **ELSEWHERE)
    with pytest.raises(OutputDirError) as refused:
        take_lock(out)
    said = str(refused.value)
    assert "pid 4242 on host elsewhere-node-7" in said and "renews it every 30 s, last 10 s ago" in said
    assert "expires at" in said and "300 s after its last renewal" in said and "requeue of the same job" in said

    path = plant(out, renewed_ago=3600, **ELSEWHERE)
    caplog.set_level(logging.WARNING)
    lock = take_lock(out)
    try:
        assert mine(path) and "not renewed for 3600 s" in caplog.text
    finally:
        lock.release()
    assert not path.exists()

    # An older llmtune's lock has no lease: never expired, the way out named.
    plant(out, renewed_ago=3600, pid=4242, host="elsewhere-node-7")
    with pytest.raises(OutputDirError, match="if that process is gone, delete"):
        take_lock(out)


@pytest.mark.parametrize(
    ("env", "job"),
    [
        ({"SLURM_JOB_ID": "77"}, "slurm:77"),
        ({"SLURM_JOB_ID": "77", "TORCHELASTIC_RUN_ID": "abc"}, "slurm:77"),
        ({"TORCHELASTIC_RUN_ID": "abc"}, "torchelastic:abc"),
    ],
)
def test_a_later_attempt_of_the_same_job_takes_its_lock_over_from_any_host_at_once(tmp_path, no_job, env, job):
    """A SLURM requeue (SLURM_RESTART_COUNT) or a torch elastic restart (TORCHELASTIC_RESTART_COUNT) of the job that
    holds the lock, on whatever host, takes it over although its lease is fresh: the earlier attempt is over. The
    same attempt does not: two job steps of one allocation on one folder are two runs."""
    out = tmp_path / "run"
    for name, value in env.items():
        no_job.setenv(name, value)
    path = plant(out, **{**ELSEWHERE, "job": job})
    with pytest.raises(OutputDirError, match=f"another run is using it .*\\({job.replace(':', ' job ')}\\)"):
        take_lock(out)
    no_job.setenv("SLURM_RESTART_COUNT" if job.startswith("slurm") else "TORCHELASTIC_RESTART_COUNT", "1")
    lock = take_lock(out)
    try:
        assert mine(path) and json.loads(path.read_text())["job"] == job
    finally:
        lock.release()
    plant(out, **{**ELSEWHERE, "job": "slurm:78"})  # another job's lock, however late this attempt
    with pytest.raises(OutputDirError):
        take_lock(out)


def test_the_job_of_a_launch():
    assert rundir.job_of({}) == (None, [0, 0])
    elastic = {"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "2"}
    assert rundir.job_of(elastic) == (None, [0, 2])  # torchrun's default id names no run
    requeued = {"SLURM_JOB_ID": "5", "SLURM_RESTART_COUNT": "1", "TORCHELASTIC_RESTART_COUNT": "0"}
    assert rundir.job_of(requeued) == ("slurm:5", [1, 0])


def test_the_holder_renews_its_lease_and_leaves_alone_a_lock_no_longer_its_own(tmp_path, no_job, caplog):
    out = tmp_path / "run"
    before = set(threading.enumerate())  # locks of runs built but not fitted earlier in this process renew too
    lock = take_lock(out)
    path = out / LOCK_FILE
    beat = [t for t in set(threading.enumerate()) - before if t.name == "llmtune-lock"]
    try:
        assert len(beat) == 1 and beat[0].is_alive()  # renews every RENEW_S, until released
        os.utime(path, (1.0, 1.0))
        lock.renew()
        assert path.stat().st_mtime > 1.0

        path.write_text(json.dumps(ELSEWHERE) + "\n")  # taken over (its lease misjudged) or replaced by hand
        os.utime(path, (1.0, 1.0))
        lock.renew()
        assert path.stat().st_mtime == 1.0 and "no longer this run's" in caplog.text
    finally:
        lock.release()
    beat[0].join(timeout=30)
    assert not beat[0].is_alive()
    assert json.loads(path.read_text()) == ELSEWHERE  # not removed: not this run's


def test_two_launches_taking_over_one_stale_lock_do_not_both_win(tmp_path, no_job, monkeypatch):
    """Launch A judges the lock of a dead process stale; before A replaces it, launch B judges it the same, takes it
    over and starts. A used to move B's fresh lock aside and take it too: both ran in one folder."""
    out = tmp_path / "run"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    path = plant(out, pid=gone.pid, host=socket.gethostname())
    held: list[rundir.RunLock] = []
    outcomes: list[str] = []

    def launch() -> str:
        try:
            held.append(take_lock(out))
        except OutputDirError:
            return "refused"
        return "won"

    other = {"pid": os.getppid(), "host": socket.gethostname(), "job": None, "attempt": [0, 0], "lease_s": 300.0}
    judge = rundir._stale

    def interleaved(*args):
        verdict = judge(*args)
        if not outcomes:  # A has judged; B's whole launch runs now, before A moves the lock
            outcomes.append("B judging")
            with monkeypatch.context() as m:
                m.setattr(rundir, "_me", lambda: {**other, "since": 1.0}, raising=False)  # another live process
                outcomes[0] = launch()
        return verdict

    monkeypatch.setattr(rundir, "_stale", interleaved)
    try:
        outcomes.append(launch())
        assert outcomes == ["won", "refused"]  # B won; A, finding the lock changed since it judged it, refused
        assert json.loads(path.read_text())["pid"] == os.getppid()
        assert not [p.name for p in out.iterdir() if p.name != LOCK_FILE]  # no claim or temporary left
    finally:
        for lock in held:
            lock.release()


def test_a_launch_that_finds_another_taking_over_the_lock_is_refused(tmp_path, no_job):
    out = tmp_path / "run"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    path = plant(out, pid=gone.pid, host=socket.gethostname())
    claim = path.with_name(f"{LOCK_FILE}.takeover-{hashlib.sha256(path.read_bytes()).hexdigest()[:16]}")
    claim.touch()  # another launch holds the right to replace this lock
    with pytest.raises(OutputDirError, match="another launch is taking over its stale lock"):
        take_lock(out)
    claim.unlink()
    lock = take_lock(out)
    lock.release()


def test_the_same_command_on_a_complete_run_leaves_it_and_more_steps_continue_it(tiny_recipe, tmp_path, capsys):
    """resume=auto (the shipped recipes' setting) on a run that finished: said, exit 0, every file as it was; a recipe
    asking for more steps trains on from the newest checkpoint."""
    recipe = tiny_recipe(checkpoint__resume="auto", training__max_steps=2, checkpoint__every_n_steps=2)
    run = tmp_path / "run"
    assert main(["train", "--recipe", str(recipe)]) == 0
    before = snapshot(run)
    capsys.readouterr()
    assert main(["train", "--recipe", str(recipe)]) == 0
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("llmtune:")]
    assert line.startswith(f"llmtune: nothing to do: {run} holds a complete run (2 steps, final/ written)")
    assert snapshot(run) == before
    assert main(["train", "--recipe", str(recipe), "training.max_steps=3"]) == 0
    assert json.loads((run / "run_summary.json").read_text())["steps"] == 3
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()][-1] == 3
