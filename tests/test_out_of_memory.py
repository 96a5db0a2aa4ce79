"""Out of memory outside a training step's forward and backward (GRPO's generation, DPO's reference log-probs, the
final gather): one line, exit 75 with the smaller batch the same command resumes with in out_of_memory.json, or
exit 1 where nothing smaller helps -- never a traceback. The real entry point, in a process of its own: the stop is
an `os._exit`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_grpo import REWARDS, write_prompts
from test_preference import preference_recipe, write_pairs

from llmtune.errors import EXIT_PREEMPTED
from llmtune.run.resilience import OOM_FILE

pytestmark = pytest.mark.slow

# Raises torch.OutOfMemoryError at the first call of OOM_AT (`module:attribute`, or `module:Class.method`).
OOM_ENTRY = """
import importlib, os, sys, torch
from llmtune.cli.main import main

module, name = os.environ["OOM_AT"].split(":")
owner = importlib.import_module(module)
*path, attribute = name.split(".")
for part in path:
    owner = getattr(owner, part)
real = getattr(owner, attribute)
def failing(*args, **kwargs):
    raise torch.OutOfMemoryError("injected: CUDA out of memory")
setattr(owner, attribute, failing)
sys.exit(main(["train", *sys.argv[1:]]))
"""


def run_entry(tmp_path: Path, recipe: Path, *overrides: str, oom_at: str = "none:none", **env: str):
    entry = tmp_path / "oom_entry.py"
    entry.write_text(OOM_ENTRY if oom_at != "none:none" else "import sys\nfrom llmtune.cli.main import main\n"
                     "sys.exit(main(['train', *sys.argv[1:]]))\n")  # fmt: skip
    cmd = [sys.executable, str(entry), "--recipe", str(recipe), *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OOM_AT": oom_at, **env})


def error_lines(err: str) -> list[str]:
    assert "Traceback" not in err, err[-3000:]
    return [line for line in err.splitlines() if " ERROR " in line or line.startswith("llmtune:")]


def test_dpo_reference_out_of_memory_stops_and_the_same_command_resumes_with_half_the_micro_batch(
    tiny_recipe, tmp_path
):
    pairs = write_pairs(tmp_path / "pairs.jsonl")
    recipe = preference_recipe(tiny_recipe, pairs, "dpo", training__max_steps=2, checkpoint__resume="auto")
    run = tmp_path / "run"
    done = run_entry(tmp_path, recipe, oom_at="llmtune.objectives.pair_losses:compute_reference")
    assert done.returncode == EXIT_PREEMPTED, done.stderr[-3000:]
    (line,) = error_lines(done.stderr)
    assert "out of memory in the reference log-probs at micro-batch 4" in line and "micro-batch 2" in line
    assert json.loads((run / OOM_FILE).read_text())["micro_batch_size"] == 2
    done = run_entry(tmp_path, recipe)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((run / "run_summary.json").read_text())["micro_batch_size"] == 2


def test_grpo_generation_out_of_memory_stops_and_the_same_command_generates_fewer_rows_a_call(tmp_path, tiny_model_dir):
    from conftest import write_recipe

    (tmp_path / "grpo_rewards.py").write_text(REWARDS)
    data = write_prompts(tmp_path / "prompts.jsonl")
    recipe = write_recipe(
        tmp_path / "recipe.yaml",
        tiny_model_dir,
        data,
        data__train=[{"path": str(data), "format": "prompt", "fields": {"prompt": "question"}}],
        data__max_length=16,
        training__objective="grpo",
        training__gradient_checkpointing=False,
        training__micro_batch_size=8,
        training__global_batch_size=16,
        training__max_steps=2,
        checkpoint__resume="auto",
        grpo={"num_generations": 4, "max_new_tokens": 6, "rewards": [{"function": "grpo_rewards:length"}]},
    )
    run, path = tmp_path / "run", {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = run_entry(tmp_path, recipe, oom_at="llmtune.objectives.grpo:GRPO.sample", **path)
    assert done.returncode == EXIT_PREEMPTED, done.stderr[-3000:]
    (line,) = error_lines(done.stderr)
    assert "out of memory in the generation at 16 generation rows a call" in line, line
    assert json.loads((run / OOM_FILE).read_text())["generation_rows"] == 8
    done = run_entry(tmp_path, recipe, **path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "out of memory generating: 8 rows a call" in done.stderr


def test_out_of_memory_gathering_the_final_model_stops_in_one_line_keeping_the_last_step(tiny_recipe, tmp_path):
    recipe = tiny_recipe(training__max_steps=3, checkpoint__every_n_steps=2)
    done = run_entry(tmp_path, recipe, oom_at="llmtune.parallel.engines:full_state_dict")
    assert done.returncode == 1, done.stderr[-3000:]
    (line,) = error_lines(done.stderr)
    assert line.startswith("llmtune: training stopped: out of memory gathering the whole model"), line
    assert "step-000003" in line  # the last step, checkpointed before stopping
    assert not (tmp_path / "run" / "final").exists()
