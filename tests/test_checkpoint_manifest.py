"""A checkpoint's manifest lists every process's files as each process sees them (llmtune.run.checkpoint): on storage
shared by several nodes that caches directories, the main process's own listing may miss a file another node wrote."""

from __future__ import annotations

import json
from pathlib import Path

import llmtune.run.checkpoint as checkpoint
from llmtune.cli.main import main


def test_the_manifest_holds_every_file_any_process_saw_at_the_largest_size_seen(tmp_path):
    folder = tmp_path / "step-000002"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"w" * 10)
    main_view = checkpoint.file_sizes(folder)
    assert main_view == {"model.safetensors": 10}
    # Another node saw the model at an older size (its attribute cache) and wrote its RNG state, unseen here.
    (folder / "random_states_1.pkl").write_bytes(b"r" * 3)
    checkpoint.write_manifest(folder, [main_view, {"model.safetensors": 4, "random_states_1.pkl": 3}])
    files = json.loads((folder / checkpoint.MANIFEST_FILE).read_text())["files"]
    assert files == {"model.safetensors": 10, "random_states_1.pkl": 3}
    assert checkpoint.unsound(folder) is None


def test_a_file_only_another_process_saw_is_in_the_manifest_of_a_real_checkpoint(tiny_recipe, monkeypatch):
    """The peer's report comes through the gather: its file, written after the main process listed the folder (to
    it, as if hidden by a directory cache), is listed, and the checkpoint is sound. The manifest used to be the main
    process's listing alone."""
    recipe = tiny_recipe(training__max_steps=2, checkpoint__every_n_steps=2)
    run = recipe.parent / "run"

    def gathered(reports: list[dict[str, int]]) -> list[dict[str, int]]:
        peer = run / "checkpoints" / ".step-000002.tmp" / "random_states_1.pkl"
        peer.write_bytes(b"r" * 100)
        return [*reports, {"random_states_1.pkl": 100}]

    monkeypatch.setattr(checkpoint, "gather_object", gathered, raising=False)
    assert main(["train", "--recipe", str(recipe)]) == 0
    (saved,) = checkpoint.complete_checkpoints(run)
    files = json.loads((saved / checkpoint.MANIFEST_FILE).read_text())["files"]
    assert files["random_states_1.pkl"] == 100 and "random_states_0.pkl" in files
    assert Path(saved / "random_states_1.pkl").stat().st_size == 100
