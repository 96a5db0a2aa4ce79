"""A run's output_dir: whether a new run may write into it, and one run at a time in it.

A new run writes recipe.yaml, starts metrics.jsonl over and replaces final/: in a folder that holds a finished run
(final/) or files no llmtune run wrote (`output_dir: .`, a typo'd home folder), that destroys work. Such a folder is
refused unless the recipe says `overwrite: true` or the run resumes one of its checkpoints.

While a run lives, its main process holds `output_dir/.llmtune.lock` (its pid and host): a second launch on the same
folder would interleave both runs' checkpoints, metrics and final/, so it fails at once, naming the holder. A lock
left by a process that is gone (same host, no such pid: SIGKILL, an out-of-memory exit) is taken over; one from
another host cannot be checked from here, and the message says how to remove it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from llmtune.errors import UserError
from llmtune.parallel.engines import decided_by_main

log = logging.getLogger(__name__)

LOCK_FILE = ".llmtune.lock"
# Everything llmtune writes into an output_dir: a run (checkpoint.py, metrics.py, resilience.py, the preference
# reference cache, the tensorboard tracker's `llmtune/`) and the commands that read a run (plot, merge, bench).
RUN_ENTRIES = frozenset(
    {
        "recipe.yaml",
        "metrics.jsonl",
        "run_summary.json",
        "checkpoints",
        "final",
        "reference",
        "out_of_memory.json",
        "llmtune",
        "curves.png",
        "merged",
        "bench",
        LOCK_FILE,
    }
)
# Hidden temporaries of the same writers (`.final.tmp`, `.final.old`, `.out_of_memory.json.0`, a stale lock's
# `.llmtune.lock.stale-<pid>`) and merges of checkpoints (`merged-step-000120`).
RUN_PREFIXES = (".final.", ".out_of_memory.json.", LOCK_FILE + ".", ".merged", "merged-")


class OutputDirError(UserError, RuntimeError):
    """The output_dir is not this run's to write: another run's, or not an llmtune run's, or in use."""


def is_run_entry(name: str) -> bool:
    return name in RUN_ENTRIES or name.startswith(RUN_PREFIXES)


def refusal(out: Path, *, resuming: bool, overwrite: bool) -> str | None:
    """Why a new run may not write into `out`, or None where it may."""
    if out.exists() and not out.is_dir():
        return f"output_dir {out}: exists and is not a folder; choose another output_dir"
    if resuming or overwrite or not out.is_dir():
        return None
    names = sorted(p.name for p in out.iterdir())
    foreign = [n for n in names if not is_run_entry(n)]
    # A run writes metrics.jsonl as soon as its recipe.yaml: a recipe.yaml alone is a user's recipe.
    if "recipe.yaml" in names and "metrics.jsonl" not in names:
        foreign.insert(0, "recipe.yaml")
    way_out = "choose another output_dir, or set overwrite=true (recipe key `overwrite`) to write into it anyway"
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        return f"output_dir {out}: holds files no llmtune run wrote ({shown}); {way_out}"
    if "final" in names:
        return (
            f"output_dir {out}: holds a finished run (final/), which a new run would replace; {way_out}"
            " (its final/, metrics.jsonl and recipe.yaml are then replaced)"
        )
    return None


class RunLock:
    """The lock file this process holds, or nothing (another process of the launch holds it, or none was taken).

    `created`: the outermost folder taking the lock created, removed again on release while empty, so a run refused
    before it wrote anything (bad data, a missing model) leaves no trace."""

    def __init__(self, path: Path | None = None, created: Path | None = None) -> None:
        self.path, self.created = path, created

    def release(self) -> None:
        """Remove the lock if it is still this process's (idempotent)."""
        if self.path is None:
            return
        holder = _holder(self.path)
        if holder is not None and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            self.path.unlink(missing_ok=True)
        folder, self.path = self.path.parent, None
        while self.created is not None and folder != self.created.parent:
            try:
                folder.rmdir()
            except OSError:  # not empty: the run wrote into it
                break
            folder = folder.parent


def take_lock(out: Path) -> RunLock:
    """Create `out/.llmtune.lock` for this process; raises OutputDirError while a live process holds it."""
    created = next((p for p in reversed([out, *out.parents]) if not p.exists()), None)
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_FILE
    me = {"pid": os.getpid(), "host": socket.gethostname()}
    for _ in range(2):  # a stale lock is moved aside once, then created anew
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _holder(path)
            if not _stale(holder):
                raise OutputDirError(_in_use(out, path, holder)) from None
            log.warning("%s: taking over the lock of %s, which is gone", out, _who(holder))
            aside = path.with_name(f"{LOCK_FILE}.stale-{os.getpid()}")
            try:  # only one of several processes taking it over wins the rename
                os.replace(path, aside)
            except FileNotFoundError:
                continue
            aside.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(me) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return RunLock(path, created)
    raise OutputDirError(_in_use(out, path, _holder(path)))


def claim(accelerator: Accelerator, output_dir: str, *, resuming: bool, overwrite: bool) -> RunLock:
    """Refuse a folder this run may not write (`refusal`), else lock it for the run's life. The main process decides
    and takes the lock; every process gets its verdict (another node's disk may not show the same files)."""
    out = Path(output_dir)
    held: list[RunLock] = []

    def decide() -> str | None:
        why = refusal(out, resuming=resuming, overwrite=overwrite)
        if why is None:
            try:
                held.append(take_lock(out))
            except OutputDirError as err:
                why = str(err)
        return why

    why = decided_by_main(accelerator, decide)
    if why is not None:
        raise OutputDirError(why)
    return held[0] if held else RunLock()


def _holder(path: Path) -> dict[str, Any] | None:
    """The lock's content; None when it is absent or not (yet) whole: its writer is still writing it."""
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _stale(holder: dict[str, Any] | None) -> bool:
    """A lock whose process is gone: on this host, and its pid is no live process, or is this process (a run built and
    never fitted in this process: a process trains one run at a time)."""
    if holder is None or holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    if holder["pid"] == os.getpid():
        return True
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def _who(holder: dict[str, Any] | None) -> str:
    if holder is None:
        return "a process that is still writing it"
    return f"pid {holder.get('pid')} on host {holder.get('host')}"


def _in_use(out: Path, path: Path, holder: dict[str, Any] | None) -> str:
    return (
        f"output_dir {out}: another run is using it ({_who(holder)} holds {path}); wait for it to end or choose"
        f" another output_dir (if that process is gone, delete {path})"
    )
