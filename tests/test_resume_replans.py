"""A resume whose recipe changes how a row's work is split (`parallel.*`) is planned again, as one that changes the
micro-batch or the checkpointing is (`llmtune.run.checkpoint.REPLANNED_KEYS`): the saved plan would keep the old
split at the same process count."""

from __future__ import annotations

import pytest

from llmtune.cli.main import main
from llmtune.run import checkpoint


@pytest.fixture
def stopped_at_2(tiny_recipe, capsys):
    """A run of 4 steps, ended after its checkpoint of step 2 (max_steps 2, then resumed with 4)."""
    recipe = tiny_recipe(checkpoint__every_n_steps=2, checkpoint__resume="auto")
    assert main(["train", "--recipe", str(recipe), "training.max_steps=2"]) == 0
    capsys.readouterr()
    return recipe


@pytest.mark.parametrize(
    ("change", "key"),
    [("parallel.tiled_mlp=true", "parallel.tiled_mlp"), ("parallel.sequence_parallel=1", "parallel.sequence_parallel")],
)
def test_a_changed_parallel_key_is_planned_again_on_resume(stopped_at_2, tmp_path, caplog, change, key):
    caplog.set_level("INFO")
    assert main(["train", "--recipe", str(stopped_at_2), change]) == 0
    assert "resumed from" in caplog.text and f"planned again ({key})" in caplog.text
    last = checkpoint.complete_checkpoints(tmp_path / "run")[-1]
    plan = checkpoint.saved_state(last)["plan"]
    assert plan["tiled_mlp"] is (key == "parallel.tiled_mlp")  # the resumed steps ran with the new plan's split
