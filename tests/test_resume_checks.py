"""What a resume checks before anything loads, through the real entry point: who wrote the checkpoint, and whether
this launch and recipe can continue it (the plan is made again where the split of the batch changed, a change that
makes another run is refused with a way out that works)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from test_distributed import launch

from llmtune.cli.main import main
from llmtune.run import checkpoint


def one_error(err: str) -> str:
    (line,) = [line for line in err.splitlines() if line.startswith("llmtune: error:")]
    assert "Traceback" not in err
    return line


@pytest.fixture
def stopped_at_2(tiny_recipe, tmp_path, capsys):
    """A run of 4 steps, ended after its checkpoint of step 2 (max_steps 2, then resumed with 4)."""
    recipe = tiny_recipe(checkpoint__every_n_steps=2, checkpoint__resume="auto")
    assert main(["train", "--recipe", str(recipe), "training.max_steps=2"]) == 0
    capsys.readouterr()
    return recipe


def summary(run) -> dict:
    return json.loads((run / "run_summary.json").read_text())


def test_a_checkpoint_another_user_wrote_is_resumed_only_when_trusted(stopped_at_2, tmp_path, capsys, caplog):
    (saved,) = checkpoint.complete_checkpoints(tmp_path / "run")
    manifest = saved / checkpoint.MANIFEST_FILE
    record = json.loads(manifest.read_text())
    assert record["writer"]["uid"] == os.getuid()
    record["writer"]["uid"] = os.getuid() + 1
    manifest.write_text(json.dumps(record))
    assert checkpoint.unsound(saved) is None  # sound: only its writer is another

    assert main(["train", "--recipe", str(stopped_at_2)]) == 2
    line = one_error(capsys.readouterr().err)
    assert f"uid {os.getuid() + 1}" in line and "checkpoint.trust=true" in line and str(saved) in line
    assert main(["train", "--recipe", str(stopped_at_2), "checkpoint.trust=true"]) == 0
    assert summary(tmp_path / "run")["steps"] == 4


def test_a_changed_micro_batch_is_applied_on_resume_with_the_global_batch_kept(stopped_at_2, tmp_path, caplog):
    caplog.set_level("INFO")
    assert main(["train", "--recipe", str(stopped_at_2), "training.micro_batch_size=2"]) == 0
    assert "resumed from" in caplog.text and "planned again (training.micro_batch_size)" in caplog.text
    got = summary(tmp_path / "run")
    assert (got["micro_batch_size"], got["grad_accum_steps"]) == (2, 4)


def test_a_refused_resume_names_a_way_out_that_works(stopped_at_2, tmp_path, capsys):
    assert main(["train", "--recipe", str(stopped_at_2), "seed=1"]) == 2
    err = capsys.readouterr().err
    assert "seed: 0 -> 1" in err and "Traceback" not in err
    way_out = err.split("start over in this one: ")[1].split(" (")[0].split()
    assert way_out == ["checkpoint.resume=none", "overwrite=true"]
    assert main(["train", "--recipe", str(stopped_at_2), "seed=1", *way_out]) == 0


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_one_process_checkpoint_resumes_under_two_ddp_processes_keeping_the_global_batch(stopped_at_2, tmp_path):
    done = subprocess.run(launch(stopped_at_2), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "planned again (1 -> 2 processes)" in done.stderr
    got = summary(tmp_path / "run")
    assert (got["num_processes"], got["micro_batch_size"], got["grad_accum_steps"]) == (2, 4, 1)
