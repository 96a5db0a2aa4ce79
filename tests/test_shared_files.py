"""What a run publishes (checkpoints, final/, a merged model) is readable as the user's umask says, like every other
file they write: safetensors creates its files 0600, which left a run shared on a cluster unreadable by the team."""

from __future__ import annotations

import os
import stat

import pytest

from llmtune.cli.main import main


@pytest.fixture
def umask_027():
    before = os.umask(0o027)
    yield 0o640
    os.umask(before)


@pytest.mark.parametrize("method", ["lora", "none"])
def test_published_files_follow_the_umask(tiny_recipe, tmp_path, umask_027, method):
    recipe = tiny_recipe(peft__method=method, training__max_steps=2, checkpoint__every_n_steps=2)
    assert main(["train", "--recipe", str(recipe)]) == 0
    run = tmp_path / "run"
    published = [p for folder in ("final", "checkpoints") for p in (run / folder).rglob("*") if p.is_file()]
    weights = [p.name for p in published if p.suffix == ".safetensors"]
    assert weights, "the run wrote no safetensors file"
    modes = {str(p.relative_to(run)): oct(stat.S_IMODE(p.stat().st_mode)) for p in published}
    assert modes == dict.fromkeys(modes, oct(umask_027))
