"""What a run's log reads like: in a file or a CI log (stderr no terminal) no progress bar and none of Accelerate's
per-file checkpoint lines, llmtune's own lines kept; on a terminal the bar is drawn and log lines never land on it."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FINETUNE = [sys.executable, str(ROOT / "scripts" / "finetune.py")]
# What Accelerate says per checkpoint written or loaded (`llmtune.cli.main._QUIET` drops them).
ACCELERATE_LINES = ("Saving current state to", " saved in ", "Loading states from", "loaded successfully")


def run_to_file(recipe: Path, log: Path, *overrides: str) -> str:
    """Train with stdout and stderr to one file, as `> train.log 2>&1` does; the file's text."""
    with log.open("w") as out:
        proc = subprocess.run([*FINETUNE, "--recipe", str(recipe), *overrides], stdout=out, stderr=subprocess.STDOUT)
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    return text


@pytest.mark.slow
def test_a_log_file_has_no_bar_and_no_accelerate_checkpoint_lines(tiny_recipe, tmp_path):
    recipe = tiny_recipe(training__max_steps=2, checkpoint__every_n_steps=1, logging__progress_bar=True)
    text = run_to_file(recipe, tmp_path / "train.log", "logging.every_n_steps=1")
    assert "\r" not in text and "step/s" not in text  # neither llmtune's bar nor transformers' (writing final/)
    assert not [line for line in text.splitlines() if any(s in line for s in ACCELERATE_LINES)], text
    run = tmp_path / "run"
    assert f"saved checkpoint {run / 'checkpoints' / 'step-000002'}" in text  # llmtune's own line stays
    assert re.search(r"^step +2  loss ", text, re.M)  # and the step lines, which say what the bar would

    # A resume: Accelerate's per-file load lines go too, llmtune's one line says where it continues from.
    text = run_to_file(recipe, tmp_path / "resume.log", "training.max_steps=3", "checkpoint.resume=auto")
    assert f"resumed from {run / 'checkpoints' / 'step-000002'} at step 2" in text
    assert "\r" not in text and not [line for line in text.splitlines() if any(s in line for s in ACCELERATE_LINES)]


def run_on_a_terminal(command: list[str]) -> tuple[int, str]:
    """Run `command` with stderr on a pseudo-terminal of 120 columns (stdout piped apart); its exit status and what
    the terminal received."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    chunks: list[bytes] = []

    def read() -> None:
        while True:
            try:
                data = os.read(leader, 65536)
            except OSError:  # EIO: the last writer closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        proc = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=follower)
    finally:
        os.close(follower)
        reader.join()
        os.close(leader)
    return proc.returncode, b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_on_a_terminal_the_bar_is_drawn_and_log_lines_keep_their_own(tiny_recipe):
    recipe = tiny_recipe(training__max_steps=4, checkpoint__every_n_steps=2, logging__progress_bar=True)
    status, screen = run_on_a_terminal([*FINETUNE, "--recipe", str(recipe)])
    assert status == 0, screen[-3000:]
    written = re.split(r"[\r\n]", screen)
    assert any("step/s" in line for line in written)  # `logging.progress_bar`: on where it can be drawn
    assert any("saved checkpoint" in line for line in written)
    assert not [line for line in written if "step/s" in line and " INFO " in line]  # no log line glued to the bar
