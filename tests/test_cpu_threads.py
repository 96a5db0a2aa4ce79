"""How a run on a CPU chooses its threads (llmtune.run.launch.cpu_threads), says so in its setup log, and names a busy
host before the plan when it runs far below its forecast (llmtune.run.summary.slow_cause). The host's load is given,
never read: the verdicts do not depend on this machine."""

import logging

import pytest
import torch

from llmtune.cli.main import main
from llmtune.run.launch import cpu_threads
from llmtune.run.summary import slow_cause


@pytest.mark.parametrize(
    ("cores", "load", "processes", "threads"),
    [
        (2, 0.1, 1, 2),  # an idle host: a thread per core
        (2, 1.2, 1, 1),  # another process keeps a core busy: the other core alone, no thread spin-waiting for it
        (2, 5.0, 1, 1),  # never fewer than one
        (16, 3.0, 2, 8),  # two processes on a host share its cores; 13 free cores leave each its half
        (16, 12.0, 2, 4),  # ... and fewer where others hold most of them
    ],
)
def test_threads_are_this_processes_share_of_the_free_cores(cores, load, processes, threads):
    assert cpu_threads(None, cores, load, processes)[0] == threads


def test_omp_num_threads_chooses_when_set():
    assert cpu_threads("3", cores=16, load=0.0, processes_here=1) == (None, "OMP_NUM_THREADS=3")


def test_the_setup_log_says_how_many_threads_and_why(tiny_recipe, monkeypatch, caplog):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.getloadavg", lambda: (1.5, 1.0, 1.0))
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    before = torch.get_num_threads()
    caplog.set_level(logging.INFO, logger="llmtune")
    try:
        assert main(["train", "--recipe", str(tiny_recipe(training__max_steps=1))]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU threads:")]
    assert line.startswith("CPU threads: 1 (2 cores, 1 process(es) on this host, load average 1.5: the other 1 core")


def test_a_slow_run_on_a_busy_cpu_names_the_load_before_the_plan():
    assert slow_cause("cpu", load=3.2, cores=2).startswith("the host is busy (load average 3.2 on 2 cores)")
    for device, load in (("cpu", 1.9), ("cuda", 9.0)):
        assert slow_cause(device, load=load, cores=2).startswith("the plan may not be the fastest here")
