"""Out of memory in a one-process DeepSpeed run: the step cannot be redone in place, so the run stops resumably.

DeepSpeed accumulates a window's gradients in its own partitioned buffers and steps inside the window's last
backward; Accelerate's `zero_grad` on its optimizer wrapper is a no-op. A redone step then added the failed
window's partial gradients to its own: the update was not the one the step asked for.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest
from test_distributed import launch, losses

from llmtune.errors import EXIT_PREEMPTED
from llmtune.recipe import load_recipe
from llmtune.run.loop import train
from llmtune.run.resilience import OOM_FILE

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs `.[deepspeed]`"),
]

# Raises an out-of-memory error in the 10th backward: step 3's second micro-batch, after the first one's gradients
# went into DeepSpeed's buffers (and after the checkpoint of step 2).
OOM_IN_BACKWARD = """
import sys, torch
import llmtune.parallel.engines
from llmtune.cli.main import main

real, calls = llmtune.parallel.engines.backward, {"n": 0}
def failing(*args, **kwargs):
    calls["n"] += 1
    if calls["n"] == 10:
        raise torch.OutOfMemoryError("injected: CUDA out of memory")
    return real(*args, **kwargs)
llmtune.parallel.engines.backward = failing
sys.exit(main(["train", *sys.argv[1:]]))
"""


def test_one_process_deepspeed_out_of_memory_stops_then_resumes_with_the_same_updates(tiny_recipe, tmp_path):
    recipe = tiny_recipe(
        training__micro_batch_size=2,
        training__gradient_checkpointing=False,
        checkpoint__every_n_steps=2,
    )
    reference = train(load_recipe(recipe, [f"output_dir={tmp_path / 'reference'}"]))  # one process, no DeepSpeed
    assert reference["steps"] == 4
    entry = tmp_path / "oom_entry.py"
    entry.write_text(OOM_IN_BACKWARD)
    run = tmp_path / "run"
    zero2 = ROOT / "recipes" / "accelerate" / "deepspeed_zero2.yaml"
    cmd = launch(recipe, f"output_dir={run}", processes=1, config=zero2, script=entry)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=os.environ)
    assert f"exitcode  : {EXIT_PREEMPTED}" in proc.stderr or proc.returncode == EXIT_PREEMPTED, proc.stderr[-4000:]
    assert "process 0: out of memory in the forward/backward at micro-batch 2" in proc.stderr
    assert json.loads((run / OOM_FILE).read_text())["micro_batch_size"] == 1
    assert max(losses(run)) == 2 and not (run / "final").exists()
    # The same command continues from step 2 with micro-batch 1: every update is the one a run without the error made.
    cmd = launch(recipe, f"output_dir={run}", "checkpoint.resume=auto", processes=1, config=zero2)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((run / "run_summary.json").read_text())
    assert (summary["engine"], summary["micro_batch_size"], summary["grad_accum_steps"]) == ("zero2", 1, 8)
    want = losses(tmp_path / "reference")
    assert losses(run) == pytest.approx(want, abs=1e-4)
