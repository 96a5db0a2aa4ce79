"""Every user-supplied input, given wrong, to every command: exit status 2, one error line that names the input,
no traceback, and nothing written. Most cases run `llmtune.cli.main.main` in-process (fast); a few run the real
command in a subprocess (the hub offline, and the plain `scripts/finetune.py` entry point)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from llmtune.cli.main import main

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Ctx:
    tmp: Path
    recipe: Path  # a valid tiny recipe; its output_dir is tmp/run
    model: Path  # the tiny model folder (tokenizer, config, weights)
    data: Path  # valid prompt/completion rows

    def file(self, name: str, content: str | bytes) -> Path:
        path = self.tmp / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return path

    def folder(self, name: str, *copy_from_model: str, **files: str) -> Path:
        path = self.tmp / name
        path.mkdir()
        for f in copy_from_model:
            shutil.copy(self.model / f, path / f)
        for f, content in files.items():
            (path / f.replace("__", ".")).write_text(content)
        return path


Case = Callable[[Ctx], tuple[list[str], str]]  # -> (argv, the input the message must name)

BAD_RECIPE_FILES: dict[str, Callable[[Ctx], Path]] = {
    "missing": lambda c: c.tmp / "no-such-recipe.yaml",
    "folder": lambda c: c.folder("recipes-folder.yaml"),
    "undecodable": lambda c: c.file("binary.yaml", b"\xff\xfe\x00\x80model: x\n"),
    "not-a-mapping": lambda c: c.file("list.yaml", "- model\n- data\n"),
    "yaml-syntax": lambda c: c.file("broken.yaml", "model: {name_or_path: [x\n"),
}
ONE_ROW = '{"prompt": "What is 2+2?", "completion": "4"}\n'
BAD_DATA_FILES: dict[str, Callable[[Ctx], Path]] = {
    "missing": lambda c: c.tmp / "no-such-data.jsonl",
    "broken-row": lambda c: c.file("broken.jsonl", '{"prompt": "a", "completion": "b"}\n{"prompt": "a",\n'),
    "missing-field": lambda c: c.file("nofield.jsonl", '{"prompt": "a", "completion": "b"}\n{"prompt": "a"}\n'),
    "unsupported-type": lambda c: c.file("rows.txt", "some text\n"),
    "empty": lambda c: c.file("empty.jsonl", ""),
    # Latin-1 bytes: pyarrow reads them and fails only when tokenising takes the value out, naming nothing.
    "not-utf8": lambda c: c.file("latin1.jsonl", b'{"prompt": "a", "completion": "b"}\n{"prompt": "caf\xe9"}\n'),
}


def recipe_cmd(command: str, make: Callable[[Ctx], Path]) -> Case:
    def case(c: Ctx) -> tuple[list[str], str]:
        path = make(c)
        return [command, "--recipe", str(path)], str(path)

    return case


def data_cmd(command: str, make: Callable[[Ctx], Path]) -> Case:
    def case(c: Ctx) -> tuple[list[str], str]:
        path = make(c)
        return [command, "--recipe", str(c.recipe), f"data.train=[{{path: '{path}'}}]"], str(path)

    return case


def with_recipe(command: str, *args: str, named: str) -> Case:
    return lambda c: ([command, "--recipe", str(c.recipe), *args], named)


CASES: dict[str, Case] = {
    **{
        f"{cmd}-recipe-{kind}": recipe_cmd(cmd, make)
        for cmd in ("train", "estimate", "data")
        for kind, make in BAD_RECIPE_FILES.items()
    },  # fmt: skip
    **{f"{cmd}-data-{kind}": data_cmd(cmd, make) for cmd in ("train", "data") for kind, make in BAD_DATA_FILES.items()},
    # one row, where a step draws 32: refused before the model loads, not a ValueError at step 0
    "train-data-fewer-rows-than-a-step": lambda c: (
        ["train", "--recipe", str(c.recipe), f"data.train=[{{path: '{c.file('one.jsonl', ONE_ROW)}'}}]"],
        "global_batch_size",
    ),
    # model paths
    "train-model-missing": with_recipe("train", "model.name_or_path=./no-such-model", named="./no-such-model"),
    "data-model-missing": with_recipe("data", "model.name_or_path=/no/such/model", named="/no/such/model"),
    "train-model-no-config": lambda c: (
        [
            "train",
            "--recipe",
            str(c.recipe),
            f"model.name_or_path={c.folder('tok-only', 'tokenizer.json', 'tokenizer_config.json')}",
        ],
        str(c.tmp / "tok-only"),
    ),  # fmt: skip
    "estimate-model-missing": lambda c: (["estimate", "--model", "./no-such-model"], "./no-such-model"),
    "estimate-model-no-config": lambda c: (["estimate", "--model", str(c.folder("empty"))], str(c.tmp / "empty")),
    "estimate-config-missing": with_recipe("estimate", "--config", "./no-such-config", named="./no-such-config"),
    "estimate-model-not-in-catalogue-nor-hub-shape": lambda c: (["estimate", "--model", "a/b/c"], "a/b/c"),
    # tokenizer paths
    "train-tokenizer-missing": with_recipe("train", "model.tokenizer=./no-such-tok", named="./no-such-tok"),
    "data-tokenizer-empty-folder": lambda c: (
        ["data", "--recipe", str(c.recipe), f"model.tokenizer={c.folder('no-tok')}"],
        str(c.tmp / "no-tok"),
    ),
    "data-tokenizer-broken": lambda c: (
        ["data", "--recipe", str(c.recipe), f"model.tokenizer={c.folder('bad-tok', tokenizer__json='{not json')}"],
        str(c.tmp / "bad-tok"),
    ),
    # command-line flags and overrides
    "train-no-recipe-flag": lambda c: (["train"], "--recipe"),
    "train-override-without-value": with_recipe("train", "training.max_steps", named="training.max_steps"),
    "train-override-wrong-type": with_recipe("train", "training.max_steps=lots", named="training.max_steps"),
    "train-override-unknown-key": with_recipe("train", "training.max_stpes=3", named="training.max_stpes"),
    "data-show-not-a-number": with_recipe("data", "--show", "many", named="--show"),
    "estimate-device-memory": with_recipe("estimate", "--device-memory", "lots", named="--device-memory"),
    "estimate-unknown-gpu": lambda c: (["estimate", "--model", str(c.model), "--gpu", "b900"], "--gpu b900"),
    "estimate-seq-len-zero": lambda c: (["estimate", "--model", str(c.model), "--seq-len", "0"], "--seq-len"),
    "estimate-processes-not-a-number": with_recipe("estimate", "--num-processes", "two", named="--num-processes"),
    "estimate-model-and-recipe": with_recipe("estimate", "--model", "llama-3.1-8b", named="--model"),
    "estimate-lora-with-recipe": with_recipe("estimate", "--lora", named="--lora"),
    "estimate-nothing-to-plan": lambda c: (["estimate"], "--model"),
    "generate-run-missing": lambda c: (["generate", "--run", str(c.tmp / "no-run"), "--prompt", "x"], "no-run"),
    "generate-max-new-tokens": lambda c: (
        ["generate", "--run", str(c.tmp), "--prompt", "x", "--max-new-tokens", "0"],
        "--max-new-tokens",
    ),
    "generate-no-prompt": lambda c: (["generate", "--run", str(c.tmp)], "--prompt"),
    "generate-negative-temperature": lambda c: (
        ["generate", "--run", str(c.tmp), "--prompt", "x", "--temperature", "-1"],
        "--temperature",
    ),
    "chat-top-p-above-1": lambda c: (["chat", "--run", str(c.tmp), "--top-p", "1.5"], "--top-p"),
    "chat-run-missing": lambda c: (["chat", "--run", str(c.tmp / "no-run")], "no-run"),
    "chat-run-unfinished": lambda c: (
        ["chat", "--run", str(c.folder("unfinished", recipe__yaml="seed: 1"))],
        "unfinished",
    ),
    # a hub id while offline (HF_HUB_OFFLINE; the real environment variable is tested in a subprocess below)
    "offline-train-model": with_recipe("train", "model.name_or_path=some-org/some-model", named="some-org/some-model"),
    "offline-data-tokenizer": with_recipe("data", "model.tokenizer=some-org/some-tok", named="some-org/some-tok"),
    "offline-estimate-config": with_recipe("estimate", "--config", "some-org/some-model", named="some-org/some-model"),
    "chat-model-folder-without-weights": lambda c: (
        ["chat", "--run", str(c.folder("no-weights", "config.json", "tokenizer.json", "tokenizer_config.json"))],
        "no-weights",
    ),
    "merge-run-missing": lambda c: (["merge", "--run", str(c.tmp / "no-run")], "no-run"),
    "merge-not-a-run": lambda c: (["merge", "--run", str(c.folder("not-a-run"))], "not-a-run"),
    "merge-bad-dtype": lambda c: (["merge", "--run", str(c.tmp), "--dtype", "fp8"], "--dtype"),
}


@pytest.fixture
def ctx(tmp_path, tiny_recipe, tiny_model_dir, tiny_data) -> Ctx:
    return Ctx(tmp_path, tiny_recipe(), tiny_model_dir, tiny_data)


def tree(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def check(code: int, stderr: str, named: str, before: set[str], ctx: Ctx) -> None:
    assert code == 2, stderr
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if ": error:" in line]
    assert len(errors) == 1, stderr
    assert named in errors[0], errors[0]
    assert tree(ctx.tmp) == before, "something was written"


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_exits_2_with_one_message(name, ctx, capsys, monkeypatch):
    if name.startswith("offline-"):
        import huggingface_hub.constants

        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    # datasets' logger keeps the stderr of the test that first used it (a closed capture by now).
    for handler in logging.getLogger("datasets").handlers:
        if isinstance(handler, logging.StreamHandler):
            monkeypatch.setattr(handler, "stream", sys.stderr)
    argv, named = CASES[name](ctx)
    before = tree(ctx.tmp)
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse refuses bad flags by exiting
        code = exit_.code
    check(code, capsys.readouterr().err, named, before, ctx)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their permissions")
def test_unreadable_recipe(ctx, capsys):
    path = ctx.file("secret.yaml", "model: {name_or_path: x}\n")
    path.chmod(0)
    before = tree(ctx.tmp)
    check(main(["train", "--recipe", str(path)]), capsys.readouterr().err, str(path), before, ctx)


def run_cli(argv: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "from llmtune.cli.main import entry; entry()", *argv],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )


def test_hub_id_without_network_says_so_in_one_line(ctx):
    """HF_HUB_OFFLINE=1 stands for a machine without network (the test must not touch the network)."""
    before = tree(ctx.tmp)
    proc = run_cli(["estimate", "--model", "some-org/some-model"], HF_HUB_OFFLINE="1")
    check(proc.returncode, proc.stderr, "some-org/some-model", before, ctx)
    assert "offline" in proc.stderr


def test_finetune_script_refuses_broken_data(ctx):
    broken = BAD_DATA_FILES["broken-row"](ctx)
    before = tree(ctx.tmp)
    script = str(ROOT / "scripts" / "finetune.py")
    override = f"data.train=[{{path: '{broken}'}}]"
    proc = subprocess.run(
        [sys.executable, script, "--recipe", str(ctx.recipe), override], capture_output=True, text=True, timeout=120
    )
    check(proc.returncode, proc.stderr, f"{broken}: row 2", before, ctx)


@pytest.mark.parametrize(
    "env,named",
    [
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, "fsdp_version: 2"),
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "true"}, "fsdp_offload_params"),
        ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "1"}, "zero_stage 1"),
    ],
    ids=["fsdp1", "fsdp-offload", "zero1"],
)
def test_launcher_config_llmtune_cannot_run(env, named, ctx, capsys, monkeypatch):
    """What `accelerate launch --config_file` passes in the environment, asking for what llmtune does not run."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    before = tree(ctx.tmp)
    check(main(["train", "--recipe", str(ctx.recipe)]), capsys.readouterr().err, named, before, ctx)


