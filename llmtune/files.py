"""Folders that are either whole or absent: written under a temporary name, then renamed into place.

Shared by checkpoints and merged models; its own module so that neither imports the other for it.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import sys
from pathlib import Path


def replace_dir(tmp: Path, final: Path) -> None:
    """Put the complete folder `tmp` in place of `final`; an older `final` goes only once `tmp` is there.

    Linux swaps the two in one step (renameat2's RENAME_EXCHANGE): `final` names a whole folder at every instant. The
    fallback moves the older one aside first: a process killed between the two renames leaves no `final` (the old
    one in `.NAME.old`, the new one whole in `tmp`)."""
    settle_tree(tmp)
    if final.exists() and _exchange(tmp, final):
        shutil.rmtree(tmp, ignore_errors=True)  # now the older folder
        return
    old = final.with_name(f".{final.name}.old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where the system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)  # glibc >= 2.28
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _umask() -> int:
    # Read without changing it where Linux says it (os.umask sets it to read it, racing other threads).
    try:
        status = Path("/proc/self/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Umask:")), 8)
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def settle_tree(path: Path) -> None:
    """Every file under `path` on disk, with the mode a plain `open` gives (0666 less the umask), in one walk.

    The rename is only a commit point if the data it points to has reached the disk first. The mode: safetensors
    creates its files 0600, so a run shared on a cluster was unreadable by the team while the rest of its folder was
    not."""
    mode = 0o666 & ~_umask()
    for file in path.rglob("*"):
        if file.is_file():
            if not file.is_symlink():
                file.chmod(mode)
            with open(file, "rb") as f:
                os.fsync(f.fileno())
