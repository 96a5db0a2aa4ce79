"""Real multi-process runs: 2 CPU processes with gloo through `accelerate launch --multi_gpu`.

`--cpu --num_processes 2` would silently start ONE process (platform notes), so each test checks the
process count the run reports instead of trusting the flag.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmtune.errors import EXIT_PREEMPTED
from llmtune.run import checkpoint
from llmtune.run.rundir import LOCK_FILE

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    recipe: Path, *overrides: str, processes: int = 2, config: Path | None = None, script: Path | None = None
) -> list[str]:
    accelerate = Path(sys.executable).with_name("accelerate")
    topology = ["--config_file", str(config)] if config else ["--multi_gpu", "--num_machines", "1"]
    return [
        str(accelerate),
        "launch",
        *topology,
        "--num_processes",
        str(processes),
        "--main_process_port",
        str(free_port()),
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(script or ROOT / "scripts" / "finetune.py"),
        "--recipe",
        str(recipe),
        *overrides,
    ]


# The tail of an entry script that trains several runs in one launch. Its arguments are finetune.py's (`--recipe R
# key=value ...`) for each run in turn, split by "+". The launcher and the imports (~7 s of a launch) are paid once;
# the runs after the first share the process group, as a sweep in one allocation does. An entry may define
# `after_run(recipe)` to write what it recorded during a run into that run's folder.
RUNS = """
import sys
from llmtune.cli.main import build_parser, end_process_group, setup_logging
from llmtune.recipe import load_recipe
from llmtune.run.loop import train
setup_logging()
groups = [[]]
for arg in sys.argv[1:]:
    groups.append([]) if arg == "+" else groups[-1].append(arg)
for group in groups:
    args = build_parser().parse_args(["train", *group])
    recipe = load_recipe(args.recipe, args.overrides)
    train(recipe)
    if "after_run" in globals():
        after_run(recipe)
end_process_group()
"""


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def worker_pids(marker: str) -> list[int]:
    """PIDs of the training workers (not the launcher) whose command line contains `marker`."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        is_worker = any(a.endswith(b"finetune.py") for a in argv) and b"launch" not in argv
        if is_worker and marker.encode() in b" ".join(argv):
            pids.append(int(proc.name))
    return pids


def test_sigterm_to_one_process_checkpoints_both_and_exits(tiny_recipe, tmp_path):
    recipe = tiny_recipe(training__micro_batch_size=2, training__max_steps=100_000)
    run = tmp_path / "run"
    launcher = subprocess.Popen(
        launch(recipe, f"output_dir={run}"), stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        metrics = run / "metrics.jsonl"
        deadline = time.monotonic() + 180
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert launcher.poll() is None, launcher.stderr.read()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.2)
        workers = worker_pids(str(run))
        assert len(workers) == 2
        os.kill(max(workers), signal.SIGTERM)  # the non-main rank, most likely; either must work
        launcher.wait(timeout=180)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)  # launcher and workers, whatever happened
    err = launcher.stderr.read()
    assert f"exitcode  : {EXIT_PREEMPTED}" in err, err[-3000:]
    (saved,) = checkpoint.complete_checkpoints(run)
    assert {p.name for p in saved.glob("random_states_*.pkl")} == {"random_states_0.pkl", "random_states_1.pkl"}
    # The manifest (written by the main process) lists the other process's files too: losing one makes it unsound.
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= set(
        json.loads((saved / checkpoint.MANIFEST_FILE).read_text())["files"]
    )
    assert not (run / LOCK_FILE).exists()  # the main process's lock, released on the way out
    assert json.loads((saved / checkpoint.STATE_FILE).read_text())["step"] == max(losses(run))


# Process 1 stops for good in its third step (after writing $HUNG): process 0 then waits in that step's all-reduce,
# where Python never runs a signal handler. A grace of 2 s instead of a minute.
HANGING_ENTRY = """
import os, sys, time
from pathlib import Path
import llmtune.run.preemption, llmtune.run.loop
from llmtune.cli.main import main
llmtune.run.preemption.SIGNAL_GRACE_S = 2.0
train_step, calls = llmtune.run.loop.train_step, []
def hanging_step(run, examples):
    calls.append(1)
    if os.environ["RANK"] == "1" and len(calls) == 3:
        Path(os.environ["HUNG"]).write_text("")
        time.sleep(3600)
    return train_step(run, examples)
llmtune.run.loop.train_step = hanging_step
sys.exit(main(["train", *sys.argv[1:]]))
"""


def test_a_run_stuck_in_a_collective_ends_on_sigterm_keeping_the_last_checkpoint(tiny_recipe, tmp_path):
    """SIGTERM ends both processes of a stuck run within the grace, not at a SIGKILL that a scheduler may never
    send (it used to leave them holding the devices); the launcher says 75, the last checkpoint is kept."""
    recipe = tiny_recipe(training__micro_batch_size=2, training__max_steps=100, checkpoint__every_n_steps=1)
    entry, run, hung = tmp_path / "hung_finetune.py", tmp_path / "run", tmp_path / "hung"
    entry.write_text(HANGING_ENTRY)
    launcher = subprocess.Popen(
        launch(recipe, f"output_dir={run}", script=entry),
        env={**os.environ, "HUNG": str(hung)},
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while not hung.exists():
            assert launcher.poll() is None, launcher.stderr.read()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.2)
        time.sleep(1)  # process 0 is in the all-reduce by now
        workers = worker_pids(str(run))
        assert len(workers) == 2
        for pid in workers:
            os.kill(pid, signal.SIGTERM)
        launcher.wait(timeout=120)  # a hang guard: without the watchdog, nothing ends them
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
    err = launcher.stderr.read()
    assert f"exitcode  : {EXIT_PREEMPTED}" in err and "no step boundary 2 s after the signal" in err, err[-3000:]
    assert checkpoint.complete_checkpoints(run)[-1].name == "step-000002"
    assert not (run / LOCK_FILE).exists()  # released before the watchdog's exit: a requeue elsewhere is not refused


def test_a_collective_left_waiting_past_distributed_timeout_fails_the_run(tiny_recipe, tmp_path):
    """Process 1 stops answering in its third step: process 0's collective gives up after `distributed.timeout` (3 s
    here) and the launch fails, where torch's own gloo default waits 30 minutes (the subprocess limit below)."""
    recipe = tiny_recipe(training__micro_batch_size=2, training__max_steps=100, distributed__timeout=3)
    entry, run, hung = tmp_path / "hung_finetune.py", tmp_path / "run", tmp_path / "hung"
    entry.write_text(HANGING_ENTRY)
    done = subprocess.run(
        launch(recipe, f"output_dir={run}", script=entry),
        env={**os.environ, "HUNG": str(hung)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert hung.exists() and done.returncode != 0
    assert "Timed out" in done.stderr or "timeout" in done.stderr.lower(), done.stderr[-3000:]


@pytest.mark.parametrize("config", sorted((ROOT / "recipes" / "accelerate").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_launcher_configs_parse(config):
    from accelerate.commands.config.config_args import ClusterConfig

    cluster = ClusterConfig.from_yaml_file(str(config))
    assert cluster.mixed_precision == "no"  # precision belongs to the recipe


def test_deepspeed_launch_is_refused_clearly_without_deepspeed(tiny_recipe):
    pytest.importorskip("accelerate")
    if importlib.util.find_spec("deepspeed") is not None:
        pytest.skip("DeepSpeed is installed here")
    proc = subprocess.run(
        launch(tiny_recipe(), config=ROOT / "recipes" / "accelerate" / "deepspeed_zero2.yaml"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "DeepSpeed is not installed" in proc.stderr
