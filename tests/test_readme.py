"""The README's commands as written: each one's program is what the set-up command installs into .venv/ (which the
README says to activate before them), each `llmtune` command parses with the real parser, the files it names ship
with the repository, and the offline estimate runs as typed."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from llmtune.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
USERS_OWN = {"recipes/mine.yaml"}  # the recipe the README asks the user to write


def commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def words(command: str) -> list[str]:
    return shlex.split(re.sub(r"\$\([^)]*\)", "", command))  # `$(...)` prints overrides: checked by its own test


def test_every_command_runs_in_the_environment_the_set_up_command_makes():
    first_in_venv = next(i for i, c in enumerate(commands()) if not c.startswith("make "))
    activate = README.index("source .venv/bin/activate")
    assert activate < README.index(commands()[first_in_venv]), "say how to enter .venv/ before the first command"
    venv_bin = Path(sys.executable).parent
    for command in commands():
        program = words(command)[0]
        assert program == "make" or (venv_bin / program).exists(), f"{command}: {program} is not in {venv_bin}"


def test_every_llmtune_command_parses_and_names_files_that_exist():
    parser = build_parser()
    checked = 0
    for command in commands():
        argv = words(command)
        if argv[0] == "llmtune":
            parser.parse_args(argv[1:])  # a wrong flag or subcommand exits 2 here
            checked += 1
        for arg in argv:
            if re.fullmatch(r"(recipes|scripts)/[\w./-]+\.(yaml|py)", arg) and arg not in USERS_OWN:
                assert (ROOT / arg).is_file(), f"{command}: {arg} does not exist"
    assert checked >= 5


@pytest.mark.slow
def test_the_offline_estimate_runs_as_typed():
    command = next(c for c in commands() if c.startswith("llmtune estimate --model"))
    llmtune = Path(sys.executable).parent / "llmtune"
    out = subprocess.run([str(llmtune), *words(command)[1:]], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