def test_every_error_class_exits_by_its_base():
    """Each module's error class derives from llmtune.errors' bases, so the CLI maps it without a list to keep in
    step: a user's mistake exits 2, a failed run 1; the classes stay the ValueError/RuntimeError callers catch."""
    from llmtune.catalogue import CatalogueError
    from llmtune.cli.generate import GenerateError
    from llmtune.cli.plot import PlotError
    from llmtune.data import DataError
    from llmtune.errors import EXIT_FAILED, EXIT_USAGE, RunFailed, SetupError, UserError
    from llmtune.model.merge import MergeError
    from llmtune.plan import MemoryPlanError
    from llmtune.plan.planning import PlanError, TrainingError
    from llmtune.recipe import RecipeError
    from llmtune.run.checkpoint import ResumeError
    from llmtune.run.metrics import TrackerError

    user = [RecipeError, DataError, SetupError, ResumeError, TrackerError, PlanError, MemoryPlanError, CatalogueError]
    for cls in [*user, GenerateError, MergeError, PlotError]:
        assert issubclass(cls, UserError) and cls.exit_code == EXIT_USAGE, cls
    assert issubclass(TrainingError, RunFailed) and TrainingError.exit_code == EXIT_FAILED
    assert issubclass(RecipeError, ValueError) and issubclass(SetupError, RuntimeError)
