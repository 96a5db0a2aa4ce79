"""The fault-injection suite's most important rows (`benchmarks/faults.py`), each through the real entry point and
the suite's own checks: every file there before the fault is still there with the same bytes, and the next
`resume: auto` run resumes the newest sound checkpoint and finishes."""

from __future__ import annotations

import signal

import pytest

from benchmarks.faults import (
    Suite,
    final_whole,
    finished_run,
    no_final_and_checkpoint,
    stopped_at_4_unlocked,
    two_launches,
)

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


@pytest.fixture(scope="module")
def suite(tmp_path_factory) -> Suite:
    return Suite(tmp_path_factory.mktemp("faults"))


def test_sigkill_mid_save_keeps_the_previous_checkpoint_and_resumes_it(suite):
    row = suite.train_fault(
        "sigkill",
        "mid-save",
        "mid-save:sigkill:2",
        want_code=-signal.SIGKILL,
        expect=no_final_and_checkpoint("step-000002"),
    )
    assert row.ok and row.resumed_from == "step-000002", row.notes


def test_a_full_disk_mid_save_stops_in_one_line_keeping_the_previous_checkpoint(suite):
    row = suite.train_fault(
        "disk full", "mid-save", "mid-save:enospc:2", want_code=1, expect=no_final_and_checkpoint("step-000002")
    )
    assert row.ok and row.resumed_from == "step-000002", row.notes
    assert row.message.startswith("llmtune: training stopped:") and "step-000004" in row.message, row.message


def test_sigterm_during_a_slow_first_checkpoint_lets_it_finish_then_stops_with_it(suite):
    """The save outlasts the watchdog's grace (1 s here): it used to exit 75 mid-save, losing the checkpoint."""
    row = suite.train_fault(
        "sigterm", "mid-save", "mid-save:slow-sigterm:1", want_code=75, expect=no_final_and_checkpoint("step-000002")
    )
    assert row.ok and row.resumed_from == "step-000002", row.notes


def test_sigterm_during_the_final_save_of_a_run_without_checkpoints_writes_final_whole(suite):
    """Without checkpoints the final save is all a run has; SIGTERM used to cut it (the handler was gone): exit -15,
    nothing on disk. The run is done: the same command again says so and leaves it (exit 0)."""
    row = suite.train_fault(
        "sigterm",
        "final save",
        "final-save:slow-sigterm",
        want_code=0,
        expect=final_whole,
        then=finished_run,
        checkpoint__every_n_steps=0,
    )
    assert row.ok, row.notes


def test_a_second_launch_on_a_running_folder_is_refused_and_the_first_runs_checkpoint_resumes(suite):
    row = two_launches(suite)
    assert row.ok and row.exit_code == 2 and row.resumed_from == "step-000002", row.notes


def test_a_process_the_launcher_stops_after_its_checkpoint_does_not_leave_the_lock(suite):
    """2 processes stop on SIGTERM; process 0 is slow to leave (2 s) and the launcher, seeing process 1 exit 75,
    SIGTERMs it meanwhile: it used to die holding output_dir's lock, which refuses a requeue on another host."""
    row = suite.train_fault(
        "sigterm",
        "mid-step, 2 processes, process 0 slow to exit",
        "mid-step:sigterm-slow-exit:4",
        want_code=75,
        processes=2,
        expect=stopped_at_4_unlocked,
    )
    assert row.ok and row.resumed_from == "step-000004", row.notes
