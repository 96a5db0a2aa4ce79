"""Folders that are either whole or absent: written under a temporary name, then renamed into place.

Shared by checkpoints and merged models; its own module so that neither imports the other for it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def replace_dir(tmp: Path, final: Path) -> None:
    """Put the complete folder `tmp` in place of `final`; an older `final` goes only once `tmp` is there."""
    fsync_tree(tmp)
    old = final.with_name(f".{final.name}.old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def fsync_tree(path: Path) -> None:
    # The rename is only a commit point if the data it points to has reached the disk first.
    for file in path.rglob("*"):
        if file.is_file():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
