"""A run's output_dir: whether a new run may write into it, and one run at a time in it.

A new run writes recipe.yaml, starts metrics.jsonl over and replaces final/: in a folder that holds a finished run
(final/) or files no llmtune run wrote (`output_dir: .`, a typo'd home folder), that destroys work. Such a folder is
refused unless the recipe says `overwrite: true` or the run resumes one of its checkpoints.

While a run lives, its main process holds `output_dir/.llmtune.lock` (its pid, host and job): a second launch on the
same folder would interleave both runs' checkpoints, metrics and final/, so it fails at once, naming the holder. The
lock is a lease: a thread of the holder renews it (touches it) every RENEW_S, and a lock not renewed for LEASE_S is
its run's that is gone (SIGKILL, a node lost) and is taken over, from any host. Sooner where that can be known: on
the same host when its pid is no live process, and from any host by a later attempt of the same job (a SLURM
requeue, a torch elastic restart, `job_of`): a peer's death leaves rank 0 in a collective where no handler runs, and
the launcher's SIGKILL then leaves the lock behind. Taking over is atomic (`_take_over`): of several launches that
judged one lock stale, one wins.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from llmtune.errors import UserError
from llmtune.parallel.engines import decided_by_main

log = logging.getLogger(__name__)

LOCK_FILE = ".llmtune.lock"
# The lock's lease. Its holder renews it every RENEW_S; LEASE_S is long beside that, so a renewal held up (a busy
# host, a slow shared filesystem, an attribute cache of up to a minute, clocks some seconds apart) never expires a
# live run's lock; a run that is gone is taken over LEASE_S after its last renewal, a requeue of its job at once.
RENEW_S = 30.0
LEASE_S = 300.0
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
# Hidden temporaries of the same writers (`.final.tmp`, `.final.old`, `.out_of_memory.json.0`, a lock taking over a
# stale one: `.llmtune.lock.takeover-<hash>`, `.llmtune.lock.new-<pid>-<id>`) and merges of checkpoints
# (`merged-step-000120`).
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
    """The lock file this process holds (its bytes, `content`), or nothing (another process of the launch holds it,
    or none was taken). While held, a thread renews its lease (`renew`) every RENEW_S.

    `created`: the outermost folder taking the lock created, removed again on release while empty, so a run refused
    before it wrote anything (bad data, a missing model) leaves no trace."""

    def __init__(self, path: Path | None = None, created: Path | None = None, content: bytes = b"") -> None:
        self.path, self.created, self.content = path, created, content
        self._released = threading.Event()
        if path is not None:
            threading.Thread(target=self._renew_until_released, name="llmtune-lock", daemon=True).start()

    def renew(self) -> None:
        """Touch the lock (its mtime is the lease's start) while it is still this process's; one taken over or
        deleted is left alone, and said once: another run may then write into the same folder."""
        path = self.path
        try:
            if path is not None and path.read_bytes() == self.content:
                os.utime(path)
                return
        except FileNotFoundError:
            pass
        except OSError as err:  # a shared filesystem's hiccup: the next renewal, well within the lease, tries again
            log.warning("could not renew %s (%s)", path, err)
            return
        if not self._released.is_set():
            self._released.set()  # renews no more: the lock is another's now
            log.error("%s is no longer this run's (taken over or deleted): another run may use the folder", path)

    def release(self) -> None:
        """Remove the lock if it is still this process's (idempotent)."""
        self._released.set()
        if self.path is None:
            return
        with contextlib.suppress(OSError):
            if self.path.read_bytes() == self.content:
                self.path.unlink(missing_ok=True)
        folder, self.path = self.path.parent, None
        while self.created is not None and folder != self.created.parent:
            try:
                folder.rmdir()
            except OSError:  # not empty: the run wrote into it
                break
            folder = folder.parent

    def _renew_until_released(self) -> None:
        while not self._released.wait(RENEW_S):
            self.renew()


def take_lock(out: Path) -> RunLock:
    """Create `out/.llmtune.lock` for this process, or take over one whose run is gone (`_stale`); raises
    OutputDirError while another run holds it."""
    created = next((p for p in reversed([out, *out.parents]) if not p.exists()), None)
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_FILE
    mine = (json.dumps(_me()) + "\n").encode()
    for _ in range(3):  # the lock may change under a launch's feet (released, taken over): judged again each time
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            judged, age = _read(path)
            if judged is None:  # released meanwhile
                continue
            holder = _parsed(judged)
            why = _stale(holder, age)
            if why is None:
                raise OutputDirError(_in_use(out, path, holder, age)) from None
            if _take_over(path, judged, mine):
                log.warning("%s: taking over the lock of %s, %s", out, _who(holder), why)
                return RunLock(path, created, mine)
            continue
        _write(fd, mine)
        return RunLock(path, created, mine)
    judged, age = _read(path)
    raise OutputDirError(_in_use(out, path, _parsed(judged), age))


def _take_over(path: Path, judged: bytes, mine: bytes) -> bool:
    """Replace the lock at `path` by `mine` if it still is the one judged stale (`judged`: its bytes, which name it:
    holder, job and time taken); False where it changed since. Of several launches taking over one stale lock, one
    wins: the right to replace it is a file named after it, created with O_EXCL, and the lock is replaced in one
    rename, never absent meanwhile, so a launch that creates it anew cannot slip in. The others are refused."""
    claim = path.with_name(f"{LOCK_FILE}.takeover-{hashlib.sha256(judged).hexdigest()[:16]}")
    try:
        os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        raise OutputDirError(
            f"output_dir {path.parent}: another launch is taking over its stale lock {path} (if none is, delete"
            f" {claim})"
        ) from None
    try:
        if _read(path)[0] != judged:
            return False
        tmp = path.with_name(f"{LOCK_FILE}.new-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        _write(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644), mine)
        os.replace(tmp, path)
        return True
    finally:
        claim.unlink(missing_ok=True)


def _write(fd: int, content: bytes) -> None:
    """`content` into the new file `fd`, on disk before it is closed: a lock is read from other hosts."""
    with os.fdopen(fd, "wb") as f:
        f.write(content)
        f.flush()
        os.fsync(f.fileno())


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


def _me() -> dict[str, Any]:
    """What a lock says of its holder: this process, the job it is an attempt of (`job_of`), when it was taken, and
    the lease a reader may judge it by."""
    job, attempt = job_of(os.environ)
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "job": job,
        "attempt": attempt,
        "since": round(time.time(), 3),
        "lease_s": LEASE_S,
    }


def job_of(environ: Mapping[str, str]) -> tuple[str | None, list[int]]:
    """The scheduler's job this launch belongs to and its attempt: a SLURM job (SLURM_RESTART_COUNT counts its
    requeues), else a torch elastic run (TORCHELASTIC_RESTART_COUNT counts its restarts; "none", torchrun's default
    id, names no run). (None, [0, 0]) outside both. A requeued SLURM job starts torchrun afresh, hence both counts."""
    counts = [environ.get(k, "") for k in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")]
    attempt = [int(c) if c.isdigit() else 0 for c in counts]
    if environ.get("SLURM_JOB_ID"):
        return f"slurm:{environ['SLURM_JOB_ID']}", attempt
    elastic = environ.get("TORCHELASTIC_RUN_ID")
    return (f"torchelastic:{elastic}" if elastic and elastic != "none" else None), attempt


def _read(path: Path) -> tuple[bytes | None, float]:
    """The lock's bytes and the seconds since it was last renewed; (None, 0) when it is absent. Read through one open
    file: opening revalidates a shared filesystem's cached size and mtime."""
    try:
        with open(path, "rb") as f:
            return f.read(), time.time() - os.fstat(f.fileno()).st_mtime
    except FileNotFoundError:
        return None, 0.0


def _parsed(content: bytes | None) -> dict[str, Any] | None:
    """The lock's holder; None when it is absent or not (yet) whole: its writer is still writing it."""
    try:
        holder = json.loads(content or b"")
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


def _stale(holder: dict[str, Any] | None, age: float) -> str | None:
    """Why a lock whose holder is `holder`, last renewed `age` seconds ago, is held by no live run (in words), or None
    while it may be: an earlier attempt of this launch's job (a requeue, a restart: from any host); its process gone
    (this host, and its pid is no live process, or is this process: a run built and never fitted here, a process
    trains one run at a time); or its lease expired (from any host: its run stopped renewing it). A lock without a
    lease (an older llmtune's) expires never."""
    if holder is None:
        return None
    job, attempt = job_of(os.environ)
    if job is not None and holder.get("job") == job and _attempt(holder) < attempt:
        return f"an earlier attempt of this job ({job})"
    pid = holder.get("pid")
    if holder.get("host") == socket.gethostname() and isinstance(pid, int):
        if pid == os.getpid():
            return "this process's own"
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "which is gone"
        except PermissionError:  # alive, another user's
            pass
    lease = holder.get("lease_s")
    if isinstance(lease, (int, float)) and age > lease:
        return f"not renewed for {age:.0f} s (its lease is {lease:.0f} s): its run is gone"
    return None


def _attempt(holder: dict[str, Any]) -> list[int]:
    attempt = holder.get("attempt")
    return attempt if isinstance(attempt, list) and all(isinstance(a, int) for a in attempt) else [0, 0]


def _who(holder: dict[str, Any] | None) -> str:
    if holder is None:
        return "a process that is still writing it"
    job = f" ({holder['job'].replace(':', ' job ', 1)})" if isinstance(holder.get("job"), str) else ""
    return f"pid {holder.get('pid')} on host {holder.get('host')}{job}"


def _in_use(out: Path, path: Path, holder: dict[str, Any] | None, age: float) -> str:
    """The refusal: who holds the lock, and when it frees itself if its run is gone."""
    lease = holder.get("lease_s") if holder else None
    if not isinstance(lease, (int, float)):
        then = f"if that process is gone, delete {path}"
    else:
        expires = time.strftime("%H:%M:%S", time.localtime(time.time() - age + lease))
        then = (
            f"its run renews it every {RENEW_S:.0f} s, last {age:.0f} s ago; if that run is gone, the lock expires at"
            f" {expires} ({lease:.0f} s after its last renewal) and a launch then takes it over, as a requeue of the"
            f" same job (SLURM, torch elastic) does at once"
        )
    return (
        f"output_dir {out}: another run is using it ({_who(holder)} holds {path}); wait for it to end or choose"
        f" another output_dir ({then})"
    )
